"""The attention mask of packed and padding-free batches (TRL's `packing` / `padding_free`, `training.packing`) in
the closed form: N tokens of a micro-batch concatenated into one row, position ids restarting at each document.
transformers then builds a (1, 1, N, N) boolean mask for torch's SDPA (one more for sliding-window layers), which
CUDA's kernels (cuDNN, memory-efficient) take as an additive bias of the compute dtype that each attention layer
saves for its backward: without checkpointing every layer's, with it the recomputed layer's (results/packing shows
it on an H200: +4 GiB on SmolLM2-135M at 8,192 tokens)."""

from __future__ import annotations


def packed_mask_bytes(facts, tokens: int, checkpointing: bool, attention: str | None, compute_bytes: int) -> float:
    """Bytes of the packed-sequence masks alive at the start of the backward (SDPA, the default; eager attention's
    additive mask is one N x N tensor beside its far larger scores, not counted)."""
    if attention == "eager":
        return 0.0
    masks = 2 if facts.window_layers else 1
    saved_layers = 1 if checkpointing else facts.attention_layers
    return float(tokens) ** 2 * (masks + saved_layers * compute_bytes)
