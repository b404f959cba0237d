"""The largest batch (or sequence length) that fits a GPU (the peak grows with both): a doubling and
bisection search for the closed forms, whose answers cost nothing (`largest`), and one that spends
as few answers as it can for the simulator, whose answers cost a training step each
(`largest_by_headroom`). Both answer the largest n that fits where the fit holds up to some n and
not beyond."""

from __future__ import annotations

from pipeline.core.vocabulary import MAX_BATCH, MAX_SEQ, MAX_TOKENS
from pipeline.formulas.gpus import Device
from pipeline.estimate.estimators import ClosedFormEstimator, Estimator
from pipeline.training.values import Run, Target
from pipeline.estimate.verdict import Verdict, judge, run_outside_bytes

# The headroom search moves up by at most this factor per probe while it has not yet found an n that
# does not fit (and by this factor where the headroom does not yet fall with n).
GROWTH = 16


def fits(estimator: Estimator, target: Target, run: Run, dev: Device) -> bool:
    return verdict(estimator, target, run, dev).fits


def verdict(estimator: Estimator, target: Target, run: Run, dev: Device) -> Verdict:
    return judge(estimator.predict(target, run), run, dev)


def largest_batch(estimator: Estimator, target: Target, run: Run, dev: Device, limit: int = MAX_BATCH) -> int:
    """The largest B that fits `dev` (0: none), for any estimator; never beyond `limit` or the
    project's largest question (vocabulary.MAX_BATCH, MAX_TOKENS)."""
    limit = min(limit, MAX_BATCH, MAX_TOKENS // run.seq)
    unit = batch_unit(run)
    if unit > 1:  # GRPO / RLOO: the batches TRL takes, multiples of a whole number of prompts
        found = largest_by_headroom(lambda groups: verdict(estimator, target, run.with_batch(groups * unit), dev),
                                    limit // unit)
        return found * unit
    guess = None
    if isinstance(estimator, ClosedFormEstimator):  # its allocated budget, for a first guess
        room = dev.total_bytes - run_outside_bytes(run, dev)
        budget = room / estimator.ratio["value"]
        guess = estimator.guess_batch(target, run, budget)
        return largest(lambda batch: fits(estimator, target, run.with_batch(batch), dev), limit, guess,
                       exact_limit=True)
    return largest_by_headroom(lambda batch: verdict(estimator, target, run.with_batch(batch), dev), limit)


def batch_unit(run: Run) -> int:
    """The step between the batches a run's client takes: GRPO and RLOO generate `batch x steps_per_generation`
    completions on each data-parallel rank, together a multiple of num_generations (`training.grpo.check`); 1 for
    the other clients."""
    if run.rollout is None:
        return 1
    import math

    full = run.rollout.defaults(run.client)
    steps = (full.steps_per_generation or run.gradient_accumulation) * run.layout.data_parallel
    return full.num_generations // math.gcd(full.num_generations, steps)


def largest_seq(estimator: Estimator, target: Target, run: Run, dev: Device) -> int:
    """The largest L that fits `dev` (0: none), at most the model's context length when known and the
    project's largest question (vocabulary.MAX_SEQ, MAX_TOKENS)."""
    from pipeline.inputs.modeling import context_length

    limit = min(MAX_SEQ, MAX_TOKENS // run.batch)
    context = context_length(target.config) if target.config is not None else None
    limit = min(limit, context) if context else limit
    if isinstance(estimator, ClosedFormEstimator):
        return largest(lambda seq: fits(estimator, target, run.with_seq(seq), dev), limit, None, exact_limit=True)
    return largest_by_headroom(lambda seq: verdict(estimator, target, run.with_seq(seq), dev), limit)


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


def largest_by_headroom(verdict_of, limit: int) -> int:
    """The largest n in 1..limit whose verdict fits (0: none), for verdicts that fit up to some n and
    not beyond (as `largest`), in few calls of `verdict_of(n)`.

    n = 1 is tried first (0 when it does not fit). Each next n is where the headroom crosses zero on
    the line through two earlier ones: between the largest n that fits and the smallest that does not
    (regula falsi, with the Illinois rule: an end kept twice in a row counts half; the middle where
    two probes did not halve that bracket), or, before any n
    failed, beyond the last two (at most GROWTH times the largest n that fits; GROWTH times where the
    headroom did not fall). The answer is settled by its neighbour: n fits and n + 1 does not (or
    n = limit); a headroom that falls by the same bytes per step is settled in two or three calls
    after the first two.
    """
    headroom = {}

    def fits_at(n: int) -> bool:
        answer = verdict_of(n)
        headroom[n] = answer.headroom_bytes
        return answer.fits

    if not fits_at(1):
        return 0
    low, high = 1, None
    weight = {"low": 1.0, "high": 1.0}
    moved, widths = None, []
    while low < limit and (high is None or high - low > 1):
        if high is None:
            below = max((n for n in headroom if n < low), default=None)
            fall = None if below is None else (headroom[below] - headroom[low]) / (low - below)
            step = GROWTH * low if fall is None or fall <= 0 else headroom[low] // fall
            n = int(min(max(low + step, low + 1), GROWTH * low, limit)) if below is not None else 2
        elif len(widths) >= 2 and 2 * (high - low) > widths[-2]:
            n = (low + high) // 2  # two probes did not halve the bracket: bisect
        else:
            above, under = headroom[low] * weight["low"], headroom[high] * weight["high"]
            share = above / (above - under) if above - under > 0 else 0.5
            n = min(max(low + int(share * (high - low)), low + 1), high - 1)
        if high is not None:
            widths.append(high - low)
        side = "low" if fits_at(n) else "high"
        if side == "low":
            low = n
        else:
            high = n
        weight[side] = 1.0
        if moved == side:
            weight["high" if side == "low" else "low"] /= 2
        moved = side
    return low
