"""Simulations remembered for the length of one question: a search for the largest batch or sequence
and the answer at the value it found ask the simulator for the same run twice; inside
`one_question()` the second is a lookup. Nothing is remembered from one question to the next (the
server holds no state between requests), and outside `one_question()` every call simulates."""

from __future__ import annotations

import contextlib
import contextvars
import copy

from pipeline.training.values import Estimate, Run

_REMEMBERED = contextvars.ContextVar("remembered_simulations", default=None)


@contextlib.contextmanager
def one_question():
    """Remember the simulations made inside the block (by `simulated`), and only there."""
    token = _REMEMBERED.set({})
    try:
        yield
    finally:
        _REMEMBERED.reset(token)


def simulated(config, run: Run) -> Estimate:
    """`pipeline.simulate.simulate(config, run)`, or a copy of its answer to the same question earlier
    in this `one_question()` block."""
    from pipeline.simulate import simulate

    remembered = _REMEMBERED.get()
    if remembered is None or not repeatable(run):
        return simulate(config, run)
    from pipeline.simulate.predict import config_key

    key = (config_key(config), run)
    if key not in remembered:
        remembered[key] = simulate(config, run)
    return copy.deepcopy(remembered[key])


def repeatable(run: Run) -> bool:
    """Whether the simulator answers `run` the same way a second time in one process. Not with a
    quantized base: the loop's cached QLoRA model keeps what bitsandbytes' Linear4bit does to it in the
    first forward (its biases cast in place to the compute dtype), so the first simulation of such a
    model in a process counts fp32 biases and the later ones bf16 (the answers differ by those bytes)."""
    return run.adapter is None or run.adapter.quantization is None
