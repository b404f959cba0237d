"""Which layouts fit, and the fewest GPUs that do: the question people ask before they rent a cluster.

`layout_rows(estimator, target, run, dev, counts)`: for each N of `counts` the candidate layouts
(`training.layout.candidate_layouts`: ddp, fsdp, fsdp-no-reshard; for the loop also hsdp across nodes and tensor
parallelism within one), each answered by the estimator with the run's other settings: per-GPU peak, reserved
bytes, the verdict on `dev` (NCCL's memory outside PyTorch counted by the layout's communicators) and the
headroom, each yielded as it is answered. `fewest_gpus_events(...)`: the search for the smallest N
(doubling from 1) with a layout that fits, event by event.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

from pipeline.core.errors import UserError
from pipeline.core.vocabulary import MAX_GPUS, WEIGHT_BYTES
from pipeline.estimate.verdict import judge, limited, run_outside_bytes
from pipeline.formulas.components import optimizer_bytes
from pipeline.training.layout import Layout, candidate_layouts
from pipeline.training.values import GIB, Run

MAX_WORKERS = 4  # the exact layouts' simulations at once (each holds a model's trace: about 1 GB)
POOLS = {}  # workers -> the process pool of `simulations` kept for later searches ("keep": `keep_pools` was called)


def layout_row(estimator, target, run: Run, layout: Layout, dev) -> dict:
    """One layout's answer: its columns, the per-GPU peak and reserved bytes, and the verdict on `dev`; a layout
    whose weights, gradients and optimizer state alone exceed the GPU is answered without its step."""
    laid = limited(replace(run, **layout.columns()), dev)
    floor = static_bytes(target.parameters, laid)
    if floor + run_outside_bytes(laid, dev) > dev.total_bytes:
        return {**layout.columns(), "layout": layout.describe(), "fits": False, "peak_bytes": None,
                "reason": f"weights, gradients and optimizer state alone take {floor / GIB:.1f} GiB a GPU"}
    try:
        estimated = estimator.predict(target, laid)
    except UserError as exc:
        return {**layout.columns(), "layout": layout.describe(), "fits": None, "reason": str(exc)}
    verdict = judge(estimated, laid, dev)
    return {**layout.columns(), "layout": layout.describe(), "peak_bytes": estimated.peak_bytes,
            "peak_reserved_bytes": verdict.reserved_bytes, "outside_bytes": verdict.outside_bytes,
            "fits": bool(verdict.fits), "headroom_bytes": verdict.headroom_bytes}


def static_bytes(parameters: int, run: Run) -> float:
    """A floor of one GPU's bytes under the run's layout, exact from N: its share of the weights, and with full
    fine-tuning of the gradients and optimizer state (in the weights' dtype or more: accelerate's FSDP2 upcasts),
    plus the weights fsdp-no-reshard keeps gathered from the forward to the backward."""
    layout = run.layout
    weights = WEIGHT_BYTES[run.precision] * parameters
    total = weights
    if run.adapter is None:
        total += weights + optimizer_bytes(run.optimizer_key, parameters, WEIGHT_BYTES[run.precision])[0]
    total /= layout.shards * layout.tensor_parallel
    if layout.sharding == "fsdp-no-reshard":
        total += weights * (1 - 1 / layout.shards) / layout.tensor_parallel
    return total


def heads_of(target) -> tuple:
    """The attention and key/value head counts a tensor-parallel size must divide (from the config, if any)."""
    config = target.config
    if config is None:
        return ()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    get = text.get if isinstance(text, dict) else lambda name: getattr(text, name, None)
    return tuple(h for h in (get("num_attention_heads"), get("num_key_value_heads")) if isinstance(h, int) and h > 0)


def planned_layouts(target, run: Run, counts) -> list[Layout]:
    """The candidate layouts of every N in `counts`, in the table's order."""
    heads = heads_of(target)
    return [layout for n in counts for layout in candidate_layouts(n, run.client, heads)]


def layout_rows(estimator, target, run: Run, dev, counts, workers: int | None = None):
    """(index in `planned_layouts`, row) of each layout as it is answered: in order for the closed forms, as each
    simulation ends for the exact method, whose answers (seconds each for a 70B model) are asked of `workers`
    processes at once (default: the CPUs there are, at most 4)."""
    layouts = planned_layouts(target, run, counts)
    with simulations(estimator, workers, len(layouts)) as pool:
        yield from answered(pool, estimator, target, run, layouts, dev)


@contextlib.contextmanager
def simulations(estimator, workers: int | None = None, most: int = MAX_WORKERS):
    """The processes the exact method's layouts are simulated in, or None where they are answered here (the closed
    forms, or a single CPU): spawned for a whole search, or, where `keep_pools()` was called (the server's worker,
    which asks many and is stopped by a kill), once for the process's later searches too: each pays the imports
    once."""
    workers = min(workers or os.cpu_count() or 1, MAX_WORKERS, most)
    if estimator.name != "exact" or workers < 2:
        yield None
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if POOLS.get("keep") is None:
        # spawned, not forked: a process that has run autograd cannot fork it
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            yield pool
        return
    pool = POOLS.get(workers)
    if pool is None:
        pool = POOLS[workers] = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    yield pool


def keep_pools() -> None:
    """Keep the simulation processes of `simulations` for this process's later searches (a process that is stopped
    by a kill, not by returning: an interpreter exiting with such a pool would wait on it)."""
    POOLS["keep"] = True


def answered(pool, estimator, target, run: Run, layouts, dev):
    """(index, row) of each of `layouts` as it is answered, in `pool` (`simulations`) or here. A search stopped
    midway leaves none of its simulations waiting; a pool whose process died is not used again."""
    if pool is None:
        for index, layout in enumerate(layouts):
            yield index, layout_row(estimator, target, run, layout, dev)
        return
    from concurrent.futures import as_completed
    from concurrent.futures.process import BrokenProcessPool

    futures = {}
    try:
        futures = {pool.submit(layout_row, estimator, target, run, layout, dev): index
                   for index, layout in enumerate(layouts)}
        for future in as_completed(futures):
            yield futures[future], future.result()
    except BrokenProcessPool:
        for key in [key for key, kept in POOLS.items() if kept is pool]:
            del POOLS[key]
        raise
    finally:
        for future in futures:
            future.cancel()


def doubling(limit: int) -> list[int]:
    counts, n = [], 1
    while n <= limit:
        counts.append(n)
        n *= 2
    return counts


def fewest_gpus_events(estimator, target, run: Run, dev, limit: int = MAX_GPUS):
    """The fewest-GPUs search as it goes: {"event": "count", "num_gpus", "layouts"} before each N, {"event":
    "row", "index", "row"} as each layout is answered (its index among all the rows asked), {"event": "found",
    "min_gpus"} at the end (0: none fits)."""
    asked = 0
    with simulations(estimator) as pool:
        for n in doubling(limit):
            layouts = planned_layouts(target, run, [n])
            yield {"event": "count", "num_gpus": n, "layouts": len(layouts)}
            fits = False
            for index, row in answered(pool, estimator, target, run, layouts, dev):
                fits = fits or bool(row["fits"])
                yield {"event": "row", "index": asked + index, "row": row}
            asked += len(layouts)
            if fits:
                yield {"event": "found", "min_gpus": n}
                return
    yield {"event": "found", "min_gpus": 0}


def table_text(rows: list[dict]) -> str:
    lines = [f"  {'layout':<60} {'peak GiB':>9} {'reserved GiB':>13} {'fits':>5}"]
    for row in rows:
        if row.get("peak_bytes") is None:
            lines.append(f"  {row['layout']:<60} {'no' if row['fits'] is False else '?':>29} {row['reason'][:70]}")
            continue
        lines.append(f"  {row['layout']:<60} {row['peak_bytes'] / GIB:9.2f} {row['peak_reserved_bytes'] / GIB:13.2f} "
                     f"{'yes' if row['fits'] else 'no':>5}")
    return "\n".join(lines)
