"""The measured rows of benchmarks/packing/points.txt (JSON lines, as `measure.sh` leaves them) into the peak tables:
the lines in --tuned into results/packing/<gpu>/, the rest into results/packing_heldout/<gpu>/ (never tuned on).
Each row is matched to its line by model, batch, length, checkpointing and packing.

    python benchmarks/packing/collect.py --rows rows.jsonl --tuned "1 2 3 4 5" --gpu h200
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from pipeline.core.io import write_parquet, write_text
from pipeline.training.points import COLUMN_DTYPES

POINTS = Path(__file__).with_name("points.txt")


def line_key(line: str) -> tuple:
    words = line.split()  # as measure.sh splits it (no quotes)
    value = {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}
    packing = value.get("--packing")
    if packing is not None:
        from pipeline.training.packing import Packing

        packing = Packing.from_text(packing).to_text()
    return value["--model"], int(value["--batch"]), int(value["--seq"]), "--checkpointing" in words, packing


def row_key(row: dict) -> tuple:
    return row["model_id"], row["batch_size"], row["seq_len"], bool(row["gradient_checkpointing"]), row["packing"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", required=True)
    parser.add_argument("--tuned", default="", help="line numbers of points.txt tuned on")
    parser.add_argument("--gpu", default="h200")
    args = parser.parse_args()
    lines = [line for line in POINTS.read_text().splitlines() if line.strip()]
    number = {line_key(line): n for n, line in enumerate(lines, 1)}
    tuned = {int(n) for n in args.tuned.split()}
    rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines() if line.strip()]
    rows.sort(key=lambda row: number[row_key(row)])
    for name, chosen in (("packing", [r for r in rows if number[row_key(r)] in tuned]),
                         ("packing_heldout", [r for r in rows if number[row_key(r)] not in tuned])):
        out = Path("results") / name / args.gpu
        out.mkdir(parents=True, exist_ok=True)
        write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in chosen), out / "peak_memory.jsonl")
        frame = pd.DataFrame(chosen).reindex(columns=list(COLUMN_DTYPES)).astype(COLUMN_DTYPES)
        write_parquet(frame, out / "peak_memory.parquet")
        print(f"{out}: {len(chosen)} rows")


if __name__ == "__main__":
    main()
