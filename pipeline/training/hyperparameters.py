"""The optimizer's and the scheduler's numbers of a Trainer run, by their TrainingArguments names.

They change little of a step's memory (`max_grad_norm` 0 turns gradient clipping off), but a DeepSpeed config
takes its "auto" values from them (the optimizer's lr, betas, eps and weight decay, the scheduler's warmup and
total steps, the clipping) and the Trainer refuses a number there that disagrees with them; DeepSpeed's
WarmupLR refuses a warmup of 0 steps. So the run is simulated with the numbers the user's training file gives
(`Setting.hyperparameters`), and the rest at TrainingArguments' defaults, as the real run has them.

`max_steps` is the run's total: the schedule is made for it (DeepSpeed's `total_num_steps`, a warmup ratio's
steps); the simulation still runs three steps of it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

from pipeline.core.errors import UserError
from pipeline.core.text import short

# TrainingArguments (transformers 5.17) keys that a training file may give: a number, or the scheduler's name
NUMBERS = ("learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm",
           "warmup_steps")
MAX_STEPS_LIMIT = 10**12  # far beyond any run: a bound, so that a schedule's arithmetic stays in range
REMOVED = {"warmup_ratio": "a warmup_steps below 1 is the ratio"}  # keys transformers 5 no longer takes


@dataclass(frozen=True)
class Hyperparameters:
    """Each None: TrainingArguments' (or SFTConfig's, DPOConfig's) default."""

    learning_rate: float | None = None
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    adam_epsilon: float | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None
    warmup_steps: float | None = None  # steps, or below 1 the share of the total steps
    max_steps: int | None = None
    lr_scheduler_type: str | None = None

    @classmethod
    def of(cls, args: dict, label: str) -> Hyperparameters:
        """The hyperparameters a training file (its parsed dict) gives; one-line UserError for a bad value."""
        for key, instead in REMOVED.items():
            if args.get(key) not in (None, 0, 0.0):
                raise UserError(f"{label}: {key} is not an argument of transformers' TrainingArguments since "
                                f"version 5 (the run stops at its parsing): {instead}")
        given = {key: _number(args[key], key, label) for key in NUMBERS if args.get(key) is not None}
        if given.get("warmup_steps", 0) < 0:
            raise UserError(f"{label}: warmup_steps must be 0 or more, not {short(args['warmup_steps'])}")
        steps = args.get("max_steps")
        if steps is not None and steps != -1:
            if isinstance(steps, bool) or not isinstance(steps, int) or not 0 < steps <= MAX_STEPS_LIMIT:
                raise UserError(f"{label}: max_steps must be a positive whole number (or -1: from the epochs), "
                                f"not {short(steps)}")
            given["max_steps"] = steps
        scheduler = args.get("lr_scheduler_type")
        if scheduler is not None:
            if not isinstance(scheduler, str) or len(scheduler) > 64:
                raise UserError(f"{label}: lr_scheduler_type must be a scheduler's name, not {short(scheduler)}")
            given["lr_scheduler_type"] = scheduler.removeprefix("SchedulerType.").lower()
        return cls(**given)

    def arguments(self) -> dict:
        """The TrainingArguments keys given (max_steps apart: the simulation's and the measurement's own)."""
        return {key: value for key, value in asdict(self).items() if value is not None and key != "max_steps"}

    def total_steps(self, default: int) -> int:
        return self.max_steps or default

    def to_text(self) -> str | None:
        """The tables' `hyperparameters` cell: JSON of what is given, None for the defaults."""
        given = {key: value for key, value in asdict(self).items() if value is not None}
        return json.dumps(given, sort_keys=True) if given else None

    @classmethod
    def from_text(cls, text) -> Hyperparameters:
        if not isinstance(text, str) or not text:
            return cls()
        names = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in json.loads(text).items() if key in names})


def _number(value, key: str, label: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not math.isfinite(value)) or abs(value) > 1e12:
        raise UserError(f"{label}: {key} must be a finite number, not {short(value)}")
    return value
