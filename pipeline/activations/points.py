"""The (B, L) points the counting stage measures, the precisions it counts in, and its limits."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.core.vocabulary import ACTIVATION_BYTES, DTYPE_OF_PRECISION

# activations.parquet spells a precision by its dtype (pipeline.core.vocabulary); float16 is counted
# only on request (`count --dtype float16`), never by the stage. amp-fp16 saves what amp-bf16 saves
# (the same element sizes), so the stage counts the three precisions it always has.
COUNTED_PRECISIONS = ("fp32", "bf16", "amp-bf16")
SAVED_PRECISIONS = tuple(DTYPE_OF_PRECISION[precision] for precision in COUNTED_PRECISIONS)
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

# Which points are counted is decided from the model and the point alone, never from timings, so
# that the table does not depend on the machine's speed. A meta forward costs about the same at any
# L, except where the model loops over the sequence in Python: recurrent scans whose CUDA kernels
# (mamba-ssm, causal-conv1d, the RG-LRU and WKV kernels) are absent on meta and the CPU, so that
# transformers runs a per-token loop. Those are counted up to this L (2-5 s per training forward on 2
# cores). Chunked scans loop per chunk, not per token, and are counted at every L: Mamba-2's SSD
# (Nemotron-H, Granite 4, Falcon-H1; chunk_size tokens) and the gated delta rule (Qwen3.5, Qwen3-Next,
# Kimi-Linear; 64 tokens), at most 1.1 s (Qwen3.5) and 3.4 s (Kimi-Linear, whose chunks loop over
# their 64 positions too) per training forward at L=8192.
SEQUENTIAL_SCAN_MODEL_TYPES = frozenset({"mamba", "falcon_mamba", "recurrent_gemma", "rwkv", "jamba", "zamba"})
SCAN_MAX_SEQ_LEN = 2048
# A CPU forward (the last path) holds its activations for real: it is tried only when they are
# likely (8 bytes x hook elements per token x tokens) to stay below this; this also bounds its
# time, which grows with the tokens (jetmoe-8b: up to 128 tokens, 3-10 s).
CPU_FORWARD_MAX_BYTES = 4 * 2**30
# A safety net only (no registry point comes near it): a point still running then is an error.
POINT_TIME_LIMIT_S = 60.0
# Seconds one model may take in all (its build and every point); the slowest registry model takes 3.5 s.
MODEL_TIME_LIMIT_S = 300.0


def skip_reason(model_types, seq: int, context: int | None) -> str | None:
    """Why the point (any batch, `seq` tokens per sequence) of a model is not counted, or None.

    `model_types`: the model's model_type and its text model's (a wrapper around a scan model)."""
    if context and seq > context:
        return f"seq_len {seq} beyond the context length {context}"
    if seq > SCAN_MAX_SEQ_LEN and SEQUENTIAL_SCAN_MODEL_TYPES & set(model_types):
        return f"recurrent scan without its CUDA kernels: counted up to L={SCAN_MAX_SEQ_LEN}"
    return None
