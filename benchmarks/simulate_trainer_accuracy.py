"""Accuracy of `pipeline.simulate.trainer.predict_trainer_peak` against the measured Trainer peaks
(results/trainer/{h100,h200}; the held-out tables results/trainer_heldout/{h100,h200} apart).

    python benchmarks/simulate_trainer_accuracy.py [--cases default bf16 ...] [--workers 2]

Writes benchmarks/results/simulate_trainer_accuracy.md (and the per-row predictions next to it,
simulate_trainer_predictions.csv, reused as a cache by later runs).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLES = {"trainer/h100": "tuned", "trainer/h200": "tuned", "trainer_heldout/h100": "held-out",
          "trainer_heldout/h200": "held-out"}
GPU_TOTAL = {"h100": 81559 << 20, "h200": 143771 << 20}  # nvidia-smi totals (docs/definitions.md)
OUTSIDE = 768 << 20  # memory outside PyTorch (CUDA context etc., docs/definitions.md), the driver's reserve apart
DRIVER_RESERVE = 615 << 20
CASES = {  # name -> (precision, optim, gradient_accumulation, gradient_checkpointing)
    "default": ("amp-bf16", "adamw_torch_fused", 1, False),
    "bf16": ("bf16", "adamw_torch_fused", 1, False),
    "fp32": ("fp32", "adamw_torch_fused", 1, False),
    "K=4": ("amp-bf16", "adamw_torch_fused", 4, False),
    "checkpointing": ("amp-bf16", "adamw_torch_fused", 1, True),
    "bf16 checkpointing": ("bf16", "adamw_torch_fused", 1, True),
    "adamw_torch": ("amp-bf16", "adamw_torch", 1, False),
    "sgd": ("amp-bf16", "sgd", 1, False),
    "adafactor": ("amp-bf16", "adafactor", 1, False),
}
KEY = ("model_id", "batch_size", "seq_len", "precision", "optim", "gradient_accumulation", "gradient_checkpointing",
       "attn_implementation")
CACHE = ROOT / "benchmarks/results/simulate_trainer_predictions.csv"
OUT = ROOT / "benchmarks/results/simulate_trainer_accuracy.md"


def case_of(row) -> str | None:
    setting = (row["precision"], row["optim"], int(row["gradient_accumulation"]), bool(row["gradient_checkpointing"]))
    return next((name for name, value in CASES.items() if value == setting), None)


def measured_rows(cases):
    import pandas as pd

    frames = []
    for table, kind in TABLES.items():
        frame = pd.read_parquet(ROOT / "results" / table / "peak_memory.parquet")
        frame = frame[(frame["client"] == "trainer") & frame["status"].isin(["ok", "oom"])].copy()
        frame["table"], frame["kind"], frame["gpu"] = table, kind, table.split("/")[1]
        frame["case"] = frame.apply(case_of, axis=1)
        frames.append(frame[frame["case"].isin(cases)])
    return pd.concat(frames, ignore_index=True)


def predict_point(point: dict) -> dict:
    from pipeline.configs import read_config_records
    from pipeline.simulate.trainer import predict_trainer_peak

    record = read_config_records(ROOT / "results/configs.json")[point["model_id"]]
    try:
        result = predict_trainer_peak(record["config"], int(point["batch_size"]), int(point["seq_len"]),
                                      point["precision"], point["optim"], int(point["gradient_accumulation"]),
                                      bool(point["gradient_checkpointing"]), point["attn_implementation"])
    except Exception as exc:  # noqa: BLE001 - one failing point is reported, not fatal
        return dict(point, predicted_bytes=None, predicted_reserved_bytes=None, error=f"{type(exc).__name__}: {exc}"[:200])
    return dict(point, predicted_bytes=result["peak_bytes"], predicted_reserved_bytes=result["peak_reserved_bytes"],
                seconds=result["seconds"], error=None)


def predictions(rows, workers: int):
    import pandas as pd

    points = rows[list(KEY)].drop_duplicates()
    cached = pd.read_csv(CACHE) if CACHE.exists() else pd.DataFrame(columns=list(KEY) + ["predicted_bytes"])
    cached = cached[cached["predicted_bytes"].notna()] if len(cached) else cached
    done = {tuple(str(r[k]) for k in KEY) for r in cached.to_dict("records")}
    todo = [p for p in points.to_dict("records") if tuple(str(p[k]) for k in KEY) not in done]
    todo.sort(key=lambda p: (p["model_id"], p["batch_size"] * p["seq_len"]))
    new = []
    with multiprocessing.get_context("fork").Pool(workers, maxtasksperchild=4) as pool:
        for result in pool.imap_unordered(predict_point, todo):
            new.append(result)
            print(json.dumps({k: result.get(k) for k in ("model_id", "batch_size", "seq_len", "precision", "optim",
                                                        "predicted_bytes", "error")}), flush=True)
            pd.concat([cached, pd.DataFrame(new)], ignore_index=True).to_csv(CACHE, index=False)
    return pd.concat([cached, pd.DataFrame(new)], ignore_index=True)


def stats(errors) -> str:
    errors = errors.dropna().abs() * 100
    if not len(errors):
        return "-"
    return f"{errors.median():.2f}% / {errors.quantile(0.9):.2f}% / {errors.max():.2f}%"


def report(rows, predicted) -> str:
    import pandas as pd

    for frame in (rows, predicted):
        frame["gradient_checkpointing"] = frame["gradient_checkpointing"].astype(bool)
        for k in ("batch_size", "seq_len", "gradient_accumulation"):
            frame[k] = frame[k].astype(int)
    merged = rows.merge(predicted[list(KEY) + ["predicted_bytes", "predicted_reserved_bytes", "error"]],
                        on=list(KEY), how="left")
    for column in ("peak_allocated_bytes", "peak_reserved_bytes", "predicted_bytes", "predicted_reserved_bytes"):
        merged[column] = pd.to_numeric(merged[column], errors="coerce").astype(float)
    measured = merged["peak_allocated_bytes"].where(merged["peak_allocated_bytes"] > 0)
    measured_reserved = merged["peak_reserved_bytes"].where(merged["peak_reserved_bytes"] > 0)
    merged["alloc_err"] = merged["predicted_bytes"] / measured - 1
    merged["reserved_err"] = merged["predicted_reserved_bytes"] / measured_reserved - 1
    total = merged["gpu"].map(GPU_TOTAL)
    merged["fits"] = merged["predicted_reserved_bytes"] + OUTSIDE + DRIVER_RESERVE <= total
    lines = ["# Simulator for client = trainer: accuracy (benchmarks/simulate_trainer_accuracy.py)", "",
             "|error| of the predicted peak (pipeline.simulate.trainer.predict_trainer_peak) against the measured",
             "`torch.cuda.max_memory_allocated()` / `max_memory_reserved()`, ok rows; the fit verdict on oom rows",
             "(predicted reserved + 768 MiB outside PyTorch + 615 MiB driver reserve > the GPU's total).", "",
             "| tables | case | ok rows | allocated median / p90 / worst | reserved median / p90 / worst |"
             " oom rows | oom predicted not to fit | failed |",
             "|---|---|---:|---|---|---:|---:|---:|"]
    for kind in ("tuned", "held-out"):
        for case in CASES:
            part = merged[(merged["kind"] == kind) & (merged["case"] == case)]
            if not len(part):
                continue
            ok, oom = part[part["status"] == "ok"], part[part["status"] == "oom"]
            flagged = int((~oom["fits"] & oom["predicted_bytes"].notna()).sum())
            failed = int(part["predicted_bytes"].isna().sum())
            lines.append(f"| {kind} | {case} | {len(ok)} | {stats(ok['alloc_err'])} | {stats(ok['reserved_err'])} |"
                         f" {len(oom)} | {flagged} | {failed} |")
    ok = merged[merged["status"] == "ok"].sort_values("alloc_err", key=abs, ascending=False)
    lines += ["", "Largest allocated errors (ok rows):", "",
              "| table | model | B | L | case | measured GiB | predicted GiB | error | reserved error |",
              "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in ok.head(15).to_dict("records"):
        lines.append(f"| {r['table']} | {r['model_id']} | {r['batch_size']} | {r['seq_len']} | {r['case']} |"
                     f" {r['peak_allocated_bytes'] / 2**30:.2f} | {(r['predicted_bytes'] or 0) / 2**30:.2f} |"
                     f" {r['alloc_err'] * 100:+.2f}% | {r['reserved_err'] * 100:+.2f}% |")
    failures = merged[merged["error"].notna()].drop_duplicates("model_id")
    if len(failures):
        lines += ["", "Failures:", ""] + [f"- {r['model_id']}: {r['error']}" for r in failures.to_dict("records")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report-only", action="store_true", help="use the cached predictions only")
    args = parser.parse_args()
    rows = measured_rows(args.cases)
    import pandas as pd

    predicted = pd.read_csv(CACHE) if args.report_only else predictions(rows, args.workers)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(report(rows, predicted))
    print(OUT.read_text())


if __name__ == "__main__":
    main()
