"""The simulate stage: the simulator's prediction at every measured point of the peak table."""

from __future__ import annotations

import functools

from pipeline.paths import CONFIGS, PEAKS, SIMULATED
from pipeline.errors import UserError
from pipeline.simulate.predict import first_line, predict_peak
from pipeline.sweep.parts import with_client_columns_frame
from pipeline.vocabulary import POINT_KEY

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

    from pipeline.io import write_parquet
    from pipeline.provenance import provenance

    peaks = with_client_columns_frame(_read_table(peaks_path))  # a table from before the client columns
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
    from pipeline.configs import read_config_records

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


def _read_table(path):
    import pandas as pd

    try:
        return pd.read_parquet(path)
    except FileNotFoundError:
        raise UserError(f"{path}: peak table not found") from None
    except Exception as exc:  # noqa: BLE001 - not a parquet file
        raise UserError(f"{path}: not a readable parquet table ({type(exc).__name__})") from None


def point_adapter(point: dict):
    """The AdapterSpec of a point with adapters (lora_r set); alpha changes no memory (default 2r)."""
    import pandas as pd

    if point.get("lora_r") is None or pd.isna(point.get("lora_r")):
        return None
    from pipeline.adapters import AdapterSpec

    quantization = point.get("quantization")
    return AdapterSpec.make(int(point["lora_r"]), None, point["lora_targets"],
                            None if quantization is None or pd.isna(quantization) else quantization)


def _simulate_row(point: dict, configs: dict) -> dict:
    row = dict.fromkeys(SIMULATED_COLUMNS)
    record = configs.get(point["model_id"])
    if record is None:
        return dict(row, simulate_status="skipped", simulate_reason="no config in the configs file")
    try:
        result = predict_peak(record["config"], int(point["batch_size"]), int(point["seq_len"]), point["precision"],
                              point["optimizer"], bool(point["gradient_checkpointing"]),
                              point["attn_implementation"], point["variant"], point_adapter(point))
    except Exception as exc:  # noqa: BLE001 - one failing model becomes a row with its reason
        return dict(row, simulate_status="error", simulate_reason=first_line(exc))
    phases = result["phase_peaks"]
    return dict(row, simulated_peak_bytes=result["peak_bytes"], simulated_forward_peak_bytes=phases["forward"],
                simulated_backward_peak_bytes=phases["backward"], simulated_optimizer_peak_bytes=phases["optimizer"],
                simulated_saved_bytes=result["saved_bytes"],
                simulated_optimizer_state_bytes=result["optimizer_state_bytes"],
                simulated_peak_phase=result["peak_phase"], simulate_status="ok", simulate_seconds=result["seconds"],
                simulated_peak_reserved_bytes=result["peak_reserved_bytes"])
