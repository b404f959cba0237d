"""The peak of the standard training step in closed form: a max of two branches, one fitted sum.

What the exact simulator (`pipeline.simulate`) shows the peak to be, in config facts (bytes; W the
weight bytes of the precision, S the optimizer state, T = B x L tokens, V the vocabulary):

- optimizer branch: W + gradients (W) + S + the foreach step's temporaries (W for AdamW, none for
  SGD) + the cuBLAS workspaces (65 MiB). Exact.
- backward branch, at the start of the backward (the loss's gradient): W + S + workspaces +
  everything saved for backward + 8 x T x V (the fp32 gradients of log_softmax and of its input).
  Of that, the saved bytes are the one fitted part: T x sum_k c_k x_k(L) over the config's features
  (`pipeline.formulas.features`), plus, under amp-bf16, the bf16 copies of the matmul weights autocast keeps,
  2 bytes x their parameters, known exactly. With gradient checkpointing only the layer inputs stay
  (the `hidden` term) and one layer is recomputed at a time: the per-layer terms count once, not
  per layer (and so do the amp copies of one layer's weights).

peak = max(optimizer branch, backward branch). The later backward (gradients growing as
activations are freed) never exceeds the optimizer branch: gradients + what is left < gradients +
temporaries + ... (checked on the simulator's phase peaks). The fit uses the measured backward
peaks whose start dominates (saved part above twice the gradients), where the saved bytes are
read off exactly (`pipeline.fit.peak`); coefficients are non-negative, in bytes per element per token.
"""

from __future__ import annotations

from pipeline.formulas.features import (FEATURES, LOSS_BACKWARD_BYTES, PER_LAYER, WORKSPACE_BYTES, attention_kernel,
                               feature_values, matmul_parameters)
from pipeline.formulas.components import optimizer_bytes
from pipeline.core.vocabulary import WEIGHT_BYTES

TERMS = list(FEATURES)
AMP_COPY_BYTES = 2  # bytes per matmul weight: the bf16 copy autocast makes and autograd keeps
PEAK_FORMULA = ("peak = max(W + G + S + I + workspaces, W + S + workspaces + 8 x T x V + saved); "
                "saved = T x sum_k c_k x_k(L) [+ 2 x matmul parameters under amp-bf16]; W, G, S, I: weights, "
                "gradients, optimizer state and the optimizer step's temporaries (bytes, from N); T = B x L; "
                "V = vocab_size; workspaces = 65 MiB")


# amp-fp16 keeps the tensors amp-bf16 keeps, of the same sizes (2-byte autocast copies and
# activations; the same kernel choice on sm90); its gradient scaler adds a few 512-byte blocks.
SAME_TENSORS_AS = {"amp-fp16": "amp-bf16"}


def peak_group(precision: str, checkpointing: bool) -> str:
    return SAME_TENSORS_AS.get(precision, precision) + ("+checkpointing" if checkpointing else "")


def fixed_bytes(parameters, precision: str, optimizer: str) -> tuple[float, float]:
    """(weights + gradients + optimizer state, optimizer intermediates) in bytes: exact from N."""
    weight = WEIGHT_BYTES[precision] * parameters
    state, temporaries = optimizer_bytes(optimizer, parameters, WEIGHT_BYTES[precision])
    return weight * 2 + state, temporaries


def amp_copies(facts, precision: str, checkpointing: bool) -> float:
    """Bytes of the bf16 weight copies kept for backward (amp-bf16 only; checkpointing: head + one layer)."""
    if precision != "amp-bf16":
        return 0.0
    matmul = matmul_parameters(facts)
    if checkpointing:
        head = facts.vocab * (facts.embed_width or facts.hidden)
        matmul = head + (matmul - head) / max(facts.layers, 1)
    return float(AMP_COPY_BYTES * matmul)


def saved_design(facts, seq_len: int, precision: str, checkpointing: bool, attention=None) -> list:
    """The features per token at L (checkpointing: per-layer terms of one layer)."""
    values = feature_values(facts, seq_len, attention_kernel(facts, precision, attention))
    if checkpointing:
        values = {k: v / max(facts.layers, 1) if k in PER_LAYER else v for k, v in values.items()}
    return [values[t] for t in TERMS]


def branches(facts, parameters, batch: int, seq: int, precision: str, optimizer: str, checkpointing: bool,
             saved_per_token: float) -> dict:
    """The components of both branches (bytes), given the fitted saved bytes per token."""
    weight = WEIGHT_BYTES[precision] * parameters
    tokens = batch * seq
    state, temporaries = optimizer_bytes(optimizer, parameters, WEIGHT_BYTES[precision])
    return {"parameters": weight, "gradients": weight, "optimizer_state": state,
            "optimizer_intermediates": temporaries, "workspaces": WORKSPACE_BYTES,
            "activations": tokens * saved_per_token + amp_copies(facts, precision, checkpointing),
            "loss_backward": LOSS_BACKWARD_BYTES * tokens * facts.vocab}


def peak_of(parts: dict) -> tuple[float, str]:
    fixed = parts["parameters"] + parts["optimizer_state"] + parts["workspaces"]
    optimizer = fixed + parts["gradients"] + parts["optimizer_intermediates"]
    backward = fixed + parts["activations"] + parts["loss_backward"]
    return (backward, "backward") if backward > optimizer else (optimizer, "optimizer")


def known_attention(value):
    """The attention implementations the formula tells apart (eager, sdpa), else None (the default)."""
    return value if value in ("eager", "sdpa") else None


def closed_form_peak(peak_fits: dict, facts, parameters, batch: int, seq: int, precision: str, optimizer: str,
                 checkpointing: bool, attention=None) -> dict:
    """The formula's peak, its phase and components (bytes); KeyError when the group was not fitted."""
    precision = SAME_TENSORS_AS.get(precision, precision)
    coefficients = peak_fits[peak_group(precision, checkpointing)]["coefficients"]
    x = saved_design(facts, seq, precision, checkpointing, known_attention(attention))
    saved = sum(coefficients.get(t, 0.0) * v for t, v in zip(TERMS, x))
    parts = branches(facts, parameters, batch, seq, precision, optimizer, checkpointing, saved)
    peak, phase = peak_of(parts)
    return {"peak_bytes": peak, "components": parts, "peak_phase": phase}
