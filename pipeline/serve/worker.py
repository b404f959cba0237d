"""The simulator's process: one worker, started once and kept warm, that answers the questions
needing torch (the exact method; blog and heuristic when they build the model) one at a time.

Why a process and not a lock in the server's own: the simulator patches torch and transformers
while it runs (dispatch modes, the meta device, a fake process group), which is not known to be
thread-safe, so its questions must run one after the other anyway; in its own process they leave
the server's event loop and the formula's answers free (a second core), a simulation that runs
past the time limit can be stopped (the process is killed and a fresh one started), and a crash
costs one answer, not the server. Questions queue on a lock in the order they came.

The exact layouts table simulates its layouts in processes of its own (`estimate.layout_search.layout_rows`): the
worker is therefore not a daemon (a daemon may not start processes) and leads a process group of its own, so
that stopping it stops them too.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback

from pipeline.core.errors import UserError
from pipeline.core.text import first_line

# A question the worker answers before it says it is ready: the imports and the simulator's
# first-call costs are paid there, not by the first user.
WARM_UP = {"model": "EleutherAI/pythia-14m", "batch": 1, "seq": 16, "precision": "bf16", "method": "exact"}
START_TIMEOUT_S = 600


class SimulationTimeout(Exception):
    pass


class WorkerDied(Exception):
    pass


def serve_questions(conn, warm: bool) -> None:
    """The worker's loop: a question in, ("ok", answer) or ("error", one line) or ("internal", one line) out; a
    streamed question (("stream", question): the layouts table or the fewest GPUs) sends ("event", event) for each
    of its events first (`questions.layouts_events_of`), then ("ok", None)."""
    from pipeline.serve.questions import answer, layouts_events_of

    if hasattr(os, "setpgrp"):
        os.setpgrp()
    from pipeline.estimate.layout_search import keep_pools

    keep_pools()  # the layouts' simulation processes stay for the next search (the worker is stopped by a kill)
    if warm:
        try:
            answer(WARM_UP)
        except Exception:  # noqa: BLE001 - a failed warm-up only means a slower first answer
            traceback.print_exc()
    conn.send(("ready", None))
    while True:
        try:
            question = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if isinstance(question, tuple) and question[0] == "stream":
                for event in layouts_events_of(question[1]):
                    conn.send(("event", event))
                reply = ("ok", None)
            else:
                reply = ("ok", answer(question))
        except UserError as exc:
            reply = ("error", str(exc))
        except Exception as exc:  # noqa: BLE001 - one line to the user, the traceback to the server's log
            traceback.print_exc()
            reply = ("internal", first_line(exc))
        conn.send(reply)


class Simulator:
    """The worker process and the lock that serializes its questions."""

    def __init__(self, timeout_s: float = 120.0, warm: bool = True):
        self.timeout_s = timeout_s
        self.warm = warm
        self._lock = threading.Lock()
        self._process = None
        self._conn = None

    def start(self) -> None:
        """Start the worker now (in the background: `ask` waits for it)."""
        threading.Thread(target=self._ensure_started_locked, daemon=True).start()

    def _ensure_started_locked(self) -> None:
        with self._lock:
            self._ensure_started()

    def _ensure_started(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        context = multiprocessing.get_context("spawn")  # a clean interpreter: no threads or state copied
        parent, child = context.Pipe()
        process = context.Process(target=serve_questions, args=(child, self.warm), name="pipeline-simulator")
        process.start()
        atexit.register(self.close)  # before multiprocessing's own exit handler waits for its processes
        child.close()
        self._process, self._conn = process, parent
        if not parent.poll(START_TIMEOUT_S):
            self._stop()
            raise WorkerDied(f"the simulator did not start within {START_TIMEOUT_S} s")
        try:
            parent.recv()
        except (EOFError, OSError):
            self._stop()
            raise WorkerDied("the simulator's process died while starting") from None

    def ask(self, question: dict) -> dict:
        """The worker's answer; UserError for bad input, SimulationTimeout past the limit, WorkerDied."""
        with self._lock:
            self._ensure_started()
            started = time.monotonic()
            try:
                self._conn.send(question)
                if not self._conn.poll(self.timeout_s):
                    self._stop()
                    raise SimulationTimeout(f"the simulation took longer than the server's limit of "
                                            f"{self.timeout_s:g} s and was stopped")
                kind, payload = self._conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                code = self._process.exitcode if self._process else None
                self._stop()
                raise WorkerDied(f"the simulator's process died (exit code {code}) after "
                                 f"{time.monotonic() - started:.1f} s") from None
        if kind == "ok":
            return payload
        if kind == "error":
            raise UserError(payload)
        raise WorkerDied(f"internal error in the simulator: {payload}")

    def ask_stream(self, question: dict):
        """The worker's events of a streamed question (the layouts table, the fewest GPUs), as they come; past the
        time limit the worker is stopped and {"event": "stopped", "reason": ...} is the last (the rows sent before
        it stand). UserError for bad input (at the first event), WorkerDied."""
        with self._lock:
            self._ensure_started()
            started = time.monotonic()
            try:
                self._conn.send(("stream", question))
                while True:
                    if not self._conn.poll(max(0.0, started + self.timeout_s - time.monotonic())):
                        self._stop()
                        yield {"event": "stopped", "reason": f"the server's time limit of {self.timeout_s:g} s "
                                                             "stopped the search"}
                        return
                    kind, payload = self._conn.recv()
                    if kind != "event":
                        break
                    yield payload
            except (EOFError, OSError, BrokenPipeError):
                code = self._process.exitcode if self._process else None
                self._stop()
                raise WorkerDied(f"the simulator's process died (exit code {code}) after "
                                 f"{time.monotonic() - started:.1f} s") from None
            except GeneratorExit:  # the client went away: the worker may be mid-search
                self._stop()
                raise
        if kind == "error":
            raise UserError(payload)
        if kind != "ok":
            raise WorkerDied(f"internal error in the simulator: {payload}")

    def _stop(self) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()
        if process is not None and process.exitcode is None:  # not reaped: its pid is still its own
            kill_group(process)
            process.join(5)

    def close(self) -> None:
        with self._lock:
            self._stop()


def kill_group(process) -> None:
    """Kill the worker and the processes it started (its process group, where the system has them)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (AttributeError, ProcessLookupError, PermissionError):  # no groups, or not yet its own group
        process.kill()


def log(message: str) -> None:
    print(f"serve: {message}", file=sys.stderr, flush=True)
