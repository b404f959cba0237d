"""The sweep's files: one JSONL part per job (a row per point, flushed and fsynced), its `.current`
and `.done` markers, the events log, what is still pending (the resume rules), and the merged table.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pipeline.core.io import cell, write_text
from pipeline.core.paths import PEAKS
from pipeline.training.step import Setting
from pipeline.measure.sweep.jobs import Job, Point
from pipeline.training.points import COLUMN_DTYPES, COLUMNS, POINT_KEY, table_rows, with_client_columns

EVENTS_FILE = "_events.jsonl"


def part_path(parts_dir, job: Job) -> Path:
    return Path(parts_dir) / f"{job.name}.jsonl"


def append_row(path, row: dict) -> None:
    """Append one JSON line, flushed and fsynced; first ends a line torn by a killed writer."""
    path = Path(path)
    with open(path, "ab") as handle:
        if handle.tell() > 0:
            with open(path, "rb") as reader:
                reader.seek(-1, os.SEEK_END)
                if reader.read(1) != b"\n":
                    handle.write(b"\n")
        handle.write((json.dumps(row, default=str) + "\n").encode())
        handle.flush()
        os.fsync(handle.fileno())


def read_rows(path) -> list[dict]:
    """The rows of a part file; a torn last line (killed writer) is ignored."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def event(parts_dir, name: str, **fields) -> None:
    append_row(Path(parts_dir) / EVENTS_FILE, {"event": name, "time": time.time(), **fields})


def write_current(part, text: str) -> None:
    """What the child is doing now (`setup`, building, a point as JSON): the parent's view of it."""
    Path(str(part) + ".current").write_text(text)


def current_point(part) -> str:
    try:
        return Path(str(part) + ".current").read_text()
    except FileNotFoundError:
        return ""


def mark_done(part) -> None:
    Path(str(part) + ".done").touch()


def last_progress(part, started: float) -> float:
    times = [started]
    for path in (Path(part), Path(str(part) + ".current")):
        try:
            times.append(path.stat().st_mtime)
        except FileNotFoundError:
            pass
    return max(times)


# --- resume rules ----------------------------------------------------------------------------------

def row_key(row: dict) -> tuple:
    """The row's point key, missing values (None, NaN, pandas' NA) alike as None."""
    row = with_client_columns(row)
    return tuple(cell(row, column) for column in POINT_KEY)


def pending_points(job: Job, rows: list[dict], retry_errors: bool = False) -> list[Point]:
    """The job's points without a row yet. A measured row (ok, oom; error unless retrying) settles
    a point; a skipped row settles only a point that the plan still skips."""
    measured = {row_key(r) for r in rows if r.get("status") in ("ok", "oom")
                or (r.get("status") == "error" and not retry_errors)}
    seen = {row_key(r) for r in rows}
    return [p for p in job.points if job.key(p) not in measured and not (p.skip_reason and job.key(p) in seen)]


def seed_parts(jobs: list[Job], parts_dir, tables) -> int:
    """The rows of earlier peak tables (`tables`) written into the part files of the jobs whose points they hold,
    where a job has no part file yet: a sweep resumes from a committed table on a machine that kept no parts
    (a device machine is given back when idle). Returns the rows seeded."""
    by_key = {row_key(row): row for table in tables for row in table_rows(table)}
    seeded = 0
    for job in jobs:
        path = part_path(parts_dir, job)
        rows = [by_key[job.key(p)] for p in job.points if job.key(p) in by_key]
        if rows and not path.exists():  # written whole or not at all: a half-seeded part would never be completed
            write_text("".join(json.dumps(row, default=str) + "\n" for row in rows), path)
            seeded += len(rows)
    return seeded


def oom_points(rows: list[dict]) -> dict:
    """(B, L) of out-of-memory rows, by setting."""
    ooms: dict[Setting, list] = {}
    for row in rows:
        if row.get("status") == "oom":
            ooms.setdefault(Setting.from_row(row), []).append((row["batch_size"], row["seq_len"]))
    return ooms


def prune_reason(ooms: list, batch: int, seq: int) -> str | None:
    """A point needs at least the memory of any smaller point: after an oom at (B', L'), every
    (B >= B', L >= L') is recorded oom without running."""
    smaller = sorted((b, s) for b, s in ooms if b <= batch and s <= seq)
    return f"pruned after oom at B={smaller[0][0]}, L={smaller[0][1]}" if smaller else None


# --- the merged table ------------------------------------------------------------------------------

def aggregate(parts_dir, out=PEAKS, include=()):
    """Merge the parts (and the rows of the peak tables `include`) into one table: one row per key
    (a measured row wins over a skipped one, then the latest), typed columns, atomic write. Rows
    from before the client columns get the loop's (`with_client_columns`), so a table merged again
    only gains those columns. Returns the frame (None when there are no rows)."""
    import pandas as pd

    from pipeline.core.io import write_parquet

    rows = [row for path in sorted(Path(parts_dir).glob("*__*.jsonl")) for row in read_rows(path)]
    rows += [row for table in include for row in table_rows(table)]
    if not rows:
        return None
    frame = pd.DataFrame([{c: row.get(c) for c in COLUMNS} for row in map(with_client_columns, rows)],
                         columns=list(COLUMNS))
    frame["_measured"] = frame["status"] != "skipped"
    frame = frame.sort_values(["_measured", "finished_at"], kind="stable")
    frame = frame.drop_duplicates(list(POINT_KEY), keep="last").drop(columns="_measured")
    frame = frame.astype(COLUMN_DTYPES)
    frame = frame.sort_values(["parameters", "model_id", "precision", "variant", "optimizer",
                               "gradient_checkpointing", "attn_implementation", "client", "optim",
                               "gradient_accumulation", "seq_len", "batch_size"],
                              kind="stable").reset_index(drop=True)
    write_parquet(frame, out)
    return frame
