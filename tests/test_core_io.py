"""The one place files come in and go out (pipeline.core.io): atomic writes, the leftovers of a killed
writer, tables written together, and input files that are not what they claim to be."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest

from pipeline.core.errors import UserError
from pipeline.core.io import MAX_INPUT_BYTES, read_json_object, read_table, write_json, written_together

KILLED_WRITER = """
import os, sys, time
from pipeline.core.io import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    tmp.write_text("half")
    print(tmp, flush=True)
    time.sleep(60)
"""


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    target = tmp_path / "table.json"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    leftover = writer.stdout.readline().strip()
    assert os.path.exists(leftover) and not target.exists()
    live = tmp_path / f".tmp-table.json.{os.getpid()}.live"  # a writer still running (this process)
    live.write_text("busy")
    writer.kill()
    writer.wait()
    assert os.path.exists(leftover)  # SIGKILL: no cleanup ran
    write_json({"a": 1}, target)
    assert not os.path.exists(leftover) and live.exists()
    assert read_json_object(target, "missing", "bad", "not an object") == {"a": 1}


def test_tables_written_together_are_refused_while_their_marker_stands(tmp_path):
    first, second = tmp_path / "models.parquet", tmp_path / "activations.parquet"
    with written_together([first, second]) as (a, b):
        pd.DataFrame({"x": [1]}).to_parquet(a)
        pd.DataFrame({"x": [2]}).to_parquet(b)
    assert read_table(second, "activations")["x"].tolist() == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["activations.parquet", "models.parquet"]
    (tmp_path / "activations.parquet.writing").touch()  # what a writer killed between the renames leaves
    with pytest.raises(UserError, match="was being written when its writer stopped"):
        read_table(second, "activations")


def test_nothing_is_written_when_the_block_fails(tmp_path):
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    with pytest.raises(RuntimeError):
        with written_together([first, second]) as (a, _):
            pd.DataFrame({"x": [1]}).to_parquet(a)
            raise RuntimeError("the second table failed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("make, message", [
    (lambda p: p.mkdir(), "not a regular file"),
    (lambda p: os.mkfifo(p), "not a regular file"),
    (lambda p: p.write_bytes(b"{" * 200_000), "not valid"),
    (lambda p: p.write_bytes(b"\xff\xfe{}"), "not UTF-8"),
    (lambda p: p.write_bytes(b" " * (MAX_INPUT_BYTES + 1)), "larger than"),
])
def test_bad_input_files_are_one_line_errors(tmp_path, make, message):
    path = tmp_path / "config.json"
    make(path)
    with pytest.raises(UserError, match=message) as error:
        read_json_object(path, "missing", "not valid JSON", "not an object")
    assert "\n" not in str(error.value)


def test_a_device_is_not_read(tmp_path):
    with pytest.raises(UserError, match="not a regular file"):
        read_json_object("/dev/zero", "missing", "bad", "not an object")


def test_an_output_that_is_a_folder_is_refused(tmp_path):
    with pytest.raises(UserError, match="is a folder"):
        write_json({}, tmp_path)
