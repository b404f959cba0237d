"""Failures: models that were not counted and error rows, for the card, the CLI and the workflow's end."""

from __future__ import annotations

from pipeline.publish.dataset.subsets import load_tables
from pipeline.core.errors import UserError


def failures(tables: dict):
    """Models that were not counted (status not ok) and rows with status error in any subset:
    subset, model_id, status, reason."""
    import pandas as pd

    parts = []
    for subset, frame in tables.items():
        if "status" not in frame.columns or "model_id" not in frame.columns:
            continue
        bad = frame[frame["status"] != "ok"] if subset == "models" else frame[frame["status"] == "error"]
        if len(bad):
            part = bad[["model_id", "status"]].assign(subset=subset, reason=bad["reason"] if "reason" in bad else None)
            parts.append(part.drop_duplicates(["model_id", "status"]))  # one line per model: its first reason
    columns = ["subset", "model_id", "status", "reason"]
    if not parts:
        return pd.DataFrame(columns=columns)
    return pd.concat(parts, ignore_index=True)[columns]


def failure_report(results_dir="results") -> list[str]:
    """One line per failing (subset, model), for the end of a workflow run; [] when none."""
    try:
        frame = failures(load_tables(results_dir))
    except (UserError, OSError, ValueError):
        return []
    return [failure_line(row) for row in frame.itertuples()]


def failure_line(row, width: int = 240) -> str:
    line = f"{row.subset}: {row.model_id}: {row.status}: {row.reason}"
    return line if len(line) <= width else line[: width - 3] + "..."
