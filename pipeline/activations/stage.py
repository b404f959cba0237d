"""The counting stage: every registry model, in one process or a small pool forked after the imports."""

from __future__ import annotations

import gc
import sys
import time

from pipeline.core.text import first_line
from pipeline.activations.counts import quiet_transformers
from pipeline.activations.points import DEFAULT_POINTS, POINT_SETS, PointSet
from pipeline.activations.table import ACTIVATION_COLUMNS, MODEL_COLUMNS, ModelJob, count_model
from pipeline.core.errors import UserError
from pipeline.core.vocabulary import check_choice


_WORK: dict = {"jobs": [], "points": None}  # read by forked workers


def read_jobs(registry_path, configs_path) -> list[ModelJob]:
    """One job per registry model, with the config the configs stage resolved (or why it has none)."""
    from pipeline.inputs.configs import config_from_dict, read_config_records
    from pipeline.inputs.registry import load_registry

    entries = load_registry(registry_path, check_model_types=False)
    records = read_config_records(configs_path)
    jobs = []
    for entry in entries:
        record = records.get(entry.id)
        job = ModelJob(entry.id, entry.family, entry.model_type, None)
        if record is None:
            job.skip_reason = f"not in {configs_path}"
        elif record.get("status") != "ok":
            job.skip_reason = record.get("reason") or "config skipped by the configs stage"
        else:
            job.config_source, job.config_revision = record["config_source"], record["config_revision"]
            try:
                job.config = config_from_dict(record["config"], entry.id)
            except UserError as exc:
                job.config_error = f"the configs stage's config does not load: {exc}"
        jobs.append(job)
    return jobs


def _count_job(index: int):
    import warnings

    warnings.filterwarnings("ignore")
    job = _WORK["jobs"][index]
    try:
        return index, count_model(job, _WORK["points"])
    except Exception as exc:  # noqa: BLE001 - whatever happens to one model, the stage goes on
        return index, ({"model_id": job.model_id, "family": job.family, "model_type": job.model_type,
                        "config_source": job.config_source, "config_revision": job.config_revision,
                        "status": "error", "reason": first_line(exc)}, [])


def _init_worker():
    import torch

    torch.set_num_threads(1)


def count_all(jobs: list[ModelJob], workers: int = 2, points: PointSet = POINT_SETS[DEFAULT_POINTS],
              progress=None):
    """models and activations DataFrames for `jobs`; progress (done / total, elapsed) on `progress`."""
    import multiprocessing

    import pandas as pd

    from pipeline.core.provenance import provenance

    quiet_transformers()
    gc.freeze()  # the imports' objects: out of every later collection, and shared copy-on-write by the workers
    progress = progress or sys.stderr
    _WORK.update(jobs=jobs, points=points)
    start = time.perf_counter()
    results = [None] * len(jobs)

    def report(done, index):
        job = jobs[index]
        status = results[index][0]["status"]
        elapsed = time.perf_counter() - start
        left = elapsed / done * (len(jobs) - done)
        print(f"activations: {done}/{len(jobs)} {job.model_id} {status} ({elapsed:.1f} s, about {left:.0f} s left)",
              file=progress, flush=True)

    if workers > 1 and len(jobs) > 1:
        with multiprocessing.get_context("fork").Pool(workers, initializer=_init_worker) as pool:
            for done, (index, result) in enumerate(pool.imap_unordered(_count_job, range(len(jobs))), 1):
                results[index] = result
                report(done, index)
    else:
        for index in range(len(jobs)):
            results[index] = _count_job(index)[1]
            report(index + 1, index)
    common = provenance()
    models = pd.DataFrame([{**row, **common} for row, _ in results], columns=[*MODEL_COLUMNS, *common])
    activations = pd.DataFrame([{**row, **common} for _, rows in results for row in rows],
                               columns=[*ACTIVATION_COLUMNS, *common])
    return _integer_columns(models), _integer_columns(activations)


def _integer_columns(frame):
    for column in frame.columns:
        if column in ("parameters", "embedding_parameters", "non_embedding_parameters", "active_parameters",
                      "num_experts", "num_experts_per_tok", "num_hidden_layers", "hidden_size",
                      "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                      "context_length", "batch_size", "seq_len", "tokens", "elements", "bytes"):
            frame[column] = frame[column].astype("Int64")
    return frame


def write_activations(registry_path, configs_path, models_out, activations_out, workers: int = 2,
                      model_ids: list[str] | None = None, points: str = DEFAULT_POINTS):
    """The stage: count every registry model and write both tables (together, or not at all)."""
    from pipeline.core.io import written_together

    jobs = read_jobs(registry_path, configs_path)
    if model_ids:
        unknown = sorted(set(model_ids) - {job.model_id for job in jobs})
        if unknown:
            raise UserError(f"model {unknown[0]!r} is not in the registry")
        jobs = [job for job in jobs if job.model_id in model_ids]
    check_choice("points", points, POINT_SETS)
    models, activations = count_all(jobs, workers, POINT_SETS[points])
    with written_together([models_out, activations_out]) as (models_tmp, activations_tmp):
        models.to_parquet(models_tmp, index=False)
        activations.to_parquet(activations_tmp, index=False)
    return models, activations
