"""The child process of one job: set up the device, build the model once, measure the pending points
in order (settling skipped and oom-pruned ones without running), appending a row per point.

Whatever fails, every point still gets a row: a model that cannot be built, a failed process or a
CUDA context made unusable by an error fill the remaining points with error rows.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from pipeline.measure.clients import ONE_POINT_PER_PROCESS, client_module
from pipeline.measure.device import setup_device
from pipeline.core.text import first_line
from pipeline.measure.point import base_columns, build_point_model, finish_row, measure_point
from pipeline.measure.sweep.cost import build_seconds, point_seconds
from pipeline.measure.sweep.jobs import Job, Point, step_flops
from pipeline.measure.sweep.parts import (append_row, mark_done, oom_points, part_path, pending_points, prune_reason,
                                  read_rows, write_current)
from pipeline.training.step import Setting
from pipeline.measure.sweep.plan import DEFAULT_TIME_MODEL, TimeModel

EXIT_DEADLINE = 75  # a child that stopped before a point because the time limit was near
EXIT_SETUP_FAILED = 76  # a child that could not set up the device: the sweep stops (systemic)
EXIT_FRESH_PROCESS = 77  # a child that measured its one point (ONE_POINT_PER_PROCESS): the rest runs anew


def point_row(job: Job, point: Point, base: dict, **columns) -> dict:
    row = base_columns(job.record, job.precision, job.attn, point.setting, point.batch_size, point.seq_len)
    row.update({k: v for k, v in base.items() if v is not None})
    row["step_flops"] = step_flops(job.record.plan_parameters, point.batch_size, point.seq_len,
                                   point.setting.gradient_accumulation)
    row.update(columns)
    return finish_row(row)


def settle_without_running(job: Job, point: Point, ooms: dict, base: dict) -> dict | None:
    """The row of a point that is not run (skipped, or pruned after an oom); None if it must run."""
    if point.skip_reason:
        return point_row(job, point, base, status="skipped", reason=point.skip_reason)
    pruned = prune_reason(ooms.get(point.setting, []), point.batch_size, point.seq_len)
    if pruned:
        ooms[point.setting].append((point.batch_size, point.seq_len))
        return point_row(job, point, base, status="oom", reason=pruned)
    return None


def fill_remaining(job: Job, part, base: dict, reason: str, first_reason: str | None = None,
                   retry_errors: bool = False) -> int:
    """Rows for every point still pending, without running: error rows with `reason` (the first
    point to run gets `first_reason` when given). Returns the number of rows written."""
    rows = read_rows(part)
    ooms = oom_points(rows)
    written = 0
    for point in pending_points(job, rows, retry_errors):
        row = settle_without_running(job, point, ooms, base)
        if row is None:
            row = point_row(job, point, base, status="error", reason=first_reason or reason)
            first_reason = None
        append_row(part, row)
        written += 1
    return written


def die_with_parent() -> None:
    """Linux: the child is killed when the parent dies (e.g. killed by a command time limit)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort
        pass


def single_threaded_cpu() -> None:
    """A forked child whose parent already ran OpenMP work (GNU libgomp) hangs in its first parallel
    region; with one thread torch never enters one. Only CPU measurements run CPU kernels."""
    import torch

    torch.set_num_threads(1)


def run_job(job: Job, parts_dir, device: str = "cuda", deadline: float | None = None, allow_tf32: bool = True,
            retry_errors: bool = False, estimate: TimeModel | None = None, gpu: str | None = None) -> None:
    """The body of one child process: measure the job's pending points, appending rows."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it kills the children
    if device == "cpu":
        single_threaded_cpu()
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    part = part_path(parts_dir, job)
    todo = pending_points(job, read_rows(part), retry_errors)
    if not todo:
        mark_done(part)
        return
    write_current(part, "setup")
    try:
        base = setup_device(device, allow_tf32)
    except Exception as exc:  # noqa: BLE001 - systemic: the parent stops the sweep
        write_current(part, f"device setup failed: {first_line(exc)}")
        sys.exit(EXIT_SETUP_FAILED)
    try:
        measure_points(job, part, todo, base, device, deadline, estimate or DEFAULT_TIME_MODEL, retry_errors)
    except Exception as exc:  # noqa: BLE001 - whatever failed, the remaining points get rows
        fill_remaining(job, part, base, f"not measured: the process failed: {first_line(exc)}",
                       retry_errors=retry_errors)
    if job.adapters:
        from pipeline.training.adapters import remove_saved_base

        remove_saved_base(job.record.transformers_config(), job.model_id)
    mark_done(part)


def measure_points(job: Job, part, todo: list[Point], base: dict, device: str, deadline: float | None,
                   estimate: TimeModel, retry_errors: bool) -> None:
    """The grid loop: one model built on first need, then each point measured or settled."""
    import gc

    ooms = oom_points(read_rows(part))
    model, built = None, {}
    for point in todo:
        row = settle_without_running(job, point, ooms, base)
        if row is not None:
            append_row(part, row)
            continue
        adapter = point.setting.adapter is not None
        needed = 2 * point_seconds(job.record, point, job.precision, estimate) + 2
        if model is None or adapter:
            needed += build_seconds(job.record, estimate, point.setting)
        if deadline is not None and time.time() + needed > deadline:
            sys.exit(EXIT_DEADLINE)
        if adapter:
            model, built = None, {}  # the shared base goes: each adapter point builds its own
            columns = measure_adapter_point(job, point, part, base, device)
            if columns is None:
                continue
        else:
            if model is None:
                model, built = build_model(job, part, base, device, retry_errors)
                if model is None:
                    return
                gc.freeze()  # later collections skip the model and the imported modules
            write_current(part, json.dumps({"batch_size": point.batch_size, "seq_len": point.seq_len}))
            columns = measure_point(model, point.setting, job.precision, point.batch_size, point.seq_len, device,
                                    job.record.use_cache)
            columns = {**built, **columns}
        append_row(part, point_row(job, point, base, **columns))
        if columns["status"] == "oom":
            ooms.setdefault(point.setting, []).append((point.batch_size, point.seq_len))
        if job.client in ONE_POINT_PER_PROCESS and columns["status"] in ("ok", "oom"):
            sys.exit(EXIT_FRESH_PROCESS)  # never after a skipped or error row, which a new process would retry
        if columns["status"] == "error" and not device_healthy(device):
            fill_remaining(job, part, base, f"not measured: the CUDA context is unusable after an error at "
                           f"B={point.batch_size}, L={point.seq_len}", retry_errors=retry_errors)
            return


def build_model(job: Job, part, base: dict, device: str, retry_errors: bool):
    """(model, the columns of its build); (None, {}) after writing error rows when it cannot be built."""
    write_current(part, "building the model")
    try:
        return build_point_model(job.record, Setting(), job.precision, job.attn, device)
    except Exception as exc:  # noqa: BLE001 - a model that cannot be built: error rows
        fill_remaining(job, part, base, f"model build failed: {first_line(exc)}", retry_errors=retry_errors)
        return None, {}


def measure_adapter_point(job: Job, point: Point, part, base: dict, device: str) -> dict | None:
    """The columns of an adapter point, on a model built for it alone (PEFT wraps the base's modules
    in place; the previous point's model is gone first). A base that cannot be built is this point's
    error row; None when that row is written already."""
    release_model(device)
    unavailable = client_module(point.setting.client).unavailable(point.setting, device)
    if unavailable:
        return {"status": "skipped", "reason": unavailable}
    write_current(part, "building the model")
    try:
        model, built = build_point_model(job.record, point.setting, job.precision, job.attn, device)
    except Exception as exc:  # noqa: BLE001 - this point's error row
        append_row(part, point_row(job, point, base, status="error", reason=f"model build failed: {first_line(exc)}"))
        return None
    write_current(part, json.dumps({"batch_size": point.batch_size, "seq_len": point.seq_len}))
    columns = measure_point(model, point.setting, job.precision, point.batch_size, point.seq_len, device,
                            job.record.use_cache)
    del model
    release_model(device)
    return {**built, **columns}


def release_model(device: str) -> None:
    """Back to no model: PeftModel's reference cycles collected, the cache emptied."""
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def device_healthy(device: str) -> bool:
    """False after a sticky CUDA error (e.g. a device-side assert), which poisons the context."""
    if device != "cuda":
        return True
    import torch

    try:
        torch.cuda.synchronize()
        torch.zeros(1, device="cuda").add_(1).item()
        return True
    except Exception:  # noqa: BLE001
        return False
