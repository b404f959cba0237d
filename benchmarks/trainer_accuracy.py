"""Accuracy of the Trainer simulator (`pipeline.simulate.clients.trainer`) against the measured Trainer rows,
per GPU table, per setting group (optim / precision / checkpointing / K), and per process position.

    python benchmarks/trainer_accuracy.py [--tables trainer/h100 ...] [--workers 2] [--report-only]

Process position: the sweep built a job's model once and measured its points one after another in
one child process (`child_pid`, in `started_at` order). Before commit 57dc319 the GPU client left
accelerate's `_is_accelerate_prepared` mark on the model, so every Trainer after the first in a
process skipped accelerate's autocast wrapper: its amp points computed in fp32 (amp-fp16 kept the
GradScaler). `allocated_before_bytes` tells which earlier rows ran a Trainer (it is empty on rows
settled without running). Rows are reported as `first` (no Trainer ran before in the process) and
`later`; each is predicted as it ran (`later` with `prepared_before=True`, no autocast wrapper), and
`later` also as asked (`--as-asked`), to show what a clean remeasurement should give. Rows measured
by a client with the fix (their `git_commit` descends from FIXED_IN) are all predicted as asked;
`--all-clean` does the same for every row (e.g. after a rebase renamed the fix's commit).

Prints the table and writes it to benchmarks/results/trainer_accuracy.md; predictions are cached in
benchmarks/results/trainer_accuracy_predictions.csv (delete it after a simulator change).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLES = {"trainer/h100": "tuned", "trainer/h100_fresh_process": "tuned", "trainer/provisional/h200": "tuned",
          "trainer/provisional/h100": "tuned", "trainer_heldout/h100": "held-out",
          "trainer/provisional/heldout/h200": "held-out"}
KEY = ("model_id", "batch_size", "seq_len", "precision", "optim", "gradient_accumulation", "gradient_checkpointing",
       "attn_implementation", "prepared_before")
GROUP = ("optim", "precision", "gradient_checkpointing", "gradient_accumulation")
# the GPU client drops accelerate's _is_accelerate_prepared mark from these commits on (main, helper branch)
FIXED_IN = ("0ad38a3", "57dc319")
CACHE = ROOT / "benchmarks/results/trainer_accuracy_predictions.csv"
OUT = ROOT / "benchmarks/results/trainer_accuracy.md"


def measured_by_fixed_client(commit) -> bool:
    """Whether `commit` (a row's git_commit, maybe '-dirty') descends from FIXED_IN."""
    import subprocess

    if not isinstance(commit, str) or not commit:
        return False
    commit = commit.removesuffix("-dirty")
    return any(subprocess.run(["git", "merge-base", "--is-ancestor", fixed, commit], cwd=ROOT,
                              capture_output=True).returncode == 0 for fixed in FIXED_IN)


def table_rows(table: str, all_clean: bool = False):
    """The table's Trainer rows that ran (ok / oom), with `position` (first | later) in the process
    and `prepared_before` (a later row of a client without the fix)."""
    import pandas as pd

    frame = pd.read_parquet(ROOT / "results" / table / "peak_memory.parquet")
    frame = frame[frame["client"] == "trainer"].sort_values("started_at", kind="stable").copy()
    ran = frame["allocated_before_bytes"].notna().astype(int)
    earlier = ran.groupby(frame["child_pid"]).cumsum() - ran
    fixed = {c: all_clean or measured_by_fixed_client(c) for c in frame["git_commit"].dropna().unique()}
    frame["prepared_before"] = (earlier > 0) & ~frame["git_commit"].map(fixed).fillna(all_clean).astype(bool)
    frame["position"] = (earlier > 0).map({False: "first", True: "later"})
    frame["table"], frame["kind"] = table, TABLES[table]
    frame = frame[frame["status"].isin(["ok", "oom"])]
    for column in ("batch_size", "seq_len", "gradient_accumulation"):
        frame[column] = frame[column].astype(int)
    frame["gradient_checkpointing"] = frame["gradient_checkpointing"].astype(bool)
    return frame


def predict_point(point: dict) -> dict:
    import time

    from pipeline.inputs.configs import read_config_records
    from pipeline.simulate.predict import as_config, cached_meta_model, config_key, meta_attention
    from pipeline.simulate.clients.trainer import simulate_trainer, trainer_peak
    from pipeline.training.values import Run

    start = time.perf_counter()
    config = read_config_records(ROOT / "results/configs.json")[point["model_id"]]["config"]
    args = (int(point["batch_size"]), int(point["seq_len"]), point["precision"], point["optim"],
            int(point["gradient_accumulation"]), bool(point["gradient_checkpointing"]))
    try:
        if point["prepared_before"]:
            attention = meta_attention(point["attn_implementation"])
            model = cached_meta_model(config_key(as_config(config)), point["precision"], attention)
            result = simulate_trainer(model, *args, prepared_before=True)
        else:
            estimate = trainer_peak(config, Run(args[0], args[1], args[2], checkpointing=args[5],
                                                attn_implementation=meta_attention(point["attn_implementation"]),
                                                client="trainer", optim=args[3], gradient_accumulation=args[4]))
            result = {"peak_bytes": estimate.peak_bytes, "peak_reserved_bytes": estimate.reserved_bytes}
    except Exception as exc:  # noqa: BLE001 - one failing point is reported, not fatal
        return dict(point, predicted_bytes=None, predicted_reserved_bytes=None, error=f"{type(exc).__name__}: {exc}"[:200])
    return dict(point, predicted_bytes=result["peak_bytes"], predicted_reserved_bytes=result["peak_reserved_bytes"],
                seconds=time.perf_counter() - start, error=None)


def point_key(point: dict) -> tuple:
    return tuple(str(point[k]) for k in KEY)


def predictions(points, workers: int):
    import pandas as pd

    cached = pd.read_csv(CACHE) if CACHE.exists() else pd.DataFrame(columns=list(KEY) + ["predicted_bytes"])
    done = {point_key(r) for r in cached.to_dict("records") if pd.notna(r["predicted_bytes"])}
    todo = [p for p in points if point_key(p) not in done]
    todo.sort(key=lambda p: (p["model_id"], p["precision"], p["batch_size"] * p["seq_len"]))
    new = []
    with multiprocessing.get_context("fork").Pool(workers, maxtasksperchild=8) as pool:
        for result in pool.imap_unordered(predict_point, todo):
            new.append(result)
            print(json.dumps({k: result.get(k) for k in ("model_id", "batch_size", "seq_len", "precision", "optim",
                                                        "prepared_before", "predicted_bytes", "error")}), flush=True)
            pd.concat([cached, pd.DataFrame(new)], ignore_index=True).to_csv(CACHE, index=False)
    return pd.concat([cached, pd.DataFrame(new)], ignore_index=True)


def stats(errors) -> str:
    errors = errors.dropna().abs() * 100
    if not len(errors):
        return "-"
    return f"{errors.median():.2f} / {errors.quantile(0.9):.2f} / {errors.max():.2f}"


def merged_rows(rows, predicted, as_asked: bool):
    import pandas as pd

    predicted = predicted.copy()
    for column in ("batch_size", "seq_len", "gradient_accumulation"):
        predicted[column] = predicted[column].astype(int)
    for column in ("gradient_checkpointing", "prepared_before"):
        predicted[column] = predicted[column].astype(str).str.lower().eq("true")
    rows = rows.copy()
    rows["predicted_as"] = rows["prepared_before"] & ~as_asked
    keys = [k for k in KEY if k != "prepared_before"]
    merged = rows.merge(predicted[keys + ["prepared_before", "predicted_bytes", "predicted_reserved_bytes", "error"]]
                        .rename(columns={"prepared_before": "predicted_as"}), on=keys + ["predicted_as"], how="left")
    for column in ("peak_allocated_bytes", "peak_reserved_bytes", "predicted_bytes", "predicted_reserved_bytes"):
        merged[column] = pd.to_numeric(merged[column], errors="coerce").astype(float)
    merged["alloc_err"] = merged["predicted_bytes"] / merged["peak_allocated_bytes"] - 1
    merged["reserved_err"] = merged["predicted_reserved_bytes"] / merged["peak_reserved_bytes"] - 1
    return merged


def report(merged) -> str:
    lines = ["# Trainer simulator against the measured Trainer rows (benchmarks/trainer_accuracy.py)", "",
             "|error| in % of peak allocated and peak reserved, ok rows: median / p90 / worst. `first`: no",
             "Trainer ran before in the row's process; `later`: another did (rows of a client before "
             f"{FIXED_IN}:", "predicted as they ran, without accelerate's autocast wrapper).", "",
             "| table | position | optim | precision | ckpt | K | rows | allocated | reserved | failed |",
             "|---|---|---|---|---|---:|---:|---|---|---:|"]
    ok = merged[merged["status"] == "ok"]
    for (table, position, *group), part in ok.groupby(["table", "position", *GROUP], sort=True):
        optim, precision, checkpointing, accumulation = group
        lines.append(f"| {table} | {position} | {optim} | {precision} | {'yes' if checkpointing else 'no'} |"
                     f" {accumulation} | {len(part)} | {stats(part['alloc_err'])} | {stats(part['reserved_err'])} |"
                     f" {int(part['predicted_bytes'].isna().sum())} |")
    lines += ["", "| table | position | rows | allocated | reserved |", "|---|---|---:|---|---|"]
    for (table, position), part in ok.groupby(["table", "position"], sort=True):
        lines.append(f"| {table} | {position} | {len(part)} | {stats(part['alloc_err'])} |"
                     f" {stats(part['reserved_err'])} |")
    worst = ok.sort_values("alloc_err", key=abs, ascending=False).head(12)
    lines += ["", "Largest allocated errors:", "",
              "| table | position | model | B | L | optim | precision | ckpt | K | measured GiB | error | reserved error |",
              "|---|---|---|---:|---:|---|---|---|---:|---:|---:|---:|"]
    for r in worst.to_dict("records"):
        lines.append(f"| {r['table']} | {r['position']} | {r['model_id']} | {r['batch_size']} | {r['seq_len']} |"
                     f" {r['optim']} | {r['precision']} | {r['gradient_checkpointing']} | {r['gradient_accumulation']} |"
                     f" {r['peak_allocated_bytes'] / 2**30:.2f} | {r['alloc_err'] * 100:+.2f}% |"
                     f" {r['reserved_err'] * 100:+.2f}% |")
    failures = merged[merged["error"].notna()].drop_duplicates("model_id")
    if len(failures):
        lines += ["", "Failures:", ""] + [f"- {r['model_id']}: {r['error']}" for r in failures.to_dict("records")]
    return "\n".join(lines) + "\n"


def main() -> None:
    import pandas as pd

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", nargs="+", default=list(TABLES), choices=list(TABLES))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report-only", action="store_true", help="use the cached predictions only")
    parser.add_argument("--as-asked", action="store_true", help="predict `later` rows as asked (autocast on)")
    parser.add_argument("--first-only", action="store_true", help="only rows that were the first of their process")
    parser.add_argument("--all-clean", action="store_true", help="no row ran after a Trainer that left its mark")
    args = parser.parse_args()
    rows = pd.concat([table_rows(table, args.all_clean) for table in args.tables], ignore_index=True)
    if args.first_only:
        rows = rows[rows["position"] == "first"]
    rows = rows[rows["status"] == "ok"]
    wanted = rows.assign(prepared_before=rows["prepared_before"] & ~args.as_asked)[list(KEY)].drop_duplicates()
    predicted = pd.read_csv(CACHE) if args.report_only else predictions(wanted.to_dict("records"), args.workers)
    text = report(merged_rows(rows, predicted, args.as_asked))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
