"""Run many hostile-input cases, each in its own bounded child process, and report their outcomes.

    python runner.py SPEC.json OUTCOMES.json

SPEC.json: {"jobs": N, "heavy_jobs": N, "fresh": bool, "preimport": [module, ...], "warm": [argv, ...],
"warm_cwd": path, "cases": [case, ...]}; a case is {"id", "kind": "cli" | "api", "argv": [...] (cli:
the arguments after `python -m pipeline`) or "code": "..." (api: statements that set `result`),
"cwd", "env": {...}, "timeout": seconds, "mem": bytes, "fresh": bool, "heavy": bool}. At most
`heavy_jobs` heavy cases (those that may use gigabytes before they fail) run at once.

Each case runs in a child of its own session (its process group is killed on timeout), with
stdin from /dev/null and stdout / stderr to files, and may map `mem` bytes of address space beyond
what it starts with: RLIMIT_AS = its baseline + mem. A forked child's baseline is its own address space
right after the fork (VmSize: what this process mapped, torch's libraries included, whatever their
build); an exec'd child's is the peak of a probe interpreter that imports the `preimport` libraries in
this environment (VmPeak), measured once before the cases. So the bound is what the case itself maps,
under a CPU or a CUDA build of torch alike, and a case that runs away still meets it (MemoryError). The
limit set is written to `rlimit_as` in the case folder and reported as `rlimit_as_bytes`. By default the child is forked
from this process after importing the heavy third-party libraries once (torch, transformers, peft):
a `cli` case then runs `runpy.run_module("pipeline", run_name="__main__")`, exactly what
`python -m pipeline` runs, with the interpreter's exit semantics (SystemExit code; an uncaught
exception prints its traceback and exits 1). Before forking, this process runs the command line once
for each `warm` argv (`--help`), in `warm_cwd`, output discarded: it imports the stage modules
through the public entry point, so that a child does not import them again. With `fresh` (per case, or for all with the spec's
`fresh` or HOSTILE_FRESH=1) the child instead execs a new interpreter: `python -m pipeline ARGV` or
`python -c` for an api case. Nothing of the package under test is imported here beyond its public
API (`pipeline.estimate`, `pipeline.activations`) when `preimport` names them, and whatever
`python -m pipeline --help` imports. A case about what is read from the working directory should be
`fresh`: a module that read it at import would have read `warm_cwd` here.

An `api` case's code runs with `np` (numpy), `json`, `math` and `case_dir` in its namespace and
sets `result`; the child writes {"raised": null, "value": result} or {"raised": "module.Class",
"message": str(exc), "value_or_type_error": bool} to api.json in its case folder.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

API_PRELUDE = """
import json, math, sys, traceback
import numpy as np
"""

API_EPILOGUE = r"""
def _jsonable(value):
    return json.loads(json.dumps(value, default=lambda o: o.item() if hasattr(o, "item") else repr(o)))
_out = {}
try:
    exec(compile(_CODE, "<case>", "exec"), _ns)
    _out = {"raised": None, "value": _jsonable(_ns.get("result"))}
except Exception as _exc:  # noqa: BLE001 - the outcome is the point
    _out = {"raised": f"{type(_exc).__module__}.{type(_exc).__qualname__}", "message": str(_exc),
            "value_or_type_error": isinstance(_exc, (ValueError, TypeError)),
            "traceback_tail": traceback.format_exc().strip().splitlines()[-1][:500]}
with open(_API_OUT, "w") as _f:
    json.dump(_out, _f)
"""


def api_source(code: str, case_dir: str) -> str:
    return (API_PRELUDE + f"_CODE = {code!r}\n_API_OUT = {str(Path(case_dir) / 'api.json')!r}\n"
            f"_ns = {{'np': np, 'json': json, 'math': math, 'case_dir': {case_dir!r}}}\n" + API_EPILOGUE)


def status_bytes(field: str) -> int:
    """A size of this process from /proc/self/status (VmSize: mapped now; VmPeak: the most mapped)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


PROBE = """
import importlib
for name in {names!r}:
    try:
        importlib.import_module(name)
    except Exception:
        pass
for line in open("/proc/self/status"):
    if line.startswith("VmPeak:"):
        print(int(line.split()[1]) * 1024)
"""


def fresh_baseline(names: list) -> int:
    """The peak address space of a fresh interpreter importing `names` here: what an exec'd case maps
    before its own work."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", PROBE.format(names=list(names))], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=600, check=True)
    return int(done.stdout.split()[-1])


def limit_memory(case: dict, case_dir: Path, baseline: int | None) -> None:
    """RLIMIT_AS = the baseline (this process's address space when None: a forked child's) + the case's mem."""
    limit = (status_bytes("VmSize") if baseline is None else baseline) + case["mem"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    (case_dir / "rlimit_as").write_text(str(limit))


def child(case: dict, case_dir: Path, fresh: bool, baseline: int | None) -> None:
    """In the forked child: limits, folders, descriptors; then run the case and exit (never returns)."""
    code = 1
    try:
        os.setsid()
        limit_memory(case, case_dir, baseline if fresh else None)
        os.chdir(case["cwd"])
        env = {**os.environ, **case.get("env", {})}
        for key, value in case.get("env", {}).items():
            if value is None:
                env.pop(key, None)
        env = {k: v for k, v in env.items() if v is not None}
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(case_dir / "stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(case_dir / "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        if fresh:
            if case["kind"] == "cli":
                argv = [sys.executable, "-m", "pipeline", *case["argv"]]
            else:
                argv = [sys.executable, "-c", api_source(case["code"], str(case_dir))]
            os.execve(sys.executable, argv, env)
        os.environ.clear()
        os.environ.update(env)
        code = run_in_process(case, case_dir)
    except BaseException:  # noqa: BLE001 - a child must never return into the scheduler
        try:
            import traceback

            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code)


def run_in_process(case: dict, case_dir: Path) -> int:
    import atexit
    import runpy
    import traceback

    if case["kind"] == "api":
        exec(compile(api_source(case["code"], str(case_dir)), "<api-case>", "exec"), {"__name__": "__main__"})
        code = 0
    else:
        sys.argv = ["python -m pipeline", *case["argv"]]
        try:
            runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
            traceback.print_exc()
            code = 1
    try:
        atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter runs before it exits
    except BaseException:  # noqa: BLE001
        pass
    return code


def warm(argvs: list, cwd: str) -> None:
    """Run `python -m pipeline ARGV` in this process for each argv, output discarded, errors ignored."""
    import contextlib
    import io
    import runpy

    here = os.getcwd()
    saved = sys.argv
    try:
        os.chdir(cwd)
        for argv in argvs:
            sys.argv = ["python -m pipeline", *argv]
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    runpy.run_module("pipeline", run_name="__main__", alter_sys=True)
                except BaseException:  # noqa: BLE001 - --help exits; anything else only costs time
                    pass
    finally:
        sys.argv = saved
        os.chdir(here)


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    all_fresh = bool(spec.get("fresh")) or os.environ.get("HOSTILE_FRESH") == "1"
    baseline = None
    if all_fresh or any(case.get("fresh") for case in spec["cases"]):
        baseline = fresh_baseline(spec.get("preimport", []))
    if not all_fresh:
        import importlib

        for name in spec.get("preimport", []):
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a missing optional library only costs time
                pass
        warm(spec.get("warm", []), spec.get("warm_cwd") or os.getcwd())
        import gc

        gc.collect()
        gc.freeze()  # the children's collections then leave the shared pages alone (fewer copy-on-write faults)
    cases = list(spec["cases"])
    jobs = max(1, int(spec.get("jobs", 2)))
    heavy_jobs = max(1, int(spec.get("heavy_jobs", 1)))
    running: dict[int, tuple[dict, float, Path]] = {}
    outcomes = {}
    while cases or running:
        while cases and len(running) < jobs:
            heavy_running = sum(1 for case, _, _ in running.values() if case.get("heavy"))
            ready = [c for c in cases if not c.get("heavy") or heavy_running < heavy_jobs]
            if not ready:
                break
            case = ready[0]
            cases.remove(case)
            case_dir = Path(case["case_dir"])
            case_dir.mkdir(parents=True, exist_ok=True)
            fresh = all_fresh or bool(case.get("fresh"))
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                child(case, case_dir, fresh, baseline)
            running[pid] = (case, time.monotonic(), case_dir)
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        now = time.monotonic()
        if pid == 0:
            for other, (case, started, _) in list(running.items()):
                if now - started > case["timeout"] and not case.get("_killed"):
                    case["_killed"] = True
                    kill_group(other)
            time.sleep(0.02)
            continue
        case, started, case_dir = running.pop(pid)
        kill_group(pid)  # whatever it left behind (stage workers)
        if os.WIFEXITED(status):
            rc = os.WEXITSTATUS(status)
        else:
            rc = -os.WTERMSIG(status)
        outcome = {"rc": rc, "seconds": round(now - started, 3), "timed_out": bool(case.get("_killed")),
                   "timeout": case["timeout"],
                   "maxrss_kib": usage.ru_maxrss, "cpu_user": round(usage.ru_utime, 3),
                   "cpu_sys": round(usage.ru_stime, 3), "fresh": all_fresh or bool(case.get("fresh"))}
        for name in ("stdout", "stderr"):
            path = case_dir / name
            data = path.read_bytes() if path.exists() else b""
            if len(data) > 200_000:  # the head and the tail (a deep traceback's exception is its last line);
                data = data[:100_000] + b" [...] " + data[-100_000:]  # a 1 MB line stays one (long) line
            outcome[name] = data.decode("utf-8", "replace")
            outcome[name + "_bytes"] = len(data)
        limit = case_dir / "rlimit_as"
        outcome["rlimit_as_bytes"] = int(limit.read_text()) if limit.exists() else None
        api = case_dir / "api.json"
        if case["kind"] == "api":
            outcome["api"] = json.loads(api.read_text()) if api.exists() else None
        outcomes[case["id"]] = outcome
    out_path.write_text(json.dumps(outcomes, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
