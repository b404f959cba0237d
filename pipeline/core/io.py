"""Files in and out. Out: atomic writes (an output is either whole or absent, never half-written),
tables written together behind a completion marker, and the temporary files a killed writer left
removed at the next write. In: the one reader of a JSON object file, of a text input and of a
parquet table; each refuses what is not a regular file or is too large, and names what is wrong.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.core.text import short

# The largest input file read whole (config.json, TrainingArguments, registries, coefficient files).
MAX_INPUT_BYTES = 64 << 20
WRITING_SUFFIX = ".writing"  # the marker of tables being written together


def output_path(path) -> Path:
    """`path` as an output file: its folder made, and a one-line UserError if it is a folder."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a folder, not an output file")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = output_path(path)
    with temporary_beside(path) as tmp:
        yield tmp
        os.replace(tmp, path)


def remove_stale_temporaries(path: Path) -> None:
    """The temporary files of `path` that a killed writer left (its process is gone)."""
    for stale in path.parent.glob(f".tmp-{path.name}.*"):
        pid = stale.name[len(f".tmp-{path.name}."):].split(".")[0]
        if pid.isdigit() and not process_alive(int(pid)):
            stale.unlink(missing_ok=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def written_together(paths):
    """Yield temporary paths for several outputs that belong together; they are renamed onto their
    paths only when all were written, under a marker that `read_table` refuses while it exists (a
    writer killed between two renames leaves a pair that says so)."""
    paths = [output_path(p) for p in paths]
    with contextlib.ExitStack() as stack:
        temporaries = [stack.enter_context(temporary_beside(p)) for p in paths]
        yield temporaries
        markers = [p.with_name(p.name + WRITING_SUFFIX) for p in paths]
        for marker in markers:
            marker.touch()
        for tmp, path in zip(temporaries, paths):
            os.replace(tmp, path)
        for marker in markers:
            marker.unlink(missing_ok=True)


@contextlib.contextmanager
def temporary_beside(path: Path):
    """A temporary file beside `path` named with this process's id (so that a later writer can tell
    a dead writer's leftovers), removed on the way out unless renamed."""
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.{os.getpid()}.", dir=path.parent)
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
    try:
        yield Path(tmp)
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


def read_input_text(path, missing: str, unreadable: str) -> str:
    """The text of an input file: a regular file (not a folder, device or pipe) of at most
    MAX_INPUT_BYTES, in UTF-8; a UserError naming the path and what is wrong otherwise."""
    path = Path(path)
    label = short(str(path), 200, quote=False)
    try:
        if not path.exists():
            raise UserError(f"{label}: {missing}")
        if not path.is_file():
            raise UserError(f"{label}: not a regular file")
        with open(path, "rb") as handle:
            data = handle.read(MAX_INPUT_BYTES + 1)
    except UserError:
        raise
    except OSError as exc:
        raise UserError(f"{label}: {unreadable} ({type(exc).__name__})") from None
    if len(data) > MAX_INPUT_BYTES:
        raise UserError(f"{label}: larger than {MAX_INPUT_BYTES >> 20} MiB; {unreadable}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{label}: not UTF-8 text; {unreadable}") from None


MAX_DEPTH = 32  # levels of nested objects and lists in an input: far beyond any config, far below recursion limits


def parse_json(text: str, label: str, unreadable: str):
    """JSON text parsed; a UserError for bad or too deeply nested JSON."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError, MemoryError, ValueError):
        raise UserError(f"{short(label, 200, quote=False)}: {unreadable}") from None
    check_depth(data, label)
    return data


def parse_yaml(text: str, label: str, unreadable: str):
    """YAML (or JSON) text parsed; a UserError for bad or too deeply nested YAML."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError, ValueError):
        raise UserError(f"{short(label, 200, quote=False)}: {unreadable}") from None
    check_depth(data, label)
    return data


def check_depth(value, label: str, limit: int = MAX_DEPTH) -> None:
    """A UserError when `value` (parsed JSON or YAML: dicts and lists) nests deeper than `limit` levels; walked
    without recursion, so that no depth reaches Python's recursion limit here or later, and each container once
    per depth it is reached at (YAML's aliases share containers: walking every path would be exponential)."""
    pending, deepest = [(value, 1)], {}
    while pending:
        item, depth = pending.pop()
        if deepest.get(id(item), 0) >= depth:
            continue
        deepest[id(item)] = depth
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else ()
        if children and depth > limit:
            raise UserError(f"{short(label, 200, quote=False)}: nested more than {limit} levels deep")
        pending.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))


def read_json_object(path, missing: str, unreadable: str, not_object: str) -> dict:
    """A JSON object read from `path`; a UserError naming the path and what is wrong otherwise."""
    data = parse_json(read_input_text(path, missing, unreadable), str(path), unreadable)
    if not isinstance(data, dict):
        raise UserError(f"{short(str(path), 200, quote=False)}: {not_object}")
    return data


def read_table(path, label: str):
    """A parquet table; one-line UserError when it is missing or unreadable."""
    import pandas as pd

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: {label} table not found")
    if not path.is_file():
        raise UserError(f"{path}: {label} table is not a regular file")
    if path.with_name(path.name + WRITING_SUFFIX).exists():
        raise UserError(f"{path}: {label} table was being written when its writer stopped; run its stage again")
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
