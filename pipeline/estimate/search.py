"""The largest batch (or sequence length) that fits a GPU, by one search for every estimator (the
peak grows with both)."""

from __future__ import annotations

from pipeline.core.vocabulary import MAX_BATCH, MAX_SEQ, MAX_TOKENS
from pipeline.formulas.gpus import Device, outside_bytes
from pipeline.estimate.estimators import ClosedFormEstimator, Estimator
from pipeline.training.values import Run, Target
from pipeline.estimate.verdict import judge



def fits(estimator: Estimator, target: Target, run: Run, dev: Device) -> bool:
    return judge(estimator.predict(target, run), run, dev).fits


def largest_batch(estimator: Estimator, target: Target, run: Run, dev: Device, limit: int = MAX_BATCH) -> int:
    """The largest B that fits `dev` (0: none), for any estimator; never beyond `limit` or the
    project's largest question (vocabulary.MAX_BATCH, MAX_TOKENS)."""
    limit = min(limit, MAX_BATCH, MAX_TOKENS // run.seq)
    guess = None
    if isinstance(estimator, ClosedFormEstimator):  # its allocated budget, for a first guess
        room = dev.total_bytes - outside_bytes(dev, run.precision, run.attn_implementation)
        budget = room / estimator.ratio["value"]
        guess = estimator.guess_batch(target, run, budget)
    return largest(lambda batch: fits(estimator, target, run.with_batch(batch), dev), limit, guess, exact_limit=True)


def largest_seq(estimator: Estimator, target: Target, run: Run, dev: Device) -> int:
    """The largest L that fits `dev` (0: none), at most the model's context length when known and the
    project's largest question (vocabulary.MAX_SEQ, MAX_TOKENS)."""
    from pipeline.inputs.modeling import context_length

    limit = min(MAX_SEQ, MAX_TOKENS // run.batch)
    context = context_length(target.config) if target.config is not None else None
    limit = min(limit, context) if context else limit
    return largest(lambda seq: fits(estimator, target, run.with_seq(seq), dev), limit, None, exact_limit=True)


def largest(fit, limit: int, guess: int | None = None, exact_limit: bool = False) -> int:
    """The largest n >= 1 with fit(n) (0: none), for a fit that holds up to some n and not beyond.

    From 1 (or a checked guess) double the step while n fits, then bisect between the last n that
    fits and the first that does not. `limit` stops the doubling; with `exact_limit` no n beyond it
    is tried (else a guess beyond it is trusted and checked).
    """
    if not fit(1):
        return 0
    low, high = 1, None
    if guess is not None and guess > 1 and not (exact_limit and guess > limit):
        low, high = (guess, None) if fit(guess) else (1, guess)
    ceiling, step = (limit if exact_limit else max(limit, 2 * low)), 1
    while high is None:
        candidate = min(low + step, ceiling) if exact_limit else low + step
        if candidate == low:
            return low
        if candidate > ceiling or not fit(candidate):
            high = candidate
        else:
            low, step = candidate, step * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fit(middle) else (low, middle)
    return low
