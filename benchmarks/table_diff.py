"""Compare the tables of two results folders, provenance and timing columns aside.

    python benchmarks/table_diff.py OLD_RESULTS NEW_RESULTS

Prints, per table, the rows only in one side and the rows whose values differ (by the table's
key), with the columns that differ; JSON files are compared without their provenance keys.
Used to show that a refactor leaves the tables as they were (or what a deliberate change did).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from pipeline.training.points import STANDARD_KEY

IGNORED = {"torch_version", "transformers_version", "cuda_version", "python_version", "git_commit", "device",
           "driver_version", "date", "versions", "datasets_version", "pipeline_version", "platform"}
KEYS = {
    "models.parquet": ["model_id"],
    "activations.parquet": ["model_id", "method", "dtype", "batch_size", "seq_len"],
    "peak_memory.parquet": list(STANDARD_KEY),
    "simulated.parquet": list(STANDARD_KEY),
    "validation.parquet": [*STANDARD_KEY, "estimator"],
}


def ignored(column: str) -> bool:
    return column in IGNORED or "seconds" in column or column.endswith("_at") or column == "child_pid"


def compare_frames(old: pd.DataFrame, new: pd.DataFrame, key: list[str]) -> list[str]:
    lines = []
    if set(old.columns) != set(new.columns):
        lines.append(f"  columns: only old {sorted(set(old.columns) - set(new.columns))}, "
                     f"only new {sorted(set(new.columns) - set(old.columns))}")
    columns = [c for c in old.columns if c in new.columns and not ignored(c) and c not in key]
    merged = old.merge(new, on=key, how="outer", suffixes=("_old", "_new"), indicator=True)
    for side, label in (("left_only", "only old"), ("right_only", "only new")):
        rows = merged[merged["_merge"] == side]
        if len(rows):
            lines.append(f"  {len(rows)} rows {label}, e.g. {rows[key].head(3).to_dict('records')}")
    both = merged[merged["_merge"] == "both"]
    changed = {}
    for column in columns:
        a, b = both[f"{column}_old"], both[f"{column}_new"]
        differs = ~((a == b) | (a.isna() & b.isna()))
        for index in both.index[differs]:
            changed.setdefault(index, []).append(column)
    if changed:
        lines.append(f"  {len(changed)} rows differ")
        by_columns = {}
        for index, cols in changed.items():
            by_columns.setdefault(tuple(cols), []).append(index)
        for cols, indices in sorted(by_columns.items(), key=lambda kv: -len(kv[1]))[:10]:
            example = both.loc[indices[0]]
            detail = ", ".join(f"{c}: {example[f'{c}_old']!r} -> {example[f'{c}_new']!r}" for c in cols[:4])
            lines.append(f"    {len(indices)} rows in {list(cols)}; e.g. {dict(example[key])}: {detail}")
    return lines


def strip(data):
    if isinstance(data, dict):
        return {k: strip(v) for k, v in data.items() if not ignored(k)}
    if isinstance(data, list):
        return [strip(v) for v in data]
    return data


def main(old_dir: str, new_dir: str) -> int:
    old_dir, new_dir = Path(old_dir), Path(new_dir)
    differences = 0
    for path in sorted(old_dir.glob("*.parquet")) + sorted(old_dir.glob("*.json")):
        other = new_dir / path.name
        if not other.exists():
            print(f"{path.name}: missing in {new_dir}")
            differences += 1
            continue
        if path.suffix == ".json":
            same = strip(json.loads(path.read_text())) == strip(json.loads(other.read_text()))
            lines = [] if same else ["  differs (provenance aside)"]
        else:
            old, new = pd.read_parquet(path), pd.read_parquet(other)
            key = [k for k in KEYS.get(path.name, []) if k in old.columns]
            lines = compare_frames(old, new, key) if key else (
                [] if old.drop(columns=[c for c in old if ignored(c)]).equals(
                    new.drop(columns=[c for c in new if ignored(c)])) else ["  differs"])
        print(f"{path.name}: {'same' if not lines else 'DIFFERS'}")
        print("\n".join(lines)) if lines else None
        differences += bool(lines)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
