"""The simulate stage: the simulator's prediction at every measured point of the peak table."""

from __future__ import annotations

import functools

from pipeline.core.paths import CONFIGS, PEAKS, SIMULATED
from pipeline.core.errors import UserError
from pipeline.simulate.api import simulate
from pipeline.core.text import first_line
from pipeline.training.values import Run
from pipeline.training.points import POINT_KEY, read_peaks

SIMULATED_COLUMNS = ("simulated_peak_bytes", "simulated_forward_peak_bytes", "simulated_backward_peak_bytes",
                     "simulated_optimizer_peak_bytes", "simulated_saved_bytes", "simulated_optimizer_state_bytes",
                     "simulated_peak_phase", "simulate_status", "simulate_reason", "simulate_seconds",
                     "simulated_peak_reserved_bytes")


def simulate_peaks(peaks_path=PEAKS, configs_path=CONFIGS, out_path=SIMULATED, workers: int = 1):
    """The simulator's prediction for every measured point (ok and oom rows).

    Points of one model and precision run in one process (its meta model is built once);
    `workers` > 1 spreads the models over that many forked processes.
    """
    import pandas as pd

    from pipeline.core.io import write_parquet
    from pipeline.core.provenance import provenance

    peaks = read_peaks(peaks_path)
    configs = ok_config_records(configs_path)
    keys = list(POINT_KEY)
    missing = [k for k in keys + ["status"] if k not in peaks.columns]
    if missing:
        raise UserError(f"{peaks_path}: missing columns {', '.join(missing)}")
    points = peaks[peaks["status"].isin(["ok", "oom"])][keys].drop_duplicates()
    points = points.sort_values(["model_id", "precision", "attn_implementation"])
    groups = [group.to_dict("records") for _, group in points.groupby("model_id", sort=False)]
    rows = [row for chunk in _map(functools.partial(_simulate_rows, configs=configs), groups, workers)
            for row in chunk]
    frame = pd.DataFrame(rows, columns=keys + list(SIMULATED_COLUMNS))
    for column, value in provenance(include_device=False).items():
        frame[column] = value
    frame["config_source"] = frame["model_id"].map(lambda m: configs.get(m, {}).get("config_source"))
    frame["config_revision"] = frame["model_id"].map(lambda m: configs.get(m, {}).get("config_revision"))
    write_parquet(frame, out_path)
    return frame


def ok_config_records(path) -> dict:
    """configs.json's ok records by model id (each model's config is parsed when it is used, so
    that one bad config does not stop the others)."""
    from pipeline.inputs.configs import read_config_records

    return {model_id: r for model_id, r in read_config_records(path).items()
            if isinstance(r, dict) and r.get("status") == "ok"}


def _simulate_rows(points: list[dict], configs: dict) -> list[dict]:
    return [dict(point, **_simulate_row(point, configs)) for point in points]


def _map(function, items: list, workers: int) -> list:
    if workers <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(min(workers, len(items))) as pool:
        return pool.map(function, items, chunksize=1)


def _simulate_row(point: dict, configs: dict) -> dict:
    row = dict.fromkeys(SIMULATED_COLUMNS)
    record = configs.get(point["model_id"])
    if record is None:
        return dict(row, simulate_status="skipped", simulate_reason="no config in the configs file")
    try:
        result = simulate(record["config"], Run.from_row(point))
    except Exception as exc:  # noqa: BLE001 - one failing model becomes a row with its reason
        return dict(row, simulate_status="error", simulate_reason=first_line(exc))
    details = result.details
    phases = details["phase_peaks"]
    return dict(row, simulated_peak_bytes=result.peak_bytes, simulated_forward_peak_bytes=phases["forward"],
                simulated_backward_peak_bytes=phases["backward"], simulated_optimizer_peak_bytes=phases["optimizer"],
                simulated_saved_bytes=details["saved_bytes"], simulated_optimizer_state_bytes=details["optimizer_state_bytes"],
                simulated_peak_phase=details["peak_phase"], simulate_status="ok", simulate_seconds=details["seconds"],
                simulated_peak_reserved_bytes=result.reserved_bytes)
