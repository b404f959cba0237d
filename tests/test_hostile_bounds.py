"""The hostile-input runner's bounds (issue 26): a case may map `MEM` bytes of address space beyond what its
process maps before it starts, whatever torch's build maps at import (about 1.4 GiB with the CPU wheel, 3.9 GiB
with the CUDA one), and a case that runs away is stopped within its time bound: by the memory bound
(MemoryError, reported as a problem) or by the time bound (killed). Each bound is shown on a child forked
from a process that imported torch and on a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test_hostile_input import GIB, MEM, RUNNER, Case, judge

pytestmark = pytest.mark.slow  # the runner imports torch, transformers and peft once, a probe interpreter again

TIMEOUT = 60  # seconds; far more than a case here needs
HANG_TIMEOUT = 3
CHUNK = 2**28
RUNAWAY_BYTES = 16 * GIB
# Maps 256 MiB at a time up to 16 GiB, saying how far it got: past MEM, so the bound must stop it.
RUNAWAY = (f"chunks = []\nfor i in range({RUNAWAY_BYTES // CHUNK}):\n"
           f"    chunks.append(np.empty({CHUNK}, dtype=np.uint8))\n    print(i + 1, flush=True)\nresult = len(chunks)")
# Touches 1 GiB: within MEM, over what a 4 GiB RLIMIT_AS left a child that imported torch's CUDA build.
WITHIN = "block = np.ones(2**30, dtype=np.uint8)\nresult = int(block[::4096].sum())"
HANG = "while True:\n    pass"
CASES = {"runaway": (RUNAWAY, TIMEOUT), "within": (WITHIN, TIMEOUT), "hang": (HANG, HANG_TIMEOUT)}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """{(case, fresh): outcome} of the cases run by the runner, forked from a process that imported torch
    (fresh False) and exec'd as a new interpreter (fresh True)."""
    root = tmp_path_factory.mktemp("bounds")
    specs = [{"id": f"{name}-{'fresh' if fresh else 'forked'}", "kind": "api", "code": code, "cwd": str(root),
              "case_dir": str(root / f"{name}-{fresh}"), "env": {}, "timeout": timeout, "mem": MEM,
              "fresh": fresh, "heavy": name == "runaway"}
             for name, (code, timeout) in CASES.items() for fresh in (False, True)]
    spec = root / "spec.json"
    spec.write_text(json.dumps({"jobs": 2, "heavy_jobs": 1, "cases": specs, "warm": [],
                                "preimport": ["numpy", "torch", "transformers", "peft"]}))
    subprocess.run([sys.executable, str(RUNNER), str(spec), str(root / "outcomes.json")], check=True, timeout=900)
    found = json.loads((root / "outcomes.json").read_text())
    return {(name, fresh): found[f"{name}-{'fresh' if fresh else 'forked'}"]
            for name in CASES for fresh in (False, True)}


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_case_that_allocates_too_much_meets_the_memory_bound(outcomes, fresh, tmp_path):
    outcome = outcomes["runaway", fresh]
    assert "MemoryError" in outcome["api"]["raised"]  # numpy's _ArrayMemoryError, a MemoryError
    assert not outcome["timed_out"] and outcome["seconds"] < TIMEOUT
    mapped = int(outcome["stdout"].split()[-1]) * CHUNK
    assert MEM - CHUNK <= mapped < RUNAWAY_BYTES  # it had its budget, and was stopped far before the end
    problems = judge(Case("runaway", "api_equal", code=RUNAWAY, timeout=TIMEOUT), outcome, tmp_path, {})
    assert any(p.startswith("raised") and "MemoryError" in p for p in problems)


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_case_within_its_budget_runs_whatever_torch_maps(outcomes, fresh):
    outcome = outcomes["within", fresh]
    assert outcome["api"] == {"raised": None, "value": 2**30 // 4096}
    assert outcome["rc"] == 0 and outcome["maxrss_kib"] * 1024 > GIB
    assert outcome["rlimit_as_bytes"] > MEM  # the baseline (torch's libraries mapped) comes on top of MEM


def test_the_forked_bound_is_the_forked_processs_address_space_plus_the_budget(outcomes):
    """A forked child starts from what the parent mapped (torch imported), an exec'd one from a probe that
    imports the same libraries: both baselines are torch's, within a GiB of each other."""
    forked, fresh = outcomes["within", False]["rlimit_as_bytes"], outcomes["within", True]["rlimit_as_bytes"]
    assert forked - MEM > 0.9 * GIB and fresh - MEM > 0.9 * GIB  # torch alone maps about 0.5 GiB (CPU wheel)
    assert abs(forked - fresh) < GIB


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_a_case_that_hangs_is_killed_at_its_time_bound(outcomes, fresh):
    outcome = outcomes["hang", fresh]
    assert outcome["timed_out"] and outcome["rc"] == -9
    assert HANG_TIMEOUT <= outcome["seconds"] < HANG_TIMEOUT + 2

