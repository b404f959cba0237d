"""The peak-memory sweep: plan (config/sweep.yaml), isolated child processes, resumable parts.

Plan: every (model, precision, attention) is one job, run in its own child process (a fresh CUDA
context); its points are the plan's settings (standard step, checkpointing, SGD, blog loop) times
the (B, L) grid, each L in increasing B. Points beyond the context length or over the compute
budget (6*N*B*L FLOPs per step) are `skipped`; once (B, L) runs out of memory, every point with
B' >= B and L' >= L of the same setting is recorded `oom` without running. Jobs run smallest
model first, so a sweep that is cut off still covers many models.

Children are forked from a parent that imported torch and transformers but never initialised
CUDA, so imports are paid once. Each child appends its rows to `<parts>/<job>.jsonl` (flushed and
fsynced per row) and writes `<job>.done` at the end; a rerun skips points that have rows. A child
that dies or stops making progress gets error rows for its remaining points. `--time-limit` stops
launching children (and children stop starting points) before the limit. The parts are merged into
results/peak_memory.parquet (deduplicated on the key columns, atomic write).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

from pipeline.errors import UserError
from pipeline.memory import (COLUMNS, KEY_COLUMNS, PRECISIONS, STEPS, Setting, check_attention,
                             check_precision)

DEFAULT_PLAN = "config/sweep.yaml"
DEFAULT_CONFIGS = "results/configs.json"
DEFAULT_PARTS = "results/peak_memory_parts"
DEFAULT_OUT = "results/peak_memory.parquet"
EVENTS_FILE = "_events.jsonl"
EXIT_DEADLINE = 75  # a child that stopped before a point because the time limit was near
EXIT_SETUP_FAILED = 76  # a child that could not set up the device: the sweep stops (systemic)
LAUNCH_MARGIN_SECONDS = 15
DEADLINE_GRACE_SECONDS = 10
GIB = 2**30

DEFAULT_ESTIMATE = {
    # Conservative guesses for one H200 (fp32 with TF32 matmuls); calibrate them with
    # benchmarks/sweep_efficiency.py on a smoke run.
    "flops_per_second": {"fp32": 1.0e14, "bf16": 2.0e14, "amp-bf16": 1.5e14},
    "step_floor_seconds": 0.01,  # a step of a tiny model (launch-bound)
    "layer_step_seconds": 0.0015,  # launch-bound cost per layer per step (forward + backward + optimizer)
    "point_overhead_seconds": 0.08,  # empty_cache, allocation, synchronisation, row write
    "process_overhead_seconds": 2.0,  # fork, CUDA context, first kernels
    "build_seconds_per_billion": 0.5,  # building random weights on the GPU
}
PLAN_KEYS = {"grid", "max_step_flops", "allow_tf32", "child_timeout_seconds", "gpu_memory_gib", "estimate",
             "models", "precisions", "variants"}
GROUP_KEYS = {"name", "models", "precisions", "variant", "optimizer", "gradient_checkpointing",
              "attn_implementation", "grid", "points", "max_step_flops"}


# --- the plan --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    setting: Setting
    batch_size: int
    seq_len: int
    skip_reason: str | None = None


@dataclass
class Job:
    """One child process: one model in one precision with one attention implementation."""

    record: dict  # configs.json record + model_id and facts (see model_record)
    precision: str
    attn: str
    points: list[Point] = field(default_factory=list)

    @property
    def model_id(self) -> str:
        return self.record["model_id"]

    @property
    def name(self) -> str:
        from pipeline.registry import safe_name

        return f"{safe_name(self.model_id)}__{self.precision}__{self.attn}"

    def key(self, point: Point) -> tuple:
        s = point.setting
        return (self.model_id, self.precision, s.variant, s.optimizer, s.gradient_checkpointing, self.attn,
                point.batch_size, point.seq_len)


def _positive_ints(values, label: str) -> list[int]:
    if not isinstance(values, list) or not values:
        raise UserError(f"{label}: must be a non-empty list of positive integers")
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UserError(f"{label}: {value!r} is not a positive integer")
    return sorted(set(values))


def _grid(data, label: str) -> dict:
    if not isinstance(data, dict) or set(data) != {"batch_sizes", "seq_lens"}:
        raise UserError(f"{label}: needs exactly batch_sizes and seq_lens")
    return {"batch_sizes": _positive_ints(data["batch_sizes"], f"{label}.batch_sizes"),
            "seq_lens": _positive_ints(data["seq_lens"], f"{label}.seq_lens")}


def _number(value, label: str, minimum: float = 0) -> float:
    """A number above `minimum`; YAML reads 2.0e13 (no sign in the exponent) as text, so text is parsed."""
    try:
        number = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or not number > minimum:
        raise UserError(f"{label}: {value!r} must be a number above {minimum}")
    return number


def _models(value, label: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
        raise UserError(f"{label}: must be a list of model ids")
    return list(dict.fromkeys(value))


def _precisions(value, label: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{label}: must be a non-empty list")
    for precision in value:
        try:
            check_precision(precision)
        except UserError as exc:
            raise UserError(f"{label}: {exc}") from None
    return list(dict.fromkeys(value))


def parse_plan(data, name: str = "sweep plan") -> dict:
    """Validate a sweep plan (see config/sweep.yaml) into groups of (setting, models, grid)."""
    if not isinstance(data, dict):
        raise UserError(f"{name}: not a mapping")
    unknown = set(data) - PLAN_KEYS
    if unknown:
        raise UserError(f"{name}: unknown key {sorted(unknown)[0]!r}")
    grid = _grid(data.get("grid"), f"{name}: grid")
    budget = _number(data.get("max_step_flops", 1e30), f"{name}: max_step_flops")
    precisions = _precisions(data.get("precisions", list(PRECISIONS)), f"{name}: precisions")
    estimate = _estimate(data.get("estimate") or {}, f"{name}: estimate")
    groups = [{"name": "standard", "models": _models(data.get("models", []), f"{name}: models"),
               "precisions": precisions, "setting": Setting(), "attn": "default", "grid": grid,
               "points": None, "max_step_flops": budget, "own_budget": False}]
    for index, item in enumerate(data.get("variants") or []):
        groups.append(_group(item, f"{name}: variants[{index}]", grid, precisions, budget))
    allow_tf32 = data.get("allow_tf32", True)
    if not isinstance(allow_tf32, bool):
        raise UserError(f"{name}: allow_tf32 must be true or false")
    return {"groups": groups, "estimate": estimate, "allow_tf32": allow_tf32,
            "child_timeout_seconds": _number(data.get("child_timeout_seconds", 240), f"{name}: child_timeout_seconds"),
            "gpu_memory_bytes": _number(data.get("gpu_memory_gib", 139), f"{name}: gpu_memory_gib") * GIB}


def _estimate(data, label: str) -> dict:
    if not isinstance(data, dict):
        raise UserError(f"{label}: not a mapping")
    estimate = dict(DEFAULT_ESTIMATE, **data)
    unknown = set(estimate) - set(DEFAULT_ESTIMATE)
    if unknown:
        raise UserError(f"{label}: unknown key {sorted(unknown)[0]!r}")
    rates = estimate["flops_per_second"]
    if not isinstance(rates, dict) or set(rates) != set(PRECISIONS):
        raise UserError(f"{label}.flops_per_second: needs one rate per precision ({', '.join(PRECISIONS)})")
    estimate["flops_per_second"] = {p: _number(v, f"{label}.flops_per_second.{p}") for p, v in rates.items()}
    for key in set(DEFAULT_ESTIMATE) - {"flops_per_second"}:
        estimate[key] = _number(estimate[key], f"{label}.{key}", minimum=-1e-12)
    return estimate


def _group(item, label: str, grid: dict, precisions: list[str], budget: float) -> dict:
    if not isinstance(item, dict):
        raise UserError(f"{label}: not a mapping")
    unknown = set(item) - GROUP_KEYS
    if unknown:
        raise UserError(f"{label}: unknown key {sorted(unknown)[0]!r}")
    setting = Setting(item.get("variant", "standard"), item.get("optimizer", "adamw"),
                      item.get("gradient_checkpointing", False))
    attn = item.get("attn_implementation", "default")
    try:
        setting.check()
        check_attention(attn)
    except UserError as exc:
        raise UserError(f"{label}: {exc}") from None
    points = item.get("points")
    if points is not None:
        if not isinstance(points, list) or not points or not all(isinstance(p, list) and len(p) == 2 for p in points):
            raise UserError(f"{label}: points must be a list of [batch_size, seq_len] pairs")
        for pair in points:
            _positive_ints(pair, f"{label}: points")
        points = [tuple(pair) for pair in points]
    return {"name": item.get("name", f"variant {label}"), "models": _models(item.get("models", []), f"{label}: models"),
            "precisions": _precisions(item.get("precisions", precisions), f"{label}: precisions"),
            "setting": setting, "attn": attn, "points": points,
            "grid": _grid(item["grid"], f"{label}: grid") if "grid" in item else grid,
            "max_step_flops": _number(item.get("max_step_flops", budget), f"{label}: max_step_flops"),
            "own_budget": "max_step_flops" in item}


def load_plan(path) -> dict:
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: sweep plan not found") from None
    except yaml.YAMLError:
        raise UserError(f"{path}: not valid YAML") from None
    return parse_plan(data, str(path))


def override_plan(plan: dict, models=None, precisions=None, batch_sizes=None, seq_lens=None,
                  max_step_flops=None, standard_only=False) -> dict:
    """Command-line narrowing of a plan (a smoke test, a subset)."""
    groups = plan["groups"][:1] if standard_only else plan["groups"]
    if models:
        planned = {m for group in groups for m in group["models"]}
        missing = [m for m in models if m not in planned]
        if missing:
            raise UserError(f"--models: {missing[0]!r} is not in the plan")
    if precisions:
        _precisions(list(precisions), "--precisions")
    narrowed = []
    for group in groups:
        group = dict(group)
        if models:
            group["models"] = [m for m in group["models"] if m in models]
        if precisions:
            group["precisions"] = [p for p in group["precisions"] if p in precisions]
        if batch_sizes or seq_lens:
            group["grid"] = {"batch_sizes": sorted(set(batch_sizes or group["grid"]["batch_sizes"])),
                             "seq_lens": sorted(set(seq_lens or group["grid"]["seq_lens"]))}
            group["points"] = None
        if max_step_flops and not group["own_budget"]:  # a group's own budget (blog points) stays
            group["max_step_flops"] = max_step_flops
        narrowed.append(group)
    return dict(plan, groups=narrowed)


# --- models: configs.json records plus the facts the plan needs -----------------------------------

def model_facts(model_id: str, config) -> dict:
    """Parameters (counted on the meta device; None if it cannot be built there), the count the plan
    uses (the same, else a rough 12*layers*width^2 + 2*vocab*width), layers, width, vocabulary,
    context length, and use_cache as the config sets it (the blog's loop uses it)."""
    from pipeline.modeling import context_length

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = _first_int(text, ("num_hidden_layers", "n_layer", "num_layers")) or 1
    hidden = _first_int(text, ("hidden_size", "n_embd", "d_model")) or 1
    vocab = _first_int(text, ("vocab_size",)) or 1
    parameters = meta_parameters(config)
    return {"parameters": parameters, "plan_parameters": parameters or 12 * layers * hidden**2 + 2 * vocab * hidden,
            "layers": layers, "hidden": hidden, "vocab": vocab, "context": context_length(config),
            "use_cache": bool(getattr(text, "use_cache", True))}


def _first_int(config, names) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def meta_parameters(config) -> int | None:
    from pipeline.modeling import build_model, count_parameters, training_config

    try:
        return count_parameters(build_model(training_config(config), device="meta"))
    except Exception:  # noqa: BLE001 - a model that cannot be built fails in its child, with a row
        return None


def load_model_records(configs_path, model_ids) -> tuple[dict, list[str]]:
    """Records of `model_ids` from configs.json (ok entries) and the ids that have none."""
    from pipeline.configs import config_from_dict

    path = Path(configs_path)
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: not found (run `python -m pipeline configs` first)") from None
    except json.JSONDecodeError:
        raise UserError(f"{path}: not a JSON file") from None
    records, missing = {}, []
    for model_id in model_ids:
        entry = entries.get(model_id)
        if not entry or entry.get("status") != "ok":
            missing.append(model_id)
            continue
        record = dict(entry, model_id=model_id)
        record.update(model_facts(model_id, config_from_dict(entry["config"], model_id)))
        records[model_id] = record
    return records, missing


def model_record(model_id: str | None, config_path: str | None, configs_path=DEFAULT_CONFIGS) -> dict:
    """The record of one model for `measure`: configs.json first, else the registry or the Hub."""
    from pipeline.configs import config_from_file, resolve_model

    if model_id and Path(configs_path).exists():
        records, missing = load_model_records(configs_path, [model_id])
        if not missing:
            return records[model_id]
    try:
        resolved = config_from_file(config_path) if config_path else resolve_model(model_id)
    except ModuleNotFoundError as exc:  # the GPU machine has no jsonschema to read the registry with
        raise UserError(f"{model_id}: not in {configs_path}, and the registry cannot be read here "
                        f"({exc.name} is not installed)") from None
    record = {"model_id": resolved.model_id, "family": None, "model_type": resolved.config.model_type,
              "config": resolved.config.to_dict(), "config_source": resolved.source,
              "config_revision": resolved.revision}
    record.update(model_facts(resolved.model_id, resolved.config))
    return record


def step_flops(parameters: int, batch: int, seq: int) -> float:
    """The compute budget's measure of a step: 6 * N * B * L."""
    return 6.0 * parameters * batch * seq


def _points(group: dict, record: dict) -> list[Point]:
    if group["points"]:
        pairs = sorted(group["points"], key=lambda p: (p[1], p[0]))
    else:
        pairs = [(batch, seq) for seq in group["grid"]["seq_lens"] for batch in group["grid"]["batch_sizes"]]
    points = []
    for batch, seq in pairs:
        reason = None
        if record["context"] is not None and seq > record["context"]:
            reason = f"seq_len {seq} beyond the context length {record['context']}"
        elif step_flops(record["plan_parameters"], batch, seq) > group["max_step_flops"]:
            reason = (f"over compute budget: 6*N*B*L = {step_flops(record['plan_parameters'], batch, seq):.3g} FLOPs"
                      f" > max_step_flops {group['max_step_flops']:.3g}")
        points.append(Point(group["setting"], batch, seq, reason))
    return points


def plan_jobs(plan: dict, records: dict) -> list[Job]:
    """The jobs of a plan in running order: one pass per precision (the plan's `precisions` order),
    smallest model first within a pass. A job runs its standard setting first and gradient
    checkpointing last (switched on once), each L in increasing B. A point that two groups plan
    is run if either group runs it."""
    jobs: dict[tuple, Job] = {}
    for group in plan["groups"]:
        for model_id in group["models"]:
            if model_id not in records:
                continue
            for precision in group["precisions"]:
                job = jobs.setdefault((model_id, precision, group["attn"]),
                                      Job(records[model_id], precision, group["attn"]))
                _merge_points(job, _points(group, records[model_id]))
    for job in jobs.values():
        rank = {}
        for point in job.points:
            rank.setdefault(point.setting, (point.setting.gradient_checkpointing, len(rank)))
        job.points.sort(key=lambda p: (rank[p.setting], p.seq_len, p.batch_size))
    passes = list(dict.fromkeys(p for group in plan["groups"] for p in group["precisions"]))
    return sorted(jobs.values(), key=lambda j: (passes.index(j.precision), j.record["plan_parameters"], j.model_id,
                                                j.attn != "default"))


def _merge_points(job: Job, points: list[Point]) -> None:
    index = {job.key(p): i for i, p in enumerate(job.points)}
    for point in points:
        i = index.get(job.key(point))
        if i is None:
            index[job.key(point)] = len(job.points)
            job.points.append(point)
        elif job.points[i].skip_reason and not point.skip_reason:
            job.points[i] = point


def plan_models(plan: dict) -> list[str]:
    return list(dict.fromkeys(m for group in plan["groups"] for m in group["models"]))


# --- parts: one JSONL file per job -----------------------------------------------------------------

def part_path(parts_dir, job: Job) -> Path:
    return Path(parts_dir) / f"{job.name}.jsonl"


def append_row(path, row: dict) -> None:
    """Append one JSON line, flushed and fsynced; first ends a line torn by a killed writer."""
    path = Path(path)
    with open(path, "ab") as handle:
        if handle.tell() > 0:
            with open(path, "rb") as reader:
                reader.seek(-1, os.SEEK_END)
                if reader.read(1) != b"\n":
                    handle.write(b"\n")
        handle.write((json.dumps(row, default=str) + "\n").encode())
        handle.flush()
        os.fsync(handle.fileno())


def read_rows(path) -> list[dict]:
    """The rows of a part file; a torn last line (killed writer) is ignored."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def row_key(row: dict) -> tuple:
    return tuple(row.get(column) for column in KEY_COLUMNS)


def pending_points(job: Job, rows: list[dict], retry_errors: bool = False) -> list[Point]:
    """The job's points without a row yet. A measured row (ok, oom; error unless retrying) settles
    a point; a skipped row settles only a point that the plan still skips."""
    measured = {row_key(r) for r in rows if r.get("status") in ("ok", "oom")
                or (r.get("status") == "error" and not retry_errors)}
    seen = {row_key(r) for r in rows}
    return [p for p in job.points if job.key(p) not in measured and not (p.skip_reason and job.key(p) in seen)]


def oom_points(rows: list[dict]) -> dict:
    """(B, L) of out-of-memory rows, by setting."""
    ooms: dict[Setting, list] = {}
    for row in rows:
        if row.get("status") == "oom":
            setting = Setting(row["variant"], row["optimizer"], row["gradient_checkpointing"])
            ooms.setdefault(setting, []).append((row["batch_size"], row["seq_len"]))
    return ooms


def prune_reason(ooms: list, batch: int, seq: int) -> str | None:
    """A point needs at least the memory of any smaller point: after an oom at (B', L'), every
    (B >= B', L >= L') is recorded oom without running."""
    smaller = sorted((b, s) for b, s in ooms if b <= batch and s <= seq)
    return f"pruned after oom at B={smaller[0][0]}, L={smaller[0][1]}" if smaller else None


def event(parts_dir, name: str, **fields) -> None:
    append_row(Path(parts_dir) / EVENTS_FILE, {"event": name, "time": time.time(), **fields})


# --- the child: one job ----------------------------------------------------------------------------

def point_row(job: Job, point: Point, base: dict, **columns) -> dict:
    from pipeline.memory import base_columns, finish_row

    row = base_columns(job.record, job.precision, job.attn, point.setting, point.batch_size, point.seq_len)
    row.update({k: v for k, v in base.items() if v is not None})
    row["step_flops"] = step_flops(job.record["plan_parameters"], point.batch_size, point.seq_len)
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


def write_current(part, text: str) -> None:
    Path(str(part) + ".current").write_text(text)


def run_job(job: Job, parts_dir, device: str = "cuda", deadline: float | None = None, allow_tf32: bool = True,
            retry_errors: bool = False, estimate: dict | None = None, gpu: str | None = None) -> None:
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
        Path(str(part) + ".done").touch()
        return
    write_current(part, "setup")
    try:
        from pipeline.memory import setup_device

        base = setup_device(device, allow_tf32)
    except Exception as exc:  # noqa: BLE001 - systemic: the parent stops the sweep
        from pipeline.memory import first_line

        write_current(part, f"device setup failed: {first_line(exc)}")
        sys.exit(EXIT_SETUP_FAILED)
    try:
        _measure_points(job, part, todo, base, device, deadline, estimate or DEFAULT_ESTIMATE, retry_errors)
    except Exception as exc:  # noqa: BLE001 - whatever failed, the remaining points get rows
        from pipeline.memory import first_line

        fill_remaining(job, part, base, f"not measured: the process failed: {first_line(exc)}",
                       retry_errors=retry_errors)
    Path(str(part) + ".done").touch()


def _measure_points(job, part, todo, base, device, deadline, estimate, retry_errors) -> None:
    import gc

    from pipeline.memory import first_line, measure_point, weights_bytes
    from pipeline.modeling import attn_used, build, count_parameters

    ooms = oom_points(read_rows(part))
    model, built = None, {}
    for point in todo:
        row = settle_without_running(job, point, ooms, base)
        if row is not None:
            append_row(part, row)
            continue
        needed = 2 * point_seconds(job.record, point, job.precision, estimate) + 2
        if model is None:
            needed += build_seconds(job.record, estimate)
        if deadline is not None and time.time() + needed > deadline:
            sys.exit(EXIT_DEADLINE)
        if model is None:
            write_current(part, "building the model")
            start = time.perf_counter()
            try:
                model = build(_config(job), job.precision, job.attn, device)
            except Exception as exc:  # noqa: BLE001 - a model that cannot be built: error rows
                fill_remaining(job, part, base, f"model build failed: {first_line(exc)}", retry_errors=retry_errors)
                return
            built = {"build_seconds": time.perf_counter() - start, "weights_bytes": weights_bytes(model, device),
                     "parameters": count_parameters(model),
                     "attn_implementation_used": attn_used(model)}
            gc.freeze()  # later collections skip the model and the imported modules
        write_current(part, json.dumps({"batch_size": point.batch_size, "seq_len": point.seq_len}))
        columns = measure_point(model, point.setting, job.precision, point.batch_size, point.seq_len, device,
                                job.record.get("use_cache", True))
        append_row(part, point_row(job, point, base, **built, **columns))
        if columns["status"] == "oom":
            ooms.setdefault(point.setting, []).append((point.batch_size, point.seq_len))
        if columns["status"] == "error" and not device_healthy(device):
            fill_remaining(job, part, base, f"not measured: the CUDA context is unusable after an error at "
                           f"B={point.batch_size}, L={point.seq_len}", retry_errors=retry_errors)
            return


def _config(job: Job):
    from pipeline.configs import config_from_dict

    return config_from_dict(job.record["config"], job.model_id)


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


# --- the parent: schedule children -----------------------------------------------------------------

def prepare_fork_parent(jobs: list[Job]) -> None:
    """Pay the imports once, before forking, and make sure CUDA is not initialised here."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from pipeline.provenance import git_commit

    git_commit()  # cached for the children
    for job in jobs:
        try:
            MODEL_FOR_CAUSAL_LM_MAPPING[type(_config(job))]  # imports the modeling module
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


def _current_point(part) -> str:
    try:
        return Path(str(part) + ".current").read_text()
    except FileNotFoundError:
        return ""


def _last_progress(part, started: float) -> float:
    times = [started]
    for path in (Path(part), Path(str(part) + ".current")):
        try:
            times.append(path.stat().st_mtime)
        except FileNotFoundError:
            pass
    return max(times)


def _gpu_slots(gpus: int) -> list[str | None]:
    if gpus <= 1:
        return [None]
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return (visible or [str(i) for i in range(gpus)])[:gpus]


PROGRESS_SECONDS = 60.0


def run_sweep(jobs: list[Job], parts_dir, device: str = "cuda", time_limit: float | None = None,
              child_timeout: float = 240, gpus: int = 1, start_method: str = "fork", allow_tf32: bool = True,
              retry_errors: bool = False, estimate: dict | None = None, target=None, log=print) -> dict:
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
    outcomes = {"finished": 0, "error": 0, "stopped": 0, "not started": 0}
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
                    if outcome == "error" and process.exitcode == EXIT_SETUP_FAILED:
                        halted = f"{job.name}: {_current_point(part_path(parts_dir, job))}"
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
        if now - _last_progress(part, launched) <= child_timeout:
            return None
        process.kill()
        process.join()
        cause = f"no progress for {child_timeout:.0f} s (killed)"
    elif process.exitcode == 0:
        return "finished"
    elif process.exitcode == EXIT_DEADLINE:
        return "stopped"
    elif process.exitcode == EXIT_SETUP_FAILED:
        return "error"
    elif process.exitcode in (-signal.SIGTERM, -signal.SIGINT):
        return "stopped"  # asked to stop from outside: its remaining points stay pending
    else:
        cause = _signal_text(process.exitcode)
    base = _device_columns(read_rows(part))
    current = _current_point(part)
    first = f"the child process died during this point ({cause})" if current.startswith("{") else None
    fill_remaining(job, part, base, f"not measured: the child process died ({cause})", first, retry_errors)
    Path(str(part) + ".done").touch()
    return "error"


def _device_columns(rows: list[dict]) -> dict:
    """Provenance for rows written by the parent (which never touches CUDA): the child's, if any."""
    from pipeline.provenance import provenance

    base = provenance(include_device=False)
    keep = ("device", "driver_version", "gpu_total_bytes", "measure_device", "allow_tf32", "cuda_version")
    for row in rows[-1:]:
        base.update({k: row.get(k) for k in keep})
    return base


# --- estimate of the GPU time ----------------------------------------------------------------------

def point_seconds(record: dict, point: Point, precision: str, estimate: dict) -> float:
    """Estimated seconds of one measured point: three steps (compute- or launch-bound) + overhead."""
    tokens = point.batch_size * point.seq_len
    flops = step_flops(record["plan_parameters"], point.batch_size, point.seq_len)
    flops += 12.0 * record["layers"] * record["hidden"] * point.seq_len * tokens  # attention scores
    if point.setting.gradient_checkpointing:
        flops *= 4 / 3  # the forward runs twice
    compute = flops / estimate["flops_per_second"][precision]
    floor = estimate["step_floor_seconds"] + estimate["layer_step_seconds"] * record["layers"]
    return STEPS * max(compute, floor) + estimate["point_overhead_seconds"]


def build_seconds(record: dict, estimate: dict) -> float:
    return estimate["build_seconds_per_billion"] * record["plan_parameters"] / 1e9


def predicted_peak_bytes(record: dict, point: Point, precision: str) -> float:
    """A rough peak (for the time estimate only: to foresee ooms and their pruning)."""
    n, tokens = record["plan_parameters"], point.batch_size * point.seq_len
    weight = 2 if precision == "bf16" else 4
    activation = 4 if precision == "fp32" else 2
    state = 1 if point.setting.optimizer == "sgd" else 2
    static = n * weight * (3 + state) + (2 * n if precision == "amp-bf16" else 0)
    per_layer = 2 * activation if point.setting.gradient_checkpointing else 34 * activation
    per_token = record["layers"] * record["hidden"] * per_layer + record["vocab"] * (activation + 8)
    return static + tokens * per_token


def job_estimate(job: Job, rows: list[dict], estimate: dict, gpu_memory_bytes: float,
                 retry_errors: bool = False) -> dict:
    """Seconds, points to measure and foreseen ooms of a job's pending points."""
    todo = pending_points(job, rows, retry_errors)
    ooms = oom_points(rows)
    seconds, measured, foreseen = 0.0, 0, 0
    for point in todo:
        if point.skip_reason or prune_reason(ooms.get(point.setting, []), point.batch_size, point.seq_len):
            continue
        measured += 1
        cost = point_seconds(job.record, point, job.precision, estimate)
        if predicted_peak_bytes(job.record, point, job.precision) > gpu_memory_bytes:
            foreseen += 1
            ooms.setdefault(point.setting, []).append((point.batch_size, point.seq_len))
            cost = estimate["point_overhead_seconds"] + (cost - estimate["point_overhead_seconds"]) / STEPS
        seconds += cost
    if measured:
        seconds += estimate["process_overhead_seconds"] + build_seconds(job.record, estimate)
    return {"seconds": seconds, "points": len(todo), "measured": measured, "foreseen_oom": foreseen}


def plan_report(jobs: list[Job], parts_dir, plan: dict, retry_errors: bool = False) -> tuple[list[str], float]:
    """Lines of the dry run: per model, the estimated seconds of each precision's pending work;
    then per precision pass (the running order) and in total, with cumulative minutes."""
    passes = list(dict.fromkeys(job.precision for job in jobs))
    models: dict[str, dict] = {}
    summary = {p: {"jobs": 0, "points": 0, "measured": 0, "skipped": 0, "foreseen_oom": 0, "seconds": 0.0}
               for p in passes}
    for job in jobs:
        rows = read_rows(part_path(parts_dir, job))
        result = job_estimate(job, rows, plan["estimate"], plan["gpu_memory_bytes"], retry_errors)
        line = models.setdefault(job.model_id, {"parameters": job.record["plan_parameters"], "points": 0})
        line[job.precision] = line.get(job.precision, 0.0) + result["seconds"]
        line["points"] += result["measured"]
        total = summary[job.precision]
        total["jobs"] += bool(result["points"])
        total["skipped"] += sum(1 for p in pending_points(job, rows, retry_errors) if p.skip_reason)
        for key in ("points", "measured", "foreseen_oom", "seconds"):
            total[key] += result[key]
    lines = [f"{'model':42} {'params':>8} {'to run':>6} " + " ".join(f"{p + ' s':>10}" for p in passes)]
    for model_id, line in sorted(models.items(), key=lambda item: item[1]["parameters"]):
        lines.append(f"{model_id:42} {line['parameters'] / 1e9:7.3f}B {line['points']:6d} "
                     + " ".join(f"{line.get(p, 0.0):10.1f}" for p in passes))
    cumulative = 0.0
    for precision, total in summary.items():
        cumulative += total["seconds"]
        lines.append(f"pass {precision}: {total['jobs']} processes, {total['points']} pending points "
                     f"({total['measured']} to run, {total['skipped']} skipped by context or budget, the rest "
                     f"pruned; ~{total['foreseen_oom']} foreseen ooms): {total['seconds'] / 60:.1f} min, "
                     f"cumulative {cumulative / 60:.1f} min")
    lines.append(f"estimated GPU time of the pending plan: {cumulative / 60:.1f} min "
                 f"(processes run one at a time per GPU, in pass order, smallest model first)")
    return lines, cumulative


# --- aggregate -------------------------------------------------------------------------------------

def aggregate(parts_dir, out=DEFAULT_OUT):
    """Merge the parts into one table: one row per key (a measured row wins over a skipped one,
    then the latest), typed columns, atomic write. Returns the frame (None when there are no parts)."""
    import pandas as pd

    from pipeline.io import write_parquet
    from pipeline.memory import COLUMN_DTYPES

    rows = [row for path in sorted(Path(parts_dir).glob("*__*.jsonl")) for row in read_rows(path)]
    if not rows:
        return None
    frame = pd.DataFrame([{c: row.get(c) for c in COLUMNS} for row in rows], columns=list(COLUMNS))
    frame["_measured"] = frame["status"] != "skipped"
    frame = frame.sort_values(["_measured", "finished_at"], kind="stable")
    frame = frame.drop_duplicates(list(KEY_COLUMNS), keep="last").drop(columns="_measured")
    frame = frame.astype(COLUMN_DTYPES)
    frame = frame.sort_values(["parameters", "model_id", "precision", "variant", "optimizer",
                               "gradient_checkpointing", "attn_implementation", "seq_len", "batch_size"],
                              kind="stable").reset_index(drop=True)
    write_parquet(frame, out)
    return frame


# --- command line ----------------------------------------------------------------------------------

def add_cli(subparsers) -> None:
    from pipeline.arguments import positive_int

    parser = subparsers.add_parser("sweep", help="peak-memory sweep on the GPU (a CPU machine reuses the table)")
    parser.add_argument("--plan", default=DEFAULT_PLAN)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="output of `pipeline configs`")
    parser.add_argument("--parts", default=DEFAULT_PARTS, help="folder of per-process row files (resumable)")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its estimated GPU time")
    parser.add_argument("--aggregate", action="store_true", help="only merge the parts into --out")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cpu: a real but peak-less debug run")
    parser.add_argument("--time-limit", type=positive_int, metavar="SECONDS",
                        help="stop starting work this long after this process started; rerun to continue")
    parser.add_argument("--gpus", type=positive_int, default=1, help="children at once, one GPU each")
    parser.add_argument("--start-method", choices=("fork", "spawn"), default="fork")
    parser.add_argument("--child-timeout", type=positive_int, metavar="SECONDS",
                        help="kill a child that writes no row for this long (default: the plan's)")
    parser.add_argument("--retry-errors", action="store_true", help="measure points with error rows again")
    parser.add_argument("--models", nargs="+", metavar="ID")
    parser.add_argument("--precisions", nargs="+", metavar="P")
    parser.add_argument("--batch-sizes", nargs="+", type=positive_int, metavar="B")
    parser.add_argument("--seq-lens", nargs="+", type=positive_int, metavar="L")
    parser.add_argument("--max-step-flops", type=float, metavar="FLOPS")
    parser.add_argument("--standard-only", action="store_true", help="leave out the plan's variants")
    parser.set_defaults(handler=_sweep_command)


def _sweep_command(args) -> int:
    from pipeline.memory import resolve_device

    if args.aggregate:
        return _aggregate_command(args)
    device = None if args.dry_run else resolve_device(args.device)
    if not args.dry_run and device is None:
        return _reuse_message(args.out)
    plan = override_plan(load_plan(args.plan), args.models, args.precisions, args.batch_sizes, args.seq_lens,
                         args.max_step_flops, args.standard_only)
    records, missing = load_model_records(args.configs, plan_models(plan))
    for model_id in missing:
        print(f"sweep: warning: {model_id} has no usable config in {args.configs}; left out")
    jobs = plan_jobs(plan, records)
    if args.dry_run:
        lines, _ = plan_report(jobs, args.parts, plan, args.retry_errors)
        print("\n".join(lines))
        return 0
    outcomes = run_sweep(jobs, args.parts, device, args.time_limit, args.child_timeout or plan["child_timeout_seconds"],
                         args.gpus, args.start_method, plan["allow_tf32"], args.retry_errors, plan["estimate"])
    frame = aggregate(args.parts, args.out)
    event(args.parts, "aggregated", rows=0 if frame is None else len(frame))
    left = outcomes["not started"] + outcomes["stopped"]
    print(f"sweep: {outcomes['finished']} processes finished, {outcomes['error']} failed, "
          f"{outcomes['stopped']} stopped at the time limit; {0 if frame is None else len(frame)} rows -> {args.out}"
          + (f"; {left} processes left: rerun the same command to continue" if left else "; plan complete"))
    return 0


def _aggregate_command(args) -> int:
    frame = aggregate(args.parts, args.out)
    if frame is None:
        print(f"sweep: no part files in {args.parts}; nothing aggregated")
    else:
        counts = frame["status"].value_counts().to_dict()
        print(f"sweep: {len(frame)} rows ({', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))}) -> {args.out}")
    return 0


def _reuse_message(out) -> int:
    path = Path(out)
    if path.exists():
        import pyarrow.parquet as pq

        print(f"sweep: no CUDA device here; reusing the committed {path} ({pq.read_metadata(path).num_rows} rows)")
    else:
        print(f"sweep: no CUDA device here and no {path}: peak memory is measured on a GPU machine "
              f"(python -m pipeline sweep); later stages go on without it")
    return 0
