"""The sweep's jobs: one child process per (model, precision, attention, client, with or without
adapters), its points in running order.

Points beyond the context length or over the compute budget (6*N*B*L*K FLOPs per optimizer step,
K micro-batches) are planned with a skip reason. Jobs run one pass per precision, smallest model
first within a pass. Each client has its own processes: the Trainer leaves process-wide state
(accelerate's) that the loop's rows must not meet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.inputs.records import ModelRecord
from pipeline.training.step import Setting
from pipeline.measure.sweep.plan import Group, Plan
from pipeline.core.vocabulary import CLIENTS


@dataclass(frozen=True)
class Point:
    """One grid point of a job's setting; `skip_reason` when it is planned but not run."""

    setting: Setting
    batch_size: int
    seq_len: int
    skip_reason: str | None = None


@dataclass
class Job:
    """One child process: one model in one precision with one attention implementation and client."""

    record: ModelRecord
    precision: str
    attn: str
    points: list[Point] = field(default_factory=list)
    client: str = "loop"
    adapters: bool = False  # LoRA / QLoRA points: a process of their own, a model built per point

    @property
    def model_id(self) -> str:
        return self.record.model_id

    @property
    def name(self) -> str:
        from pipeline.inputs.registry import safe_name

        name = f"{safe_name(self.model_id)}__{self.precision}__{self.attn}"
        name = name if self.client == "loop" else f"{name}__{self.client}"  # the loop's names predate clients
        return f"{name}__adapters" if self.adapters else name

    def key(self, point: Point) -> tuple:
        """The point's key in the peak table (vocabulary.POINT_KEY's columns, in that order)."""
        s = point.setting
        adapter = s.adapter_columns()
        return (self.model_id, self.precision, s.variant, s.optimizer, s.gradient_checkpointing, self.attn,
                point.batch_size, point.seq_len, s.client, s.optim, s.gradient_accumulation, adapter["lora_r"],
                adapter["lora_targets"], adapter["quantization"], s.liger_kernel, s.completion_share,
                adapter["lora_dropout"])


def step_flops(parameters: int, batch: int, seq: int, accumulation: int = 1) -> float:
    """The compute budget's measure of an optimizer step: 6 * N * B * L * K."""
    return 6.0 * parameters * batch * seq * accumulation


def group_points(group: Group, record: ModelRecord) -> list[Point]:
    if group.points:
        pairs = sorted(group.points, key=lambda p: (p[1], p[0]))
    else:
        pairs = [(batch, seq) for seq in group.grid.seq_lens for batch in group.grid.batch_sizes]
    points = []
    for batch, seq in pairs:
        reason = None
        flops = step_flops(record.plan_parameters, batch, seq, group.setting.gradient_accumulation)
        if record.context is not None and seq > record.context:
            reason = f"seq_len {seq} beyond the context length {record.context}"
        elif flops > group.max_step_flops:
            product = "6*N*B*L" if group.setting.gradient_accumulation == 1 else "6*N*B*L*K"
            reason = f"over compute budget: {product} = {flops:.3g} FLOPs > max_step_flops {group.max_step_flops:.3g}"
        points.append(Point(group.setting, batch, seq, reason))
    return points


def plan_jobs(plan: Plan, records: dict[str, ModelRecord]) -> list[Job]:
    """The jobs of a plan in running order: one pass per precision (the plan's `precisions` order),
    smallest model first within a pass (the loop's process before the trainer's). A job runs its
    standard setting first and gradient checkpointing last (switched on once), each L in
    increasing B. A point that two groups plan is run if either group runs it."""
    jobs: dict[tuple, Job] = {}
    for group in plan.groups:
        client = group.setting.client
        for model_id in group.models:
            if model_id not in records:
                continue
            for precision in group.precisions:
                adapters = group.setting.adapter is not None
                job = jobs.setdefault((model_id, precision, group.attn, client, adapters),
                                      Job(records[model_id], precision, group.attn, client=client, adapters=adapters))
                _merge_points(job, group_points(group, records[model_id]))
    for job in jobs.values():
        rank = {}
        for point in job.points:
            rank.setdefault(point.setting, (point.setting.gradient_checkpointing, len(rank)))
        job.points.sort(key=lambda p: (rank[p.setting], p.seq_len, p.batch_size))
    passes = list(dict.fromkeys(p for group in plan.groups for p in group.precisions))
    return sorted(jobs.values(), key=lambda j: (passes.index(j.precision), j.record.plan_parameters, j.model_id,
                                                j.attn != "default", CLIENTS.index(j.client), j.adapters))


def _merge_points(job: Job, points: list[Point]) -> None:
    index = {job.key(p): i for i, p in enumerate(job.points)}
    for point in points:
        i = index.get(job.key(point))
        if i is None:
            index[job.key(point)] = len(job.points)
            job.points.append(point)
        elif job.points[i].skip_reason and not point.skip_reason:
            job.points[i] = point
