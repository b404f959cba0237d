"""The sweep plan (config/sweep.yaml): groups of (setting, models, precisions, grid), the GPU-time
estimate's settings, and the command line's narrowing of a plan.

Every value is a dataclass checked in `__post_init__`; a bad plan is a one-line UserError naming
the file and the key (`plan.yaml: variants[1]: optimizer 'adam8bit' is not one of adamw, sgd`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.training.step import Setting
from pipeline.core.vocabulary import ATTENTIONS, PRECISIONS, check_choice

GIB = 2**30
PLAN_KEYS = {"grid", "max_step_flops", "allow_tf32", "child_timeout_seconds", "gpu_memory_gib", "estimate",
             "models", "precisions", "variants"}
GROUP_KEYS = {"name", "models", "precisions", "client", "variant", "optimizer", "optim", "gradient_checkpointing",
              "gradient_accumulation", "attn_implementation", "grid", "points", "max_step_flops", "lora",
              "liger_kernel", "completion_share"}
LORA_KEYS = {"r", "alpha", "targets", "quantization", "dropout"}


@contextlib.contextmanager
def located(prefix: str):
    """UserErrors raised inside get `prefix` in front (where in the plan the value was)."""
    try:
        yield
    except UserError as exc:
        raise UserError(f"{prefix}{exc}") from None


def positive_ints(values, label: str) -> tuple[int, ...]:
    """Distinct positive integers, sorted."""
    if not isinstance(values, (list, tuple)) or not values:
        raise UserError(f"{label}: must be a non-empty list of positive integers")
    for value in values:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UserError(f"{label}: {value!r} is not a positive integer")
    return tuple(sorted(set(values)))


def number(value, label: str, minimum: float = 0) -> float:
    """A number above `minimum`; YAML reads 2.0e13 (no sign in the exponent) as text, so text is parsed."""
    try:
        result = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
    except ValueError:
        result = None
    if result is None or not result > minimum:
        raise UserError(f"{label}: {value!r} must be a number above {minimum}")
    return result


def precision_list(value, label: str, empty_ok: bool = False) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not (value or empty_ok):
        raise UserError(f"{label}: must be a non-empty list")
    with located(f"{label}: "):
        for precision in value:
            check_choice("precision", precision, PRECISIONS)
    return tuple(dict.fromkeys(value))


def _no_unknown(data, allowed, label: str) -> None:
    if not isinstance(data, dict):
        raise UserError(f"{label}: not a mapping")
    unknown = set(data) - set(allowed)
    if unknown:
        raise UserError(f"{label}: unknown key {sorted(unknown)[0]!r}")


@dataclass(frozen=True)
class Grid:
    """Batch sizes times sequence lengths."""

    batch_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "batch_sizes", positive_ints(self.batch_sizes, "batch_sizes"))
        object.__setattr__(self, "seq_lens", positive_ints(self.seq_lens, "seq_lens"))

    @classmethod
    def from_yaml(cls, data, label: str) -> Grid:
        if not isinstance(data, dict) or set(data) != {"batch_sizes", "seq_lens"}:
            raise UserError(f"{label}: needs exactly batch_sizes and seq_lens")
        with located(f"{label}."):
            return cls(data["batch_sizes"], data["seq_lens"])


DEFAULT_FLOPS_PER_SECOND = {"fp32": 1.0e14, "bf16": 2.0e14, "amp-bf16": 1.5e14, "amp-fp16": 1.5e14,
                            "bf16-autocast": 1.8e14, "mp-bf16": 1.8e14}


@dataclass(frozen=True)
class TimeModel:
    """Settings of the GPU-time estimate. The defaults are conservative guesses for one H200 (fp32
    with TF32 matmuls); calibrate them with benchmarks/sweep_efficiency.py on a smoke run."""

    flops_per_second: dict = field(default_factory=lambda: dict(DEFAULT_FLOPS_PER_SECOND))
    step_floor_seconds: float = 0.01  # a step of a tiny model (launch-bound)
    layer_step_seconds: float = 0.0015  # launch-bound cost per layer per step (forward + backward + optimizer)
    point_overhead_seconds: float = 0.08  # empty_cache, allocation, synchronisation, row write
    # the Trainer clients' extra per point: TrainingArguments, Trainer, accelerate's prepare, the
    # data loader, the collection of the Trainer's reference cycles (SFTTrainer: its dataset preparation too)
    trainer_point_overhead_seconds: float = 1.0
    process_overhead_seconds: float = 2.0  # fork, CUDA context, first kernels
    build_seconds_per_billion: float = 0.5  # building random weights on the GPU
    # QLoRA: saving a random init once per model (bf16 safetensors), loading it quantized per point
    base_save_seconds_per_billion: float = 3.0
    quantized_load_seconds_per_billion: float = 1.5

    def __post_init__(self):
        rates = self.flops_per_second
        if not isinstance(rates, dict) or not set(rates) <= set(PRECISIONS):
            raise UserError(f"flops_per_second: needs a rate per precision ({', '.join(PRECISIONS)}; "
                            f"one left out takes its default)")
        rates = {**DEFAULT_FLOPS_PER_SECOND, **rates}
        object.__setattr__(self, "flops_per_second",
                           {p: number(rates[p], f"flops_per_second.{p}") for p in PRECISIONS})
        for item in fields(self)[1:]:
            object.__setattr__(self, item.name, number(getattr(self, item.name), item.name, minimum=-1e-12))

    @classmethod
    def from_yaml(cls, data, label: str) -> TimeModel:
        _no_unknown(data, {item.name for item in fields(cls)}, label)
        with located(f"{label}."):
            return cls(**data)


DEFAULT_TIME_MODEL = TimeModel()


@dataclass(frozen=True)
class Group:
    """Models measured in some precisions with one setting and attention, over a grid or given
    (batch_size, seq_len) points, under a compute budget (6*N*B*L FLOPs per step)."""

    name: str
    models: tuple[str, ...]
    precisions: tuple[str, ...]
    setting: Setting
    attn: str
    grid: Grid
    points: tuple[tuple[int, int], ...] | None
    max_step_flops: float
    own_budget: bool = False  # set by the group itself, so a command-line budget leaves it

    def __post_init__(self):
        if not isinstance(self.models, (list, tuple)) or not all(isinstance(m, str) for m in self.models):
            raise UserError("models: must be a list of model ids")
        object.__setattr__(self, "models", tuple(dict.fromkeys(self.models)))
        # empty only where the command line narrowed it (the plan's lists are non-empty)
        object.__setattr__(self, "precisions", precision_list(self.precisions, "precisions", empty_ok=True))
        self.setting.check()
        check_choice("attn_implementation", self.attn, ATTENTIONS)
        if self.points is not None:
            object.__setattr__(self, "points", _pairs(self.points))
        object.__setattr__(self, "max_step_flops", number(self.max_step_flops, "max_step_flops"))


def _pairs(points) -> tuple[tuple[int, int], ...]:
    if not isinstance(points, (list, tuple)) or not points or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in points):
        raise UserError("points must be a list of [batch_size, seq_len] pairs")
    for pair in points:
        positive_ints(list(pair), "points")
    return tuple(tuple(pair) for pair in points)


def _adapter(data):
    """A group's `lora: {r: 16, targets: all-linear, quantization: nf4, dropout: 0.05}` (alpha defaults to 2r;
    a quantization makes it QLoRA; dropout defaults to 0)."""
    from pipeline.training.adapters import ALL_LINEAR, AdapterSpec

    _no_unknown(data, LORA_KEYS, "lora")
    if "r" not in data:
        raise UserError("lora: needs r (the rank)")
    return AdapterSpec.make(data["r"], data.get("alpha"), data.get("targets", ALL_LINEAR), data.get("quantization"),
                            data.get("dropout"))


def _group(item, label: str, grid: Grid, plan_precisions, budget: float) -> Group:
    _no_unknown(item, GROUP_KEYS, label)
    own_grid = Grid.from_yaml(item["grid"], f"{label}: grid") if "grid" in item else grid
    with located(f"{label}: "):
        return Group(item.get("name", f"variant {label}"), item.get("models", []),
                     precision_list(item.get("precisions", plan_precisions), "precisions"),
                     Setting(item.get("variant", "standard"), item.get("optimizer"),
                             item.get("gradient_checkpointing", False), item.get("client", "loop"),
                             item.get("optim"), item.get("gradient_accumulation", 1),
                             _adapter(item["lora"]) if "lora" in item else None, item.get("liger_kernel", False),
                             item.get("completion_share", 1.0)),
                     item.get("attn_implementation", "default"), own_grid, item.get("points"),
                     item.get("max_step_flops", budget), "max_step_flops" in item)


@dataclass(frozen=True)
class Plan:
    """The groups (the plan's standard one first, then its variants) and how the sweep runs."""

    groups: tuple[Group, ...]
    estimate: TimeModel = DEFAULT_TIME_MODEL
    allow_tf32: bool = True
    child_timeout_seconds: float = 240.0
    gpu_memory_bytes: float = 139.0 * GIB

    def __post_init__(self):
        if not isinstance(self.allow_tf32, bool):
            raise UserError("allow_tf32 must be true or false")
        object.__setattr__(self, "child_timeout_seconds", number(self.child_timeout_seconds, "child_timeout_seconds"))

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(m for group in self.groups for m in group.models))


def parse_plan(data, name: str = "sweep plan") -> Plan:
    """Validate a sweep plan (see config/sweep.yaml)."""
    _no_unknown(data, PLAN_KEYS, name)
    grid = Grid.from_yaml(data.get("grid"), f"{name}: grid")
    with located(f"{name}: "):
        budget = number(data.get("max_step_flops", 1e30), "max_step_flops")
        plan_precisions = precision_list(data.get("precisions", list(PRECISIONS)), "precisions")
    estimate = TimeModel.from_yaml(data.get("estimate") or {}, f"{name}: estimate")
    with located(f"{name}: "):
        groups = [Group("standard", data.get("models", []), plan_precisions, Setting(), "default", grid, None,
                        budget)]
    for index, item in enumerate(data.get("variants") or []):
        groups.append(_group(item, f"{name}: variants[{index}]", grid, plan_precisions, budget))
    with located(f"{name}: "):
        gpu_memory = number(data.get("gpu_memory_gib", 139), "gpu_memory_gib") * GIB
        return Plan(tuple(groups), estimate, data.get("allow_tf32", True), data.get("child_timeout_seconds", 240),
                    gpu_memory)


def load_plan(path) -> Plan:
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: sweep plan not found") from None
    except yaml.YAMLError:
        raise UserError(f"{path}: not valid YAML") from None
    return parse_plan(data, str(path))


def plan_models(plan: Plan) -> list[str]:
    return plan.models


def override_plan(plan: Plan, models=None, precisions=None, batch_sizes=None, seq_lens=None,
                  max_step_flops=None, standard_only=False) -> Plan:
    """Command-line narrowing of a plan (a smoke test, a subset)."""
    groups = plan.groups[:1] if standard_only else plan.groups
    if models:
        planned = {m for group in groups for m in group.models}
        missing = [m for m in models if m not in planned]
        if missing:
            raise UserError(f"--models: {missing[0]!r} is not in the plan")
    if precisions:
        precision_list(list(precisions), "--precisions")
    if max_step_flops:
        number(max_step_flops, "--max-step-flops")
    narrowed = []
    for group in groups:
        changes = {}
        if models:
            changes["models"] = [m for m in group.models if m in models]
        if precisions:
            changes["precisions"] = [p for p in group.precisions if p in precisions]
        if batch_sizes or seq_lens:
            changes["grid"] = Grid(batch_sizes or group.grid.batch_sizes, seq_lens or group.grid.seq_lens)
            changes["points"] = None
        if max_step_flops and not group.own_budget:  # a group's own budget (blog points) stays
            changes["max_step_flops"] = max_step_flops
        narrowed.append(replace(group, **changes))
    return replace(plan, groups=tuple(narrowed))
