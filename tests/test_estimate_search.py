"""The searches for the largest batch and sequence with the simulator: the headroom search finds the
boundary that the doubling search finds, in fewer simulations, and a question remembers its own
simulations (the answer at the value found is not simulated again)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from pipeline.estimate import estimate, largest, max_batch_size, max_seq_len
from pipeline.estimate.search import largest_by_headroom

SMALL = "EleutherAI/pythia-14m"


def scan(headroom, limit: int) -> int:
    """The largest n that fits, by trying every n from 1."""
    found = 0
    for n in range(1, limit + 1):
        if headroom(n) < 0:
            break
        found = n
    return found


HEADROOMS = {  # bytes left on the device at n: falling as n grows, in the shapes the simulator shows
    "affine": lambda n: 1e9 - 3.7e6 * n,
    "quadratic": lambda n: 5e8 - 1e5 * n - 3e3 * n * n,  # attention scores at long sequences
    "flat, then falling": lambda n: 4e8 - max(0, n - 40) * 2e7,  # a peak that B does not move at first
    "steps of 20 MiB": lambda n: 2e9 - (20 << 20) * math.ceil(n * 3.1e6 / (20 << 20)),  # segments
    "powers of two": lambda n: 1e4 - 3 * 2 ** math.floor(math.log2(n)),
    "none fits": lambda n: -1.0,
    "all fit": lambda n: 1.0,
}


@pytest.mark.parametrize("shape", HEADROOMS)
@pytest.mark.parametrize("limit", [1, 2, 7, 100, 4096, 1 << 20])
def test_headroom_search_finds_the_boundary_a_scan_finds(shape, limit):
    headroom, probes = HEADROOMS[shape], []

    def verdict(n):
        assert 1 <= n <= limit and n not in probes  # within the limit, each n at most once
        probes.append(n)
        return SimpleNamespace(fits=headroom(n) >= 0, headroom_bytes=headroom(n))

    found = largest_by_headroom(verdict, limit)
    assert found == scan(headroom, limit)
    assert found == largest(lambda n: headroom(n) >= 0, limit, None, exact_limit=True)  # the doubling search's
    if shape == "affine":
        assert len(probes) <= 5  # 1, 2, the boundary and its neighbour (and the limit when it fits)


def exact_question(**options) -> dict:
    return dict(model=SMALL, precision="bf16", method="exact", **options)


def counting_simulations(monkeypatch) -> list:
    """The runs the simulator is asked for (pipeline.simulate.simulate, as the estimator calls it)."""
    import pipeline.simulate

    runs, simulate = [], pipeline.simulate.simulate

    def counted(config, run):
        runs.append(run)
        return simulate(config, run)

    monkeypatch.setattr(pipeline.simulate, "simulate", counted)
    return runs


def test_exact_largest_batch_is_the_doubling_searchs_in_fewer_simulations(monkeypatch):
    """pythia-14m on a 3 GiB device at L=128: the headroom search and the doubling search (the closed
    forms') find the same batch, 14, whose neighbour does not fit; the headroom search asks for fewer
    simulations (5 against 8)."""
    from pipeline.estimate.api import prepared
    from pipeline.estimate.search import fits
    from pipeline.estimate.verdict import gpu_of

    question = exact_question(seq=128, gpu_memory_gib=3)
    runs = counting_simulations(monkeypatch)
    found = max_batch_size(**question)
    headroom_runs = len(runs)
    dev = gpu_of(None, 3)
    estimator, target, run, _ = prepared(dict(model=SMALL, config=None, params=None, active_params=None),
                                         dict(batch=1, seq=128, precision="bf16"), "exact", None, dev)
    runs.clear()
    doubling = largest(lambda b: fits(estimator, target, run.with_batch(b), dev), 1 << 15, None, exact_limit=True)
    assert found == doubling == 14
    assert headroom_runs < len(runs)
    assert estimate(**question, batch=found)["fits"] and not estimate(**question, batch=found + 1)["fits"]


def test_exact_longest_sequence_is_the_doubling_searchs():
    from pipeline.estimate.api import prepared
    from pipeline.estimate.search import fits
    from pipeline.estimate.verdict import gpu_of

    question = exact_question(batch=2, gpu_memory_gib=2)
    found = max_seq_len(**question)
    dev = gpu_of(None, 2)
    estimator, target, run, _ = prepared(dict(model=SMALL, config=None, params=None, active_params=None),
                                         dict(batch=2, seq=1, precision="bf16"), "exact", None, dev)
    limit = 512  # pythia-14m's context length
    assert found == largest(lambda s: fits(estimator, target, run.with_seq(s), dev), limit, None, exact_limit=True)
    assert found == 333


def test_a_question_remembers_its_own_simulations_only(monkeypatch):
    """Inside one_question() the same run is simulated once (the answer is the same JSON); outside,
    and in the next question, it is simulated again."""
    import json

    from pipeline.estimate.memo import one_question

    question = exact_question(batch=2, seq=128)
    runs = counting_simulations(monkeypatch)
    first = estimate(**question)
    with one_question():
        inside = [estimate(**question) for _ in range(3)]
    with one_question():
        estimate(**question)
    estimate(**question)
    assert len(runs) == 4
    assert all(json.dumps(answer) == json.dumps(first) for answer in inside)
    runs.clear()
    with one_question():  # a quantized base is simulated each time (memo.repeatable)
        estimate(**question, lora_r=8, quantization="nf4")
        estimate(**question, lora_r=8, quantization="nf4")
    assert len(runs) == 2
