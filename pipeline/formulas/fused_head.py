"""TRL's fused LM head (SFTTrainer's loss_type "nll", trl 1.16 `trl.kernels.chunked_logprob`) in config
words, for the closed forms of `client = sft` (no torch). SFTTrainer never builds the (B, L, V) logits:
the head projects the labelled positions in tiles and keeps per-position statistics.

With T = B x L tokens, M = the labelled positions (`labelled_positions`: B x (L - 1) shifted labels, the
completion's share of them), H = hidden_size, V = vocab_size, a = bytes of the residual stream (the
weights' dtype: 2 for bf16 weights, 4 for fp32 ones, autocast or not), c = bytes of the compute dtype
(2 under autocast, else a), w = bytes of the head's weight:

- saved for the backward: the gathered rows `hidden[labels != -100]` (M x H x a), the targets (int64),
  log-normaliser and entropy (fp32) of each position (M x 16), and the label mask (T bytes);
- at the start of its backward (the backward branch of the peak, in place of the Trainer's fp32
  gradients of the logits): the tile buffer min(M, 4096) x 32768 x c (as wide whatever V is), the fp32
  gradient of the gathered rows and its cast back (M x H x (4 + a)), and, when the head trains (full
  fine-tuning), its fp32 gradient and its cast back (V x H x (4 + w)); under autocast on fp32 weights
  the bf16 copy of one 32768-row slice of the head (32768 x H x 2).
"""

from __future__ import annotations

from pipeline.core.vocabulary import precision_mode

TILE_ROWS = 4096  # positions per projection tile (TOKEN_CHUNK_SIZE)
TILE_WIDTH = 32768  # vocabulary entries per tile (_CHUNKED_LOGPROB_CHUNK_SIZE), however small V is
PER_POSITION_BYTES = 8 + 4 + 4  # the target (int64), log-normaliser and entropy (fp32) kept for the backward


def labelled_positions(batch: int, seq: int, completion_share: float = 1.0) -> int:
    """M: positions whose next token carries a label. Labels are shifted by one: of each row's L - 1, those
    of the completion (the last L - round((1 - share) x L) positions of the row; every one at share 1)."""
    prompt = round((1 - completion_share) * seq)
    return batch * (seq - max(prompt, 1))


def head_bytes(vocab: int, hidden: int, batch: int, seq: int, precision: str, completion_share: float = 1.0,
               head_trainable: bool = True) -> dict:
    """The fused head's bytes (see the module docstring): `saved` (kept from its forward to its backward)
    and `backward` (held at the start of its backward)."""
    mode = precision_mode(precision)
    stream = mode.weight_bytes
    compute = 2 if mode.autocast else stream
    positions = labelled_positions(batch, seq, completion_share)
    saved = positions * (hidden * stream + PER_POSITION_BYTES) + batch * seq
    backward = min(positions, TILE_ROWS) * TILE_WIDTH * compute + positions * hidden * (4 + stream)
    if head_trainable:
        backward += vocab * hidden * (4 + mode.weight_bytes)
    if mode.weight_copies:
        backward += min(vocab, TILE_WIDTH) * hidden * 2
    return {"saved": float(saved), "backward": float(backward), "labelled_positions": positions}
