"""The words every stage shares: precision modes, optimizers, clients, loop variants, attention
choices, statuses, estimator methods and the key of a measured point, with the one check that
names what is wrong with a value.

Units and the meaning of each word are in docs/definitions.md.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from pipeline.core.errors import UserError
from pipeline.core.text import short

# Precision modes of a training step (docs/definitions.md), each defined once by what it is made of:
# the dtype of the weights, gradients and optimizer state, the dtype of the forward's autocast (None:
# no autocast) and whether the loss goes through a gradient scaler.
@dataclass(frozen=True)
class Precision:
    """A precision mode: `weights` (fp32 | bf16: weights, gradients, optimizer state), `autocast` (None |
    bf16 | fp16: the forward under torch.autocast to that dtype) and `scaler` (a gradient scaler)."""

    name: str
    weights: str
    autocast: str | None = None
    scaler: bool = False
    gathered: str | None = None  # FSDP2's MixedPrecisionPolicy: the dtype its all-gather casts the weights to

    @property
    def weight_bytes(self) -> int:
        """Bytes per parameter of the weights, gradients and optimizer state."""
        return 4 if self.weights == "fp32" else 2

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of the activations (the matmuls' outputs): 16 bits under autocast or gathered in bf16."""
        return 2 if self.autocast or self.gathered or self.weights != "fp32" else 4

    @property
    def weight_copies(self) -> bool:
        """Whether autocast casts fp32 weights to 16-bit copies that autograd keeps (the amp modes)."""
        return self.autocast is not None and self.weights == "fp32"


# fp32, bf16 (all in bf16, no autocast), amp-bf16 (fp32 weights and state, forward under bf16 autocast),
# amp-fp16 (the same under fp16 autocast, the loss scaled by a gradient scaler), bf16-autocast (bf16
# weights, grads and state, and the forward under bf16 autocast all the same: what Trainer / SFTTrainer
# with bf16=True run on a model loaded in bf16).
# mp-bf16 (fp32 weights, gradients and state; FSDP2 casts the gathered weights to bf16 for compute and reduces
# the gradients in fp32: MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), torchtitan's recipe;
# the loop under fsdp, fsdp-no-reshard and hsdp only).
PRECISION_MODES = {p.name: p for p in (
    Precision("fp32", "fp32"), Precision("bf16", "bf16"), Precision("amp-bf16", "fp32", "bf16"),
    Precision("amp-fp16", "fp32", "fp16", scaler=True), Precision("bf16-autocast", "bf16", "bf16"),
    Precision("mp-bf16", "fp32", gathered="bf16"))}
PRECISIONS = tuple(PRECISION_MODES)
# activations.parquet spells a precision by its dtype (`dtype` column); this is the one bridge.
DTYPE_OF_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "amp-bf16": "amp-bf16", "amp-fp16": "amp-fp16",
                      "bf16-autocast": "bf16-autocast", "mp-bf16": "mp-bf16"}
PRECISION_OF_DTYPE = {dtype: precision for precision, dtype in DTYPE_OF_PRECISION.items()}
# Element size of the activations of a precision (the autocast modes compute in 16 bits).
ACTIVATION_BYTES = {name: p.activation_bytes for name, p in PRECISION_MODES.items()}
# Bytes per parameter of the weights, gradients and optimizer state.
WEIGHT_BYTES = {name: p.weight_bytes for name, p in PRECISION_MODES.items()}


def precision_mode(name: str) -> Precision:
    """The Precision called `name` (UserError naming the known ones otherwise)."""
    check_choice("precision", name, PRECISIONS)
    return PRECISION_MODES[name]


# The dtype a model's weights were loaded in (`--weights-dtype`; a config's dtype / torch_dtype names it
# in torch's words), which with a training file's bf16 / fp16 flag makes the precision.
WEIGHTS_DTYPES = ("bf16", "fp32")
WEIGHTS_DTYPE_OF_TORCH_NAME = {"bfloat16": "bf16", "float32": "fp32", "torch.bfloat16": "bf16",
                               "torch.float32": "fp32"}


def precision_of(weights: str, autocast: str | None) -> str:
    """The precision of weights in `weights` (bf16 | fp32) trained under `autocast` (None | bf16 | fp16):
    TrainingArguments(bf16=True) on a bf16 model is bf16-autocast, on an fp32 model amp-bf16."""
    check_choice("weights dtype", weights, WEIGHTS_DTYPES)
    for mode in PRECISION_MODES.values():
        if mode.weights == weights and mode.autocast == autocast:
            return mode.name
    raise UserError(f"{autocast} autocast on {weights} weights is not a precision this project models "
                    f"({', '.join(PRECISIONS)})")


OPTIMIZERS = ("adamw", "sgd")  # the loop client's: torch's AdamW (foreach), SGD with momentum 0.9
# The trainer client's `optim`, by its transformers name (TrainingArguments.optim).
OPTIMS = ("adamw_torch_fused", "adamw_torch", "adafactor", "sgd", "adamw_bnb_8bit")
# The loop's optimizer by its transformers name where one is exactly the same (transformers' "sgd"
# has no momentum, the loop's has 0.9: no name).
OPTIM_OF_LOOP_OPTIMIZER = {"adamw": "adamw_torch", "sgd": None}
# loop: the standard training step; trainer: transformers.Trainer; sft: TRL's SFTTrainer; dpo: TRL's
# DPOTrainer; grpo, rloo: TRL's GRPOTrainer and RLOOTrainer, online RL with generation (docs/definitions.md)
CLIENTS = ("loop", "trainer", "sft", "dpo", "grpo", "rloo")
# The clients built on transformers.Trainer: they take `optim`, gradient accumulation and Liger's kernels.
TRAINER_CLIENTS = ("trainer", "sft", "dpo", "grpo", "rloo")
# The clients that generate their completions in the step (`training.rollout.Rollout`)
ROLLOUT_CLIENTS = ("grpo", "rloo")
# The clients of TRL's trainers: prompt-completion data, whose completion share they take.
TRL_CLIENTS = ("sft", "dpo")
# Adapters on a frozen base: LoRA, or QLoRA on a base quantized by bitsandbytes (nf4: 4-bit, int8: 8-bit)
ADAPTER_METHODS = ("lora", "qlora")
QUANTIZATIONS = ("nf4", "int8")
# Several GPUs: DDP, FSDP2 fully_shard per decoder layer and the root (resharded after forward, or not), HSDP
# (FSDP2 on a 2-D mesh: shard groups replicated), DeepSpeed's ZeRO stages 1-3 as the Trainer runs them
# (`training.zero`); `training.layout.Layout` adds tensor parallelism
SHARDINGS = ("ddp", "fsdp", "fsdp-no-reshard", "hsdp", "zero1", "zero2", "zero3")
# Shardings a user may ask for whose real run crashes: the answer is that crash (`estimate.launch.KNOWN_CRASHES`)
CRASHING_SHARDINGS = ("fsdp-offload",)
ZERO_SHARDINGS = ("zero1", "zero2", "zero3")
VARIANTS = ("standard", "blog")  # blog: the blog's own loop, loss = mean(logits)
ATTENTIONS = ("default", "eager")  # as requested; default: the library's choice (sdpa)
STATUSES = ("ok", "oom", "skipped", "error")
SPLITS = ("tuned", "held-out")  # measured rows an estimator was tuned on, and rows kept out of every fit
METHODS = ("blog", "heuristic", "formula", "exact")  # the estimators, in the order the validation reports them
# Estimators fitted on the measurements: the validation also refits them without the validated model's family.
REFITTED_METHODS = ("heuristic", "formula")



def check_choice(what: str, value, allowed) -> None:
    """UserError naming `what`, the value and the allowed ones, when `value` is not allowed."""
    if value not in allowed:
        raise UserError(f"{what} {short(value)} is not one of {', '.join(str(a) for a in allowed)}")


# The largest question any estimator takes (README, "Bad input"): beyond them no GPU exists, and the
# exact simulator's time and the host memory of its inputs would grow without bound.
MAX_BATCH = 1 << 20
MAX_SEQ = 1 << 22
MAX_TOKENS = 1 << 24  # batch x sequence of one micro-batch
MAX_ACCUMULATION = 1024
MAX_GPUS = 4096
MAX_LORA_RANK = 4096


def check_positive_int(what: str, value, limit: int | None = None) -> int:
    """`value` as an int: a positive integer (a numpy integer too, never a bool), at most `limit`."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
        raise UserError(f"{what} must be a positive integer, got {short(value)}")
    if limit is not None and value > limit:
        raise UserError(f"{what} {int(value):,} is more than the {limit:,} this project estimates")
    return int(value)


def check_bool(what: str, value) -> bool:
    """`value` as a bool: True or False (numpy's too), never a number or a text such as "no"."""
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise UserError(f"{what} must be true or false, not {short(value)}")
    return bool(value)
