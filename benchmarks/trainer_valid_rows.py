"""The rows of the first (provisional) Trainer sweeps that the autocast bug did not touch, as tables
of their own (not a hand edit: this script selects, it changes no value).

Before the fix (commit 0ad38a3; the same fix on the helper branch: 57dc319) every Trainer after the
first on a model skipped accelerate's autocast wrapper: its amp points computed in fp32. Untouched:

- every row of a bf16 or fp32 process (no autocast is involved; each (model, precision, client)
  ran in a process of its own);
- the first Trainer that ran in an amp process (`allocated_before_bytes` is set on rows that ran).

    python benchmarks/trainer_valid_rows.py     # -> results/trainer/h200, results/trainer_heldout/h200
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = {"results/trainer/provisional/h200/peak_memory.parquet": "results/trainer/h200/peak_memory.parquet",
           "results/trainer/provisional/heldout/h200/peak_memory.parquet":
               "results/trainer_heldout/h200/peak_memory.parquet"}


def untouched_rows(frame):
    """The rows the bug did not touch (see the module docstring)."""
    frame = frame[frame["client"] == "trainer"].sort_values("started_at", kind="stable")
    ran = frame["allocated_before_bytes"].notna()
    earlier = ran.astype(int).groupby(frame["child_pid"]).cumsum() - ran.astype(int)
    amp = frame["precision"].str.startswith("amp")
    return frame[~amp | (ran & (earlier == 0))]


def main() -> None:
    import pandas as pd

    from pipeline.io import write_parquet

    for source, target in SOURCES.items():
        frame = pd.read_parquet(ROOT / source)
        kept = untouched_rows(frame)
        write_parquet(kept.reset_index(drop=True), ROOT / target)
        print(f"{source}: {len(kept)} of {len(frame)} rows -> {target} {kept['status'].value_counts().to_dict()}")


if __name__ == "__main__":
    main()
