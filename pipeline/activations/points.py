"""The (B, L) points the counting stage measures, the precisions it counts in, and its limits."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.vocabulary import ACTIVATION_BYTES, DTYPE_OF_PRECISION, PRECISIONS

# activations.parquet spells a precision by its dtype (pipeline.vocabulary); float16 is counted
# only on request (`count --dtype float16`), never by the stage.
SAVED_PRECISIONS = tuple(DTYPE_OF_PRECISION[precision] for precision in PRECISIONS)
# Element size used for the bytes of a precision (amp-bf16 computes the matmuls in bfloat16).
PRECISION_BYTES = {"float32": ACTIVATION_BYTES["fp32"], "bfloat16": ACTIVATION_BYTES["bf16"], "float16": 2,
                   "amp-bf16": ACTIVATION_BYTES["amp-bf16"]}
# The dtype of the weights of a precision, and whether its forward runs under CUDA's autocast
# policy to bfloat16.
FORWARD_SETTINGS = {"float32": ("float32", False), "bfloat16": ("bfloat16", False),
                    "float16": ("float16", False), "amp-bf16": ("float32", True)}
HOOK_DTYPES = ("float32", "bfloat16")  # hook elements do not depend on the dtype: one forward, two rows


@dataclass(frozen=True)
class PointSet:
    """The (B, L) points of each method; L beyond a model's context length is skipped."""

    hook: tuple
    saved: tuple
    precisions: tuple = SAVED_PRECISIONS


HOOK_POINTS = ((1, 1), (1, 128), (1, 1024), (4, 512))
POINT_SETS = {
    "blog": PointSet(hook=((1, 1),), saved=(), precisions=()),
    "standard": PointSet(hook=HOOK_POINTS, saved=((1, 128), (1, 512), (1, 2048), (1, 8192), (4, 512))),
    "full": PointSet(hook=HOOK_POINTS,
                     saved=tuple((1, seq) for seq in (128, 256, 512, 1024, 2048, 4096, 8192)) + ((4, 512),)),
}
DEFAULT_POINTS = "standard"

# A meta forward costs the same at any L, except where the model loops over the sequence in Python
# (e.g. state-space models without their CUDA kernels). Once that shows, points whose estimated
# time passes this limit are skipped; no point runs longer than the hard limit.
POINT_ESTIMATE_LIMIT_S = 3.0
POINT_TIME_LIMIT_S = 60.0
MODEL_TIME_LIMIT_S = 300.0
# A CPU forward (the last path) holds its activations for real: it is tried only when they are
# likely (8 bytes x hook elements per token x tokens) to stay below this.
CPU_FORWARD_MAX_BYTES = 4 * 2**30
