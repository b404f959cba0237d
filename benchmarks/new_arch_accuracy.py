"""Accuracy of the exact simulator and the closed-form formula on the 2025-26 architectures' H100 tables.

    python benchmarks/new_arch_accuracy.py report \
        --table results/new_arch/h100/peak_memory.parquet=tuned \
        --table results/new_arch_heldout/h100/peak_memory.parquet=held-out \
        --table results/norms_heldout/h100/peak_memory.parquet=held-out-2 \
        --simulated results/settings_simulated.parquet --out results/new_arch/accuracy
    python benchmarks/new_arch_accuracy.py simulate --table results/new_arch/h100/peak_memory.parquet=tuned \
        --subset boundary --out build/new_arch_simulated.parquet

`simulate` runs the simulator (`pipeline.validate.settings.simulate_settings`, as `python -m pipeline
simulate-settings` does: the loop and the Trainer clients alike) on the table's `ok` and `oom` rows, or with
`--subset boundary` on the rows nearest each group's out-of-memory edge (per model, client, precision and
checkpointing: the ok row of the largest measured peak, the ok row of the most tokens and the oom row of the
fewest tokens), or with `--subset ok+boundary` on every ok row and those oom rows; the table says which rule
chose its rows (`subset`).

`report` answers every ok and oom row with the formula (`validate_settings`: the committed
coefficients.json) and, where the simulated tables hold the point, the exact simulator; writes the per-row
table (`OUT.parquet`) and the errors per split, client, precision and estimator (`OUT.md`, `OUT.json`):
median, 90th percentile and worst |predicted / measured - 1| of the peak allocated bytes over ok rows, and
the fit verdict's accuracy over ok and oom rows (allocated: predicted peak <= the GPU's CUDA total;
reserved: predicted reserved + the memory outside PyTorch <= it, as validate-settings counts it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

GROUP = ["model_id", "client", "precision", "gradient_checkpointing"]
SUBSETS = ("all", "boundary", "ok+boundary")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    simulate = commands.add_parser("simulate", help="the simulator on a table's rows (or its boundary subset)")
    simulate.add_argument("--table", required=True, help="PATH=SPLIT")
    simulate.add_argument("--configs", default="results/configs.json")
    simulate.add_argument("--subset", choices=SUBSETS, default="all")
    simulate.add_argument("--out", required=True)
    report = commands.add_parser("report", help="formula and simulator errors per split, client and precision")
    report.add_argument("--table", action="append", required=True, help="PATH=SPLIT (repeat)")
    report.add_argument("--simulated", nargs="*", default=[])
    report.add_argument("--coefficients", default="results/coefficients.json")
    report.add_argument("--configs", default="results/configs.json")
    report.add_argument("--out", required=True, help="OUT.parquet, OUT.md, OUT.json")
    args = parser.parse_args(argv)
    return run_simulate(args) if args.command == "simulate" else run_report(args)


def tables_of(specs) -> dict:
    return dict((spec.split("=", 1) + ["tuned"])[:2] for spec in specs)


def boundary_rows(rows):
    """Per group: the ok row of the largest measured peak, the ok row of the most tokens (largest), the oom
    row of the fewest tokens; groups of the Trainer (one or two points) whole."""
    import pandas as pd

    rows = rows.assign(tokens=rows["batch_size"] * rows["seq_len"])
    chosen = []
    for _, group in rows.groupby(GROUP, sort=False):
        ok, oom = group[group["status"] == "ok"], group[group["status"] == "oom"]
        if len(ok):
            chosen.append(ok.sort_values("peak_allocated_bytes").tail(1))
            chosen.append(ok.sort_values(["tokens", "peak_allocated_bytes"]).tail(1))
        if len(oom):
            chosen.append(oom.sort_values(["tokens", "batch_size"]).head(1))
    picked = pd.concat(chosen)
    return picked[~picked.index.duplicated()].drop(columns="tokens")


def run_simulate(args) -> int:
    from pipeline.core.io import write_parquet
    from pipeline.validate.settings import settings_rows, simulate_settings

    rows = settings_rows(tables_of([args.table]))
    if args.subset != "all":
        boundary = boundary_rows(rows)
        rows = rows[rows.index.isin(boundary.index) | (rows["status"] == "ok")] if args.subset == "ok+boundary" \
            else boundary
    print(f"simulating {len(rows)} rows ({args.subset}) of {args.table}", flush=True)
    table = simulate_settings(rows, args.configs).assign(subset=args.subset)
    write_parquet(table, args.out)
    print(f"{len(table)} points, {int((table['simulate_status'] != 'ok').sum())} failed -> {args.out}")
    return 0


def run_report(args) -> int:
    import pandas as pd

    from pipeline.core.io import read_table, write_json, write_parquet, write_text
    from pipeline.formulas.coefficients import load_coefficients
    from pipeline.validate.settings import settings_rows, validate_settings

    rows = settings_rows(tables_of(args.table))
    simulated = pd.concat([read_table(p, "simulated") for p in args.simulated], ignore_index=True) \
        if args.simulated else None
    table = validate_settings(rows, load_coefficients(args.coefficients), args.configs, simulated)
    table = table[table["estimator"].isin(["formula", "exact"])]
    if simulated is not None:  # the exact estimator only where its point was simulated
        table = table[(table["estimator"] != "exact") | (table["reason"].fillna("") != "point not in the simulated "
                                                                                      "settings table (run simulate-settings)")]
    summary = summarise(table)
    write_parquet(table.reset_index(drop=True), f"{args.out}.parquet")
    write_json(summary, f"{args.out}.json")
    report = render(summary)
    write_text(report, f"{args.out}.md")
    print(report)
    return 0


def stats(group) -> dict:
    ok = group[group["status"] == "ok"]
    errors = ok["relative_error"].abs().dropna()
    judged = group.dropna(subset=["fits_predicted"])
    judged_reserved = group.dropna(subset=["fits_predicted_reserved"])
    return {
        "rows": int(len(group)), "ok_rows": int(len(errors)), "failed": int(group["reason"].notna().sum()),
        "median": float(errors.median()) if len(errors) else None,
        "p90": float(errors.quantile(0.9)) if len(errors) else None,
        "worst": float(errors.max()) if len(errors) else None,
        "median_signed": float(ok["relative_error"].median()) if len(errors) else None,
        "fit_accuracy": float((judged["fits_predicted"] == judged["fits_measured"]).mean()) if len(judged) else None,
        "fit_points": int(len(judged)),
        "fit_accuracy_reserved": float((judged_reserved["fits_predicted_reserved"] == judged_reserved["fits_measured"])
                                       .mean()) if len(judged_reserved) else None,
    }


def summarise(table) -> dict:
    summary = {"by_split": {}, "by_precision": {}, "by_client_precision": {}, "worst": {}}
    for (split, estimator), group in table.groupby(["split", "estimator"], sort=False):
        summary["by_split"][f"{split} / {estimator}"] = stats(group)
    for (split, estimator, precision), group in table.groupby(["split", "estimator", "precision"], sort=False):
        summary["by_precision"][f"{split} / {estimator} / {precision}"] = stats(group)
    for keys, group in table.groupby(["split", "estimator", "client", "precision", "gradient_checkpointing"],
                                     sort=False):
        split, estimator, client, precision, checkpointing = keys
        name = f"{split} / {estimator} / {client} / {precision}" + (" / checkpointing" if checkpointing else "")
        summary["by_client_precision"][name] = stats(group)
    for (split, estimator), group in table.groupby(["split", "estimator"], sort=False):
        ok = group[group["status"] == "ok"].dropna(subset=["relative_error"])
        worst = ok.assign(a=ok["relative_error"].abs()).sort_values("a", ascending=False).head(8)
        summary["worst"][f"{split} / {estimator}"] = [
            {"model_id": r.model_id, "client": r.client, "precision": r.precision,
             "checkpointing": bool(r.gradient_checkpointing), "batch": int(r.batch_size), "seq": int(r.seq_len),
             "measured_gib": r.measured_peak_bytes / 2**30, "predicted_gib": r.predicted_peak_bytes / 2**30,
             "error": float(r.relative_error)} for r in worst.itertuples(index=False)]
        wrong = group.dropna(subset=["fits_predicted"])
        wrong = wrong[wrong["fits_predicted"] != wrong["fits_measured"]]
        summary["worst"][f"{split} / {estimator} / wrong verdicts"] = [
            {"model_id": r.model_id, "client": r.client, "precision": r.precision, "batch": int(r.batch_size),
             "seq": int(r.seq_len), "status": r.status, "predicted_gib": r.predicted_peak_bytes / 2**30}
            for r in wrong.itertuples(index=False)]
    return summary


def _pct(value) -> str:
    return "-" if value is None or value != value else f"{100 * value:.1f}%"


def render(summary: dict) -> str:
    head = ["| group | rows | ok | median | p90 | worst | median signed | verdict (allocated) | verdict (reserved) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def lines(section):
        return [f"| {name} | {s['rows']} | {s['ok_rows']} | {_pct(s['median'])} | {_pct(s['p90'])} | "
                f"{_pct(s['worst'])} | {_pct(s['median_signed'])} | {_pct(s['fit_accuracy'])} | "
                f"{_pct(s['fit_accuracy_reserved'])} |" for name, s in summary[section].items()]

    out = ["# Simulator (exact) and formula on the 2025-26 architectures' H100 tables", "",
           "|predicted / measured - 1| of peak allocated bytes over ok rows; verdicts over ok and oom rows.", ""]
    for section in ("by_split", "by_precision", "by_client_precision"):
        out += head + lines(section) + [""]
    for name, worst in summary["worst"].items():
        out.append(f"{name}: " + ("; ".join(
            f"{w['model_id']} {w['client']} {w['precision']} {w['batch']}x{w['seq']} "
            + (f"{100 * w['error']:+.1f}%" if "error" in w else f"{w['status']}, predicted {w['predicted_gib']:.1f} GiB")
            for w in worst) or "none"))
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
