"""The sweep's parent process: forks one child per job (up to one per GPU), watches them, writes rows
for a child that dies or stops making progress, stops launching before the time limit, and reports
progress.

Children are forked from a parent that imported torch and transformers but never initialised
CUDA, so imports are paid once. A child that dies or stops making progress gets error rows for its
remaining points. `--time-limit` stops launching children (and children stop starting points)
before the limit.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import wait
from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.measure.sweep.child import EXIT_DEADLINE, EXIT_FRESH_PROCESS, EXIT_SETUP_FAILED, fill_remaining, run_job
from pipeline.measure.sweep.jobs import Job
from pipeline.measure.sweep.parts import (current_point, event, last_progress, mark_done, part_path, pending_points,
                                  read_rows)
from pipeline.measure.sweep.plan import TimeModel

LAUNCH_MARGIN_SECONDS = 15
DEADLINE_GRACE_SECONDS = 10
PROGRESS_SECONDS = 60.0


def prepare_fork_parent(jobs: list[Job]) -> None:
    """Pay the imports once, before forking, and make sure CUDA is not initialised here."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from pipeline.measure.clients import FORK_SAFE_IMPORTS, client_module
    from pipeline.core.provenance import git_commit

    git_commit()  # cached for the children
    for client in dict.fromkeys(job.client for job in jobs):
        if client in FORK_SAFE_IMPORTS:
            client_module(client)
    for job in jobs:
        try:
            MODEL_FOR_CAUSAL_LM_MAPPING[type(job.record.transformers_config())]  # imports the modeling module
        except Exception:  # noqa: BLE001 - the child reports it
            pass
    if torch.cuda.is_initialized():
        raise UserError("CUDA was initialised in the sweep's parent process; rerun with --start-method spawn")


def process_start_time() -> float | None:
    """When this process started (Linux), so that imports and planning count in the sweep's GPU time."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except Exception:  # noqa: BLE001 - optional bookkeeping
        return None


def _signal_text(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _gpu_slots(gpus: int) -> list[str | None]:
    if gpus <= 1:
        return [None]
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return (visible or [str(i) for i in range(gpus)])[:gpus]


def run_sweep(jobs: list[Job], parts_dir, device: str = "cuda", time_limit: float | None = None,
              child_timeout: float = 240, gpus: int = 1, start_method: str = "fork", allow_tf32: bool = True,
              retry_errors: bool = False, estimate: TimeModel | None = None, target=None, log=print) -> dict:
    """Run the pending jobs in child processes (up to `gpus` at once); returns outcome counts.

    `target` is the child's function (default run_job), with run_job's arguments.
    """
    parts_dir = Path(parts_dir)
    parts_dir.mkdir(parents=True, exist_ok=True)
    started = process_start_time() or time.time()  # the command's limit counts from there
    deadline = started + time_limit if time_limit else None
    pending = [job for job in jobs if pending_points(job, read_rows(part_path(parts_dir, job)), retry_errors)]
    progress = SweepProgress(pending, parts_dir, retry_errors, log)
    if start_method == "fork":
        prepare_fork_parent(pending)
    context = multiprocessing.get_context(start_method)
    target = target or run_job
    free = _gpu_slots(gpus)
    running: dict = {}
    outcomes = {"finished": 0, "error": 0, "stopped": 0, "restarted": 0, "not started": 0}
    halted = None
    event(parts_dir, "parent_start", pid=os.getpid(), jobs=len(pending), device=device, gpus=gpus,
          process_started=process_start_time())
    main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        while pending or running:
            while pending and free and (deadline is None or time.time() < deadline - LAUNCH_MARGIN_SECONDS):
                job, slot = pending.pop(0), free.pop(0)
                process = context.Process(target=target, name=job.name, args=(
                    job, str(parts_dir), device, deadline, allow_tf32, retry_errors, estimate, slot))
                process.start()
                running[process.sentinel] = (process, job, slot, time.time())
                event(parts_dir, "child_start", job=job.name, pid=process.pid, gpu=slot)
            if not running:
                break
            wait(list(running), timeout=0.5)
            progress.report()
            for sentinel, (process, job, slot, launched) in list(running.items()):
                outcome = _check_child(process, job, parts_dir, launched, child_timeout, deadline, retry_errors)
                if outcome:
                    del running[sentinel]
                    free.append(slot)
                    outcomes[outcome] += 1
                    event(parts_dir, "child_end", job=job.name, pid=process.pid, exitcode=process.exitcode,
                          outcome=outcome)
                    progress.report(force=True)
                    if outcome == "restarted":
                        pending.insert(0, job)  # its remaining points, in a new process
                    if outcome == "error" and process.exitcode == EXIT_SETUP_FAILED:
                        halted = f"{job.name}: {current_point(part_path(parts_dir, job))}"
                        log(f"sweep: stopping, a child could not set up the device ({halted})")
                        pending.clear()
                    process.close()
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
        for process, *_ in running.values():
            process.kill()
            process.join()
        event(parts_dir, "parent_end", pid=os.getpid())
    outcomes["not started"] = len(pending)
    if halted:
        raise UserError(f"the sweep stopped: a child could not set up the device ({halted}); "
                        f"if CUDA failed to initialise in a forked child, rerun with --start-method spawn")
    return outcomes


class SweepProgress:
    """Grid points measured so far, processes done, and the time left at the rate so far (a line
    after each process ends, and every PROGRESS_SECONDS while they run)."""

    def __init__(self, jobs: list[Job], parts_dir, retry_errors: bool, log):
        self.jobs, self.parts_dir, self.retry_errors, self.log = list(jobs), parts_dir, retry_errors, log
        self.total = sum(len(self.pending(job)) for job in jobs)
        self.started = self.last = time.time()

    def pending(self, job: Job) -> list:
        return pending_points(job, read_rows(part_path(self.parts_dir, job)), self.retry_errors)

    def report(self, force: bool = False) -> None:
        now = time.time()
        if not self.total or (not force and now - self.last < PROGRESS_SECONDS):
            return
        self.last = now
        left_points = [len(self.pending(job)) for job in self.jobs]
        done = self.total - sum(left_points)
        elapsed = now - self.started
        left = f", about {elapsed / done * (self.total - done):.0f} s left" if done else ""
        self.log(f"sweep: {done}/{self.total} grid points, {left_points.count(0)}/{len(self.jobs)} processes "
                 f"({elapsed:.0f} s{left})")


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # through run_sweep's `finally`, which kills the children


def _check_child(process, job, parts_dir, launched, child_timeout, deadline, retry_errors) -> str | None:
    """None while the child runs normally; else its outcome, after writing rows for a failed child."""
    part = part_path(parts_dir, job)
    now = time.time()
    if process.exitcode is None:
        if deadline is not None and now > deadline + DEADLINE_GRACE_SECONDS:
            process.kill()
            process.join()
            return "stopped"  # its remaining points stay pending for the next run
        if now - last_progress(part, launched) <= child_timeout:
            return None
        process.kill()
        process.join()
        cause = f"no progress for {child_timeout:.0f} s (killed)"
    elif process.exitcode == 0:
        return "finished"
    elif process.exitcode == EXIT_DEADLINE:
        return "stopped"
    elif process.exitcode == EXIT_FRESH_PROCESS:
        return "restarted"
    elif process.exitcode == EXIT_SETUP_FAILED:
        return "error"
    elif process.exitcode in (-signal.SIGTERM, -signal.SIGINT):
        return "stopped"  # asked to stop from outside: its remaining points stay pending
    else:
        cause = _signal_text(process.exitcode)
    base = _device_columns(read_rows(part))
    current = current_point(part)
    first = f"the child process died during this point ({cause})" if current.startswith("{") else None
    fill_remaining(job, part, base, f"not measured: the child process died ({cause})", first, retry_errors)
    mark_done(part)
    return "error"


def _device_columns(rows: list[dict]) -> dict:
    """Provenance for rows written by the parent (which never touches CUDA): the child's, if any."""
    from pipeline.core.provenance import provenance

    base = provenance(include_device=False)
    keep = ("device", "driver_version", "gpu_total_bytes", "measure_device", "allow_tf32", "cuda_version")
    for row in rows[-1:]:
        base.update({k: row.get(k) for k in keep})
    return base
