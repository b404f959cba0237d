"""Atomic writes: an output is either whole or absent, never half-written; the one reader of a JSON
object file and the one reader of a parquet table, each naming what is wrong with its file."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from pipeline.core.errors import UserError


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_parquet(frame, path) -> None:
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)


def write_json(data, path) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def write_text(text: str, path) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def read_json_object(path, missing: str, unreadable: str, not_object: str) -> dict:
    """A JSON object read from `path`; a UserError naming the path and what is wrong otherwise."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: {missing}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(f"{path}: {unreadable}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: {not_object}")
    return data


def read_table(path, label: str):
    """A parquet table; one-line UserError when it is missing or unreadable."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: {label} table not found")
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # noqa: BLE001 - any parquet failure is a bad input file
        raise UserError(f"{path}: {label} table is not readable parquet ({type(exc).__name__})") from None


def require_columns(frame, columns, label: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise UserError(f"{label}: column {missing[0]!r} missing")


def cell(row, name: str):
    """A row's value of column `name` (a dict or a named tuple), missing ones (absent, None, NaN,
    pandas' NA) as None."""
    value = row.get(name) if isinstance(row, dict) else getattr(row, name, None)
    if value is None or type(value).__name__ == "NAType" or (isinstance(value, float) and value != value):
        return None
    return value
