"""The words every stage shares: precision modes, optimizers, clients, loop variants, attention
choices, statuses, estimator methods and the key of a measured point, with the one check that
names what is wrong with a value.

Units and the meaning of each word are in docs/definitions.md.
"""

from __future__ import annotations

from pipeline.errors import UserError

# Precision modes of a training step: fp32 (weights, grads, optimizer state in fp32), bf16 (all
# in bf16), amp-bf16 (fp32 weights and state, forward under bf16 autocast).
PRECISIONS = ("fp32", "bf16", "amp-bf16")
# activations.parquet spells a precision by its dtype (`dtype` column); this is the one bridge.
DTYPE_OF_PRECISION = {"fp32": "float32", "bf16": "bfloat16", "amp-bf16": "amp-bf16"}
PRECISION_OF_DTYPE = {dtype: precision for precision, dtype in DTYPE_OF_PRECISION.items()}
# Element size of the activations of a precision (amp-bf16 computes in bf16).
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "amp-bf16": 2}
# Bytes per parameter of the weights, gradients and optimizer state.
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "amp-bf16": 4}

OPTIMIZERS = ("adamw", "sgd")
CLIENTS = ("loop",)  # loop: the standard training step (docs/definitions.md)
VARIANTS = ("standard", "blog")  # blog: the blog's own loop, loss = mean(logits)
ATTENTIONS = ("default", "eager")  # as requested; default: the library's choice (sdpa)
STATUSES = ("ok", "oom", "skipped", "error")
METHODS = ("blog", "heuristic", "exact", "formula")  # estimators

# A measured point of the peak table is one row per these columns.
POINT_KEY = ("model_id", "precision", "variant", "optimizer", "gradient_checkpointing", "attn_implementation",
             "batch_size", "seq_len")


def check_choice(what: str, value, allowed) -> None:
    """UserError naming `what`, the value and the allowed ones, when `value` is not allowed."""
    if value not in allowed:
        raise UserError(f"{what} {value!r} is not one of {', '.join(str(a) for a in allowed)}")


def check_positive_int(what: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"{what} must be a positive integer, got {value!r}")
