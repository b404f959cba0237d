"""The GPU time a sweep will take: per point, per job and for the dry run's report."""

from __future__ import annotations

from pathlib import Path

from pipeline.core.vocabulary import TRAINER_CLIENTS, TRL_CLIENTS, precision_mode
from pipeline.measure.clients import ONE_POINT_PER_PROCESS
from pipeline.inputs.records import ModelRecord
from pipeline.training.step import STEPS
from pipeline.measure.sweep.jobs import Job, Point, step_flops
from pipeline.measure.sweep.parts import oom_points, part_path, pending_points, prune_reason, read_rows
from pipeline.measure.sweep.plan import TimeModel, Plan


def point_seconds(record: ModelRecord, point: Point, precision: str, estimate: TimeModel) -> float:
    """Estimated seconds of one measured point: three optimizer steps of K micro-batches (compute-
    or launch-bound) + overhead (the trainer's own on top; a client that measures one point per
    process pays the process and the model's build for each)."""
    setting = point.setting
    tokens = point.batch_size * point.seq_len * setting.gradient_accumulation
    flops = step_flops(record.plan_parameters, point.batch_size, point.seq_len, setting.gradient_accumulation)
    flops += 12.0 * record.layers * record.hidden * point.seq_len * tokens  # attention scores
    if setting.adapter is not None:
        flops *= 2 / 3  # no weight gradients: forward 2N, backward 2N (the input gradients) per token
    if setting.gradient_checkpointing:
        flops *= 4 / 3  # the forward runs twice
    compute = flops / estimate.flops_per_second[precision]
    floor = (estimate.step_floor_seconds + estimate.layer_step_seconds * record.layers) * setting.gradient_accumulation
    overhead = estimate.point_overhead_seconds
    if setting.client in TRAINER_CLIENTS:
        overhead += estimate.trainer_point_overhead_seconds
    if setting.client in ONE_POINT_PER_PROCESS:
        overhead += estimate.process_overhead_seconds + build_seconds(record, estimate)
    return STEPS * max(compute, floor) + overhead


def build_seconds(record: ModelRecord, estimate: TimeModel, setting=None) -> float:
    """Building the model (an adapter point builds its own; a quantized base is loaded from disk)."""
    billions = record.plan_parameters / 1e9
    if setting is not None and setting.adapter is not None and setting.adapter.quantization:
        return estimate.quantized_load_seconds_per_billion * billions
    return estimate.build_seconds_per_billion * billions


# Optimizer state in bytes per weight byte (rough, for the time estimate): moments, momentum, none.
STATE_PER_WEIGHT_BYTE = {"adamw_torch_fused": 2, "adamw_torch": 2, "adafactor": 0.05, "sgd": 0,
                         "adamw_bnb_8bit": 0.5}


def predicted_peak_bytes(record: ModelRecord, point: Point, precision: str) -> float:
    """A rough peak (for the time estimate only: to foresee ooms and their pruning)."""
    n, tokens = record.plan_parameters, point.batch_size * point.seq_len
    mode = precision_mode(precision)
    weight, activation, copies = mode.weight_bytes, mode.activation_bytes, 2 * n if mode.weight_copies else 0
    setting = point.setting
    if setting.client == "loop":
        state = 1 if setting.optimizer == "sgd" else 2
    else:
        state = STATE_PER_WEIGHT_BYTE[setting.optim]
    static = n * weight * (3 + state) + copies
    if setting.adapter is not None:  # a frozen base (4-bit: half a byte, the rest upcast to fp32) and its casts
        quantized = setting.adapter.quantization
        embeddings = 2 * record.vocab * record.hidden * 4
        static = (0.5 * n + embeddings if quantized else n * weight) + copies
    if setting.client == "dpo" and setting.adapter is None:
        static += n * weight  # DPOTrainer's reference model: a second copy of the weights
    per_layer = 2 * activation if point.setting.gradient_checkpointing else 34 * activation
    # the loss's logits and their fp32 gradients; TRL's fused head scores tiles of 4096 positions instead
    fused = setting.client in TRL_CLIENTS
    head = 0 if fused else record.vocab * (activation + 8)
    per_token = record.layers * record.hidden * per_layer + head
    sequences = 2 if setting.client == "dpo" else 1  # a preference pair is two sequences
    return static + sequences * tokens * per_token + (4096 * 32768 * 12 if fused else 0)


def job_estimate(job: Job, rows: list[dict], estimate: TimeModel, gpu_memory_bytes: float,
                 retry_errors: bool = False) -> dict:
    """Seconds, points to measure and foreseen ooms of a job's pending points."""
    todo = pending_points(job, rows, retry_errors)
    ooms = oom_points(rows)
    seconds, measured, foreseen, saved = 0.0, 0, 0, False
    for point in todo:
        if point.skip_reason or prune_reason(ooms.get(point.setting, []), point.batch_size, point.seq_len):
            continue
        measured += 1
        cost = point_seconds(job.record, point, job.precision, estimate)
        if job.adapters:  # each adapter point builds its model; a quantized base is saved once
            cost += build_seconds(job.record, estimate, point.setting)
            if point.setting.adapter.quantization and not saved:
                saved = True
                cost += estimate.base_save_seconds_per_billion * job.record.plan_parameters / 1e9
        if predicted_peak_bytes(job.record, point, job.precision) > gpu_memory_bytes:
            foreseen += 1
            ooms.setdefault(point.setting, []).append((point.batch_size, point.seq_len))
            cost = estimate.point_overhead_seconds + (cost - estimate.point_overhead_seconds) / STEPS
        seconds += cost
    if measured:
        seconds += estimate.process_overhead_seconds + (0 if job.adapters else build_seconds(job.record, estimate))
    return {"seconds": seconds, "points": len(todo), "measured": measured, "foreseen_oom": foreseen}


def plan_report(jobs: list[Job], parts_dir: str | Path, plan: Plan,
                retry_errors: bool = False) -> tuple[list[str], float]:
    """Lines of the dry run: per model, the estimated seconds of each precision's pending work;
    then per precision pass (the running order) and in total, with cumulative minutes."""
    passes = list(dict.fromkeys(job.precision for job in jobs))
    models: dict[str, dict] = {}
    summary = {p: {"jobs": 0, "points": 0, "measured": 0, "skipped": 0, "foreseen_oom": 0, "seconds": 0.0}
               for p in passes}
    for job in jobs:
        rows = read_rows(part_path(parts_dir, job))
        result = job_estimate(job, rows, plan.estimate, plan.gpu_memory_bytes, retry_errors)
        line = models.setdefault(job.model_id, {"parameters": job.record.plan_parameters, "points": 0})
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
