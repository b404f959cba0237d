"""The rows of the first (provisional) Trainer sweeps that the autocast bug did not touch, as tables
of their own (not a hand edit: this script selects, it changes no value).

Before the fix (commit 0ad38a3; the same fix on the helper branch: 57dc319) every Trainer after the
first on a model skipped accelerate's autocast wrapper: its amp points computed in fp32. Untouched:

- every row of a bf16 or fp32 process (no autocast is involved; each (model, precision, client)
  ran in a process of its own);
- the first Trainer that ran in an amp process (`allocated_before_bytes` is set on rows that ran).

The H100's first sweep adds the untouched rows whose points the clean re-measurement
(results/trainer/h100) does not have (fp32 among them).

    python benchmarks/trainer_valid_rows.py     # -> results/trainer/{h200,h100_first_sweep}, results/trainer_heldout/h200
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# source -> (target, a table whose points are left out of the target)
SOURCES = {"results/trainer/provisional/h200/peak_memory.parquet": ("results/trainer/h200/peak_memory.parquet", None),
           "results/trainer/provisional/heldout/h200/peak_memory.parquet":
               ("results/trainer_heldout/h200/peak_memory.parquet", None),
           "results/trainer/provisional/h100/peak_memory.parquet":
               ("results/trainer/h100_first_sweep/peak_memory.parquet", "results/trainer/h100/peak_memory.parquet")}
KEY = ["model_id", "precision", "client", "optim", "gradient_accumulation", "gradient_checkpointing", "batch_size",
       "seq_len"]


def untouched_rows(frame):
    """The rows the bug did not touch (see the module docstring)."""
    frame = frame[frame["client"] == "trainer"].sort_values("started_at", kind="stable")
    ran = frame["allocated_before_bytes"].notna()
    earlier = ran.astype(int).groupby(frame["child_pid"]).cumsum() - ran.astype(int)
    amp = frame["precision"].str.startswith("amp")
    return frame[~amp | (ran & (earlier == 0))]


def main() -> None:
    import pandas as pd

    from pipeline.core.io import write_parquet

    for source, (target, measured_again) in SOURCES.items():
        frame = pd.read_parquet(ROOT / source)
        kept = untouched_rows(frame)
        if measured_again:
            again = pd.read_parquet(ROOT / measured_again)[KEY].assign(_again=True)
            kept = kept.merge(again, on=KEY, how="left")
            kept = kept[kept["_again"].isna()].drop(columns="_again")
        write_parquet(kept.reset_index(drop=True), ROOT / target)
        print(f"{source}: {len(kept)} of {len(frame)} rows -> {target} {kept['status'].value_counts().to_dict()}")


if __name__ == "__main__":
    main()
