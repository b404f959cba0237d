"""The rows of models.parquet and activations.parquet for one model (which points, the time limit)."""

from __future__ import annotations

import signal
import time
from time import monotonic
from contextlib import contextmanager
from dataclasses import dataclass

from pipeline.core.text import first_line
from pipeline.activations.counts import Measurement, ModelCounter, PointTimeout
from pipeline.activations.points import (
    DEFAULT_POINTS,
    HOOK_DTYPES,
    POINT_SETS,
    MODEL_TIME_LIMIT_S,
    POINT_TIME_LIMIT_S,
    PRECISION_BYTES,
    PointSet,
    skip_reason,
)
from pipeline.inputs.modeling import architecture_facts, parameter_counts, text_config


MODEL_COLUMNS = (
    "model_id", "family", "model_type", "status", "reason", "config_source", "config_revision", "parameters",
    "embedding_parameters", "non_embedding_parameters", "active_parameters", "is_moe", "num_experts",
    "num_experts_per_tok", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "context_length", "tie_word_embeddings", "attention_kind",
    "seconds",  # to count the model, building included
)
ACTIVATION_COLUMNS = (
    "model_id", "family", "model_type", "parameters", "method", "dtype", "batch_size", "seq_len", "tokens",
    "elements", "elements_per_token", "bytes", "bytes_per_token", "forward", "status", "reason", "seconds",
    "config_source", "config_revision",
)


@dataclass
class ModelJob:
    model_id: str
    family: str | None
    model_type: str | None
    config: object | None  # transformers config; None when there is none to count
    config_source: str | None = None
    config_revision: str | None = None
    skip_reason: str | None = None  # the configs stage skipped the model
    config_error: str | None = None  # the configs stage's config does not load


def count_model(job: ModelJob, points: PointSet = POINT_SETS[DEFAULT_POINTS]):
    """(models row, activation rows) of one model; a failure becomes rows with status and reason."""
    start = time.perf_counter()
    base = {"model_id": job.model_id, "family": job.family, "model_type": job.model_type,
            "config_source": job.config_source, "config_revision": job.config_revision}
    model_row = {**base, "status": "ok", "reason": None}
    rows = []
    if job.config is None:
        model_row.update(status="error" if job.config_error else "skipped", reason=job.config_error or job.skip_reason)
    else:
        deadline = monotonic() + MODEL_TIME_LIMIT_S  # real time: the row's `seconds` clock may be another
        try:
            with time_limit(MODEL_TIME_LIMIT_S):
                counter = ModelCounter(job.config)
                model_row.update(architecture_facts(job.config))
                counts = parameter_counts(counter.model("float32"), job.config)
        except Exception as exc:  # noqa: BLE001 - a config transformers cannot build: the model is an error row
            model_row.update(status="error", reason=first_line(exc))
        else:
            model_row.update({k: counts[k] for k in MODEL_COLUMNS if k in counts},
                             is_moe=bool(counts["routed_expert_parameters"]))
            base["parameters"] = counts["parameters"]
            wanted = [("hook", "float32", b, s) for b, s in points.hook]
            wanted += [("saved", p, b, s) for p in points.precisions for b, s in points.saved]
            rows = measure_points(counter, base, wanted, model_row["context_length"], deadline)
            failed = [row for row in rows if row["status"] == "error"]
            if rows and len(failed) == len(rows):
                model_row.update(status="error", reason=f"every count failed: {failed[0]['reason']}")
    model_row["seconds"] = round(time.perf_counter() - start, 3)
    return model_row, rows


def measure_points(counter: ModelCounter, base: dict, wanted: list, context: int | None,
                   deadline: float | None = None) -> list[dict]:
    """One row per point (two per hook point: float32 and bfloat16 bytes); which points are counted
    follows from the model and the point (points.skip_reason), never from timings; the time limits
    (per point, and the model's `deadline`) are safety nets that no registry model comes near."""
    config = counter.config
    model_types = (getattr(config, "model_type", None), getattr(text_config(config), "model_type", None))
    rows = []
    for method, dtype, batch, seq in wanted:
        reason = skip_reason(model_types, seq, context)
        if reason:
            measurement = Measurement(status="skipped", reason=reason)
        else:
            left = POINT_TIME_LIMIT_S if deadline is None else min(POINT_TIME_LIMIT_S, deadline - monotonic())
            try:
                if left <= 0:
                    raise PointTimeout(f"the model's time limit of {MODEL_TIME_LIMIT_S:.0f} s was reached")
                with time_limit(left):
                    measurement = counter.hook(batch, seq) if method == "hook" else counter.saved(batch, seq, dtype)
            except PointTimeout as exc:
                measurement = Measurement(status="error", reason=str(exc))
        rows.extend(_rows(base, method, dtype, batch, seq, measurement))
    return rows


def _rows(base, method, dtype, batch, seq, measurement: Measurement) -> list[dict]:
    tokens = batch * seq
    ok = measurement.status == "ok"
    row = {
        **base, "method": method, "dtype": dtype, "batch_size": batch, "seq_len": seq, "tokens": tokens,
        "elements": measurement.elements if ok else None,
        "elements_per_token": measurement.elements / tokens if ok else None,
        "bytes": measurement.bytes if ok else None,
        "bytes_per_token": measurement.bytes / tokens if ok and measurement.bytes is not None else None,
        "forward": measurement.forward, "status": measurement.status, "reason": measurement.reason,
        "seconds": round(measurement.seconds, 4),
    }
    if method == "saved":
        return [row]
    rows = []
    for hook_dtype in HOOK_DTYPES:  # bytes = elements x element size of the dtype (docs/definitions.md)
        nbytes = measurement.elements * PRECISION_BYTES[hook_dtype] if ok else None
        rows.append({**row, "dtype": hook_dtype, "bytes": nbytes,
                     "bytes_per_token": nbytes / tokens if ok else None})
    return rows


@contextmanager
def time_limit(seconds: float | None):
    """Raise PointTimeout in the main thread after `seconds` (no limit elsewhere or when None)."""
    import threading

    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise PointTimeout(f"time limit of {seconds:.0f} s reached")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
