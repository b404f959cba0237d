"""What the page offers and labels: the registry's models, the GPU catalogue, and each method's
measured accuracy (read once when the server starts; all pure data, no torch).

Imports that may move with the package's layout: the registry (`pipeline.inputs.registry.load_registry`,
`pipeline.core.paths.DEFAULT_REGISTRY`), the GPU catalogue (`pipeline.formulas.gpus.DEVICES`), the stage
outputs' paths (`pipeline.core.paths.MODELS`, `CONFIGS`: relative to the working directory, as the
`estimate` command reads them).
"""

from __future__ import annotations

import json
from pathlib import Path

VALIDATION_SUMMARY = "results/validation_summary.json"
# The accuracy shown beside each method: the summary's row for it (the formula's on families left
# out of its fit, as the README quotes it), over the measured H200 peaks.
ACCURACY_ROWS = {"formula": ("formula-lofo", "families left out of the fit"), "exact": ("exact", "every point"),
                 "heuristic": ("heuristic-lofo", "families left out of the fit"), "blog": ("blog", "as published")}


def models() -> list[dict]:
    """The registry: id, family, model_type, parameters and active parameters, context length
    (from the activations stage's table when there is one), and whether the formula has its config facts."""
    from pipeline.core.paths import CONFIGS, DEFAULT_REGISTRY, MODELS
    from pipeline.inputs.registry import load_registry

    counted = _counted_models(MODELS)
    records = _config_records(CONFIGS)
    listed = []
    for entry in load_registry(DEFAULT_REGISTRY, check_model_types=False):
        row = counted.get(entry.id, {})
        listed.append({"id": entry.id, "family": entry.family, "model_type": entry.model_type,
                       "parameters": row.get("parameters"), "active_parameters": row.get("active_parameters"),
                       "context_length": row.get("context_length"),
                       "trust_remote_code": entry.trust_remote_code,
                       "formula": records.get(entry.id, {}).get("status") == "ok"})
    return listed


def _counted_models(path) -> dict:
    if not Path(path).is_file():
        return {}
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["model_id", "status", "parameters", "active_parameters", "context_length"])
    rows = {}
    for row in table.to_pylist():
        if row["status"] == "ok":
            rows[row["model_id"]] = {key: None if value is None else int(value) for key, value in row.items()
                                     if key in ("parameters", "active_parameters", "context_length")}
    return rows


def _config_records(path) -> dict:
    from pipeline.inputs.configs import read_config_records
    from pipeline.core.errors import UserError

    if not Path(path).is_file():
        return {}
    try:
        return read_config_records(path)
    except UserError:
        return {}


def gpus() -> list[dict]:
    """The GPU catalogue: name, nvidia-smi total (MiB and bytes), CUDA's total where known, the source."""
    from pipeline.formulas.gpus import DEVICES

    return [{"name": d.name, "total_mib": d.total_mib, "total_bytes": d.total_bytes,
             "cuda_total_mib": d.cuda_total_mib, "driver_reserved_bytes": d.driver_reserved_bytes,
             "source": d.source} for d in DEVICES.values()]


def accuracy() -> dict:
    """Per method: |error| of the peak (median, 90th percentile, worst) and the fit verdict's accuracy
    over the measured points, from the validate stage's summary ({} without one)."""
    path = Path(VALIDATION_SUMMARY)
    if not path.is_file():
        return {}
    overall = json.loads(path.read_text()).get("overall", {})
    found = {}
    for method, (row, basis) in ACCURACY_ROWS.items():
        if row in overall:
            r = overall[row]
            found[method] = {"basis": basis, "points": r.get("points"),
                             "median": r.get("median_abs_relative_error"), "p90": r.get("p90_abs_relative_error"),
                             "worst": r.get("worst_abs_relative_error"), "fit_accuracy": r.get("fit_accuracy"),
                             "source": f"{VALIDATION_SUMMARY} ({row})"}
    return found
