"""Accuracy of the simulator (pipeline.simulate) against the measured H200 peaks.

    python benchmarks/simulate_accuracy.py [--peaks results/peak_memory.parquet]
        [--simulated results/simulated.parquet] [--simulate] [--models ID ...]

Reads the measured table and the simulated one (`python -m pipeline simulate-peaks`; with
`--simulate` it is (re)made first, for `--models` only if given). For every measured `ok` row:
relative error (predicted - measured) / measured of the peak and of each phase's peak; for `ok`
and `oom` rows: whether the prediction fits the GPU (peak <= the row's gpu_total_bytes) agrees
with the measurement. Prints the error distribution per architecture and precision and writes
results/simulate_accuracy.md and results/simulate_accuracy.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pipeline.training.points import STANDARD_KEY

KEYS = list(STANDARD_KEY)
from pipeline.formulas.gpus import DEVICES, MIB

H200_BYTES = DEVICES["H200"].cuda_total_mib * MIB  # what torch reports as the H200's total memory (when a row lacks it)
PHASES = ("forward", "backward", "optimizer")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peaks", default="results/peak_memory.parquet")
    parser.add_argument("--configs", default="results/configs.json")
    parser.add_argument("--simulated", default="results/simulated.parquet")
    parser.add_argument("--simulate", action="store_true", help="(re)make the simulated table first")
    parser.add_argument("--models", nargs="+", help="only these models")
    parser.add_argument("--workers", type=int, default=1, help="processes for --simulate")
    parser.add_argument("--out", default="results/simulate_accuracy")
    args = parser.parse_args(argv)

    import pandas as pd

    from pipeline.core.io import write_json, write_text

    peaks = pd.read_parquet(args.peaks)
    if args.models:
        peaks = peaks[peaks["model_id"].isin(args.models)]
    if args.simulate:
        simulated = simulate(peaks, args.configs, args.simulated, args.workers)
    else:
        simulated = pd.read_parquet(args.simulated)
    table = compare(peaks, simulated)
    summary = summarise(table)
    report = render(summary, table)
    print(report)
    write_text(report, f"{args.out}.md")
    write_json(summary, f"{args.out}.json")
    return 0


def simulate(peaks, configs_path, out_path, workers=1):
    """simulate-peaks on (a subset of) the measured table."""
    import tempfile

    from pipeline.simulate.peaks import simulate_peaks

    with tempfile.TemporaryDirectory() as folder:
        subset = Path(folder) / "peaks.parquet"
        peaks.to_parquet(subset)
        return simulate_peaks(subset, configs_path, out_path, workers)


def compare(peaks, simulated):
    """One row per measured ok/oom point with its prediction and errors."""
    measured = peaks[peaks["status"].isin(["ok", "oom"])].copy()
    for column in ("gradient_checkpointing",):
        measured[column] = measured[column].astype(bool)
        simulated = simulated.assign(**{column: simulated[column].astype(bool)})
    table = measured.merge(simulated, on=KEYS, how="inner", suffixes=("", "_sim"))
    table = table[table["simulate_status"] == "ok"].copy()
    capacity = table["gpu_total_bytes"].fillna(H200_BYTES) if "gpu_total_bytes" in table else H200_BYTES
    table["fits_measured"] = table["status"] == "ok"
    table["fits_predicted"] = table["simulated_peak_bytes"] <= capacity
    ok = table["status"] == "ok"
    table.loc[ok, "error"] = (table.loc[ok, "simulated_peak_bytes"] - table.loc[ok, "peak_allocated_bytes"]) \
        / table.loc[ok, "peak_allocated_bytes"]
    for phase in PHASES:
        measured_phase = table.loc[ok, f"{phase}_peak_bytes"].astype(float)
        table.loc[ok, f"{phase}_error"] = (table.loc[ok, f"simulated_{phase}_peak_bytes"] - measured_phase) \
            / measured_phase
    return table


def _stats(group) -> dict:
    errors = group["error"].dropna().astype(float)
    absolute = errors.abs()
    return {
        "rows": int(len(group)), "ok_rows": int(len(errors)),
        "median_abs_error": float(absolute.median()) if len(errors) else None,
        "p90_abs_error": float(absolute.quantile(0.9)) if len(errors) else None,
        "max_abs_error": float(absolute.max()) if len(errors) else None,
        "median_error": float(errors.median()) if len(errors) else None,
        "fit_accuracy": float((group["fits_predicted"] == group["fits_measured"]).mean()) if len(group) else None,
    }


def summarise(table) -> dict:
    summary = {"overall": _stats(table), "by_model_type_precision": {}, "by_setting": {}, "phases": {},
               "worst": []}
    for (model_type, precision), group in table.groupby(["model_type", "precision"]):
        summary["by_model_type_precision"][f"{model_type} / {precision}"] = _stats(group)
    setting = table["variant"] + "/" + table["optimizer"] + "/ckpt=" + table["gradient_checkpointing"].astype(str) \
        + "/" + table["attn_implementation"].astype(str)
    for name, group in table.groupby(setting):
        summary["by_setting"][name] = _stats(group)
    for phase in PHASES:
        errors = table[f"{phase}_error"].dropna().abs()
        summary["phases"][phase] = {"median_abs_error": float(errors.median()) if len(errors) else None,
                                    "p90_abs_error": float(errors.quantile(0.9)) if len(errors) else None}
    worst = table.dropna(subset=["error"]).assign(abs_error=lambda t: t["error"].abs())
    worst = worst.sort_values("abs_error", ascending=False).head(25)
    summary["worst"] = [
        {**{k: (v.item() if hasattr(v, "item") else v) for k, v in row[KEYS].items()},
         "measured": int(row["peak_allocated_bytes"]), "predicted": int(row["simulated_peak_bytes"]),
         "error": float(row["error"]), "measured_phase": _peak_phase(row),
         "predicted_phase": row["simulated_peak_phase"]}
        for _, row in worst.iterrows()]
    return summary


def _peak_phase(row) -> str:
    values = {phase: row[f"{phase}_peak_bytes"] for phase in PHASES}
    return max(values, key=lambda p: -1 if values[p] is None or values[p] != values[p] else values[p])


def _percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def render(summary: dict, table) -> str:
    lines = ["# Simulator accuracy against measured H200 peaks", "",
             "Relative error = (predicted - measured) / measured of `peak_allocated_bytes` (ok rows); "
             "fit accuracy = predicted fits (peak <= GPU total) agrees with measured ok/oom (ok and oom rows).", "",
             "| group | rows | ok rows | median abs | p90 abs | max abs | median signed | fit accuracy |",
             "|---|---|---|---|---|---|---|---|"]

    def line(name, s):
        lines.append(f"| {name} | {s['rows']} | {s['ok_rows']} | {_percent(s['median_abs_error'])} | "
                     f"{_percent(s['p90_abs_error'])} | {_percent(s['max_abs_error'])} | "
                     f"{_percent(s['median_error'])} | {_percent(s['fit_accuracy'])} |")

    line("**all**", summary["overall"])
    for name, stats in summary["by_model_type_precision"].items():
        line(name, stats)
    lines += ["", "| setting | rows | ok rows | median abs | p90 abs | max abs | median signed | fit accuracy |",
              "|---|---|---|---|---|---|---|---|"]
    for name, stats in summary["by_setting"].items():
        line(name, stats)
    lines += ["", "| phase | median abs | p90 abs |", "|---|---|---|"]
    for phase, stats in summary["phases"].items():
        lines.append(f"| {phase} | {_percent(stats['median_abs_error'])} | {_percent(stats['p90_abs_error'])} |")
    lines += ["", "Worst rows:", "", "| model | precision | setting | B | L | measured GiB | predicted GiB | error | "
              "phase (measured / predicted) |", "|---|---|---|---|---|---|---|---|---|"]
    for w in summary["worst"]:
        lines.append(f"| {w['model_id']} | {w['precision']} | {w['variant']}/{w['optimizer']}/"
                     f"ckpt={w['gradient_checkpointing']}/{w['attn_implementation']} | {w['batch_size']} | "
                     f"{w['seq_len']} | {w['measured'] / 2**30:.3f} | {w['predicted'] / 2**30:.3f} | "
                     f"{_percent(w['error'])} | {w['measured_phase']} / {w['predicted_phase']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
