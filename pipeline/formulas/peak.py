"""The peak of the standard training step in closed form: a max of two branches, one fitted sum.

What the exact simulator (`pipeline.simulate`) shows the peak to be, in config facts (bytes; W the
weight bytes of the precision, S the optimizer state, T = B x L tokens, V the vocabulary):

- optimizer branch: W + gradients (W) + S + the foreach step's temporaries (W for AdamW, none for
  SGD) + the cuBLAS workspaces (65 MiB). Exact.
- backward branch, at the start of the backward (the loss's gradient): W + S + workspaces +
  everything saved for backward + 8 x T x V (the fp32 gradients of log_softmax and of its input).
  Of that, the saved bytes are the one fitted part: T x sum_k c_k x_k(L) over the config's features
  (`pipeline.formulas.features`), plus, under amp-bf16, the bf16 copies of the matmul weights autocast keeps,
  2 bytes x their parameters, and where the logits are soft-capped (Gemma 2, nanochat) the tanh's output,
  T x V in the activations' dtype: both known exactly (`known_saved_bytes`). With gradient checkpointing only the layer inputs stay
  (the `hidden` term) and one layer is recomputed at a time: the per-layer terms count once, not
  per layer (and so do the amp copies of one layer's weights).

bf16-autocast (bf16 weights under bf16 autocast) has a group of its own. Until measured points fit it,
it takes bf16's fit (`STANDS_IN`: the same weights, gradients, state and activation sizes, no weight
copies) plus what autocast's fp32 ops keep on bf16 inputs (`features.autocast_fp32_bytes`: LayerNorm
inputs, gelu_new's chain, partial rotary), derived from the op lists, not fitted; the answer says so.

SFTTrainer (`client = sft`) never builds the logits: its backward branch takes the decoder's saved
bytes without the `vocabulary` term (the logits the loss keeps), plus the fused head's saved bytes,
and the head's backward (`pipeline.formulas.fused_head`) in place of 8 x T x V.

Mamba-2 hybrids (transformers' reference SSD, `mixers.ssd_transient_bytes`): one Mamba-2 layer's backward
holds a transient that no saved term has, twice its largest fp32 chunk product (C x B: B x padded L x chunk x
heads x state). It runs after the loss's gradients are freed, beside the head's weight gradient: the backward
branch's in-flight part is max(8 x T x V, that transient + V x width x W bytes). Exact bytes, not fitted.

peak = max(optimizer branch, backward branch). The later backward (gradients growing as
activations are freed) never exceeds the optimizer branch: gradients + what is left < gradients +
temporaries + ... (checked on the simulator's phase peaks). The fit uses the measured backward
peaks whose start dominates (saved part above twice the gradients), where the saved bytes are
read off exactly (`pipeline.fit.peak`); coefficients are non-negative, in bytes per element per token.
"""

from __future__ import annotations

from pipeline.core.vocabulary import ACTIVATION_BYTES, WEIGHT_BYTES, precision_mode
from pipeline.formulas.components import optimizer_bytes
from pipeline.formulas.features import (FEATURES, LOSS_BACKWARD_BYTES, PER_LAYER, TENSOR_PARALLEL_TERMS, WORKSPACE_BYTES,
                                        attention_kernel, autocast_fp32_bytes, feature_values, matmul_parameters)
from pipeline.formulas.fused_head import head_bytes, liger_head_bytes
from pipeline.formulas.mixers import ssd_transient_bytes

TERMS = list(FEATURES)
AMP_COPY_BYTES = 2  # bytes per matmul weight: the bf16 copy autocast makes and autograd keeps
PEAK_FORMULA = ("peak = max(W + G + S + I + workspaces, W + S + workspaces + 8 x T x V + saved); "
                "saved = T x sum_k c_k x_k(L) [+ 2 x matmul parameters under amp-bf16] [+ T x V x activation bytes where "
                "the logits are soft-capped]; W, G, S, I: weights, "
                "gradients, optimizer state and the optimizer step's temporaries (bytes, from N); T = B x L; "
                "V = vocab_size; workspaces = 65 MiB; Mamba-2 hybrids: 8 x T x V -> max(8 x T x V, SSD + head gradient), "
                "SSD = 2 x 4 x max(Tp x chunk x heads x state, Tp x chunk x inner, Tp x inner x state, "
                "B x (chunks + 1)^2 x inner x state), Tp = B x chunks x chunk")


# amp-fp16 keeps the tensors amp-bf16 keeps, of the same sizes (2-byte autocast copies and
# activations; the same kernel choice on sm90); its gradient scaler adds a few 512-byte blocks.
SAME_TENSORS_AS = {"amp-fp16": "amp-bf16"}
# A precision without a fit of its own (yet) takes the fit of one with the same sizes, plus known terms.
STANDS_IN = {"bf16-autocast": "bf16", "mp-bf16": "bf16"}  # mp-bf16: bf16 compute of fp32 weights gathered by FSDP2


def peak_group(precision: str, checkpointing: bool) -> str:
    return SAME_TENSORS_AS.get(precision, precision) + ("+checkpointing" if checkpointing else "")


def fixed_bytes(parameters, precision: str, optimizer: str) -> tuple[float, float]:
    """(weights + gradients + optimizer state, optimizer intermediates) in bytes: exact from N."""
    weight = WEIGHT_BYTES[precision] * parameters
    state, temporaries = optimizer_bytes(optimizer, parameters, WEIGHT_BYTES[precision])
    return weight * 2 + state, temporaries


def amp_copies(facts, precision: str, checkpointing: bool, head: bool = True) -> float:
    """Bytes of the 16-bit weight copies kept for backward (fp32 weights under autocast only; checkpointing:
    head + one layer; `head` False: the head's copy is not kept, as in SFTTrainer's fused head)."""
    if not precision_mode(precision).weight_copies:
        return 0.0
    matmul = matmul_parameters(facts)
    head_parameters = facts.vocab * (facts.embed_width or facts.hidden)
    if checkpointing:
        matmul = head_parameters + (matmul - head_parameters) / max(facts.layers, 1)
    if not head:
        matmul -= head_parameters
    return float(AMP_COPY_BYTES * matmul)


def softcap_bytes(facts, precision: str) -> float:
    """Bytes per token of the logits' soft cap (final_logit_softcapping): logits / cap, tanh, x cap; tanh keeps its
    output for backward, one logits-sized tensor in the activations' dtype beside what the loss keeps."""
    return float(facts.vocab * ACTIVATION_BYTES[precision]) if facts.softcap else 0.0


def known_saved_bytes(facts, precision: str, checkpointing: bool, tokens: int) -> float:
    """The saved bytes known exactly rather than fitted: the amp weight copies and the soft cap's tanh."""
    return amp_copies(facts, precision, checkpointing) + tokens * softcap_bytes(facts, precision)


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
            "activations": tokens * saved_per_token + known_saved_bytes(facts, precision, checkpointing, tokens),
            "loss_backward": LOSS_BACKWARD_BYTES * tokens * facts.vocab}


def peak_of(parts: dict) -> tuple[float, str]:
    """max(optimizer branch, backward branch); with `recompute` (a checkpointed layer in its backward, the
    sft formula's), the optimizer branch's temporaries are at least that layer. Under FSDP2 (`gathered_weights`,
    `weights_in_flight`: `components.shard_components`) the backward branch holds the gathered weights and, at its
    worst, either the loss's gradients or a layer's recompute with the weights in flight; late in the backward
    (nearly every gradient reduced) the gradients branch holds them too."""
    fixed = parts["parameters"] + parts["optimizer_state"] + parts["workspaces"] + parts.get("ddp_buckets", 0.0)
    recompute = parts.get("recompute", 0.0)
    gathered = parts.get("gathered_weights", 0.0)
    layer = recompute + parts.get("weights_in_flight", 0.0)
    late = gathered + layer if gathered else recompute
    optimizer = fixed + parts["gradients"] + max(parts["optimizer_intermediates"], late)
    backward = fixed + parts["activations"] + gathered + max(parts["loss_backward"], layer if gathered else 0.0)
    return (backward, "backward") if backward > optimizer else (optimizer, "optimizer")


def known_attention(value):
    """The attention implementations the formula tells apart (eager, sdpa), else None (the default)."""
    return value if value in ("eager", "sdpa") else None


def mlp_backward_bytes(facts, precision: str) -> float:
    """Bytes per token of an MLP's backward in flight: the gradient of down's input and those of the gate's
    and up's outputs (a gated MLP; two without a gate), in the activations' dtype."""
    from pipeline.core.vocabulary import ACTIVATION_BYTES

    return (3 if facts.gated else 2) * facts.intermediate * ACTIVATION_BYTES[precision]


def one_layer_bytes(peak_fits: dict, facts, seq: int, precision: str, attention=None) -> float:
    """Bytes per token of one decoder layer's saved tensors, by the fit without checkpointing (its per-layer
    terms over the layers): what a checkpointed layer holds while it is recomputed."""
    group = peak_fits.get(peak_group(precision, False))
    if group is None:
        return 0.0
    values = feature_values(facts, seq, attention_kernel(facts, precision, known_attention(attention)))
    coefficients = group["coefficients"]
    return sum(coefficients.get(k, 0.0) * values[k] for k in PER_LAYER) / max(facts.layers, 1)


def fitted_group(peak_fits: dict, precision: str, checkpointing: bool) -> tuple[str, str | None]:
    """(the group whose fit the formula uses, a note when it stands in for the precision's own); KeyError
    when neither was fitted."""
    own = peak_group(precision, checkpointing)
    if own in peak_fits or precision not in STANDS_IN:
        peak_fits[own]  # noqa: B018 - KeyError when not fitted
        return own, None
    stand_in = peak_group(STANDS_IN[precision], checkpointing)
    peak_fits[stand_in]  # noqa: B018
    if not precision_mode(precision).autocast:
        return stand_in, f"{precision} has no fit of its own yet: {stand_in}'s saved bytes (the same bf16 compute)"
    return stand_in, (f"{precision} has no fit of its own yet: {stand_in}'s fit plus the fp32 copies autocast "
                      "keeps on bf16 inputs (LayerNorm inputs, gelu_new, partial rotary; from the op lists)")


def closed_form_peak(peak_fits: dict, facts, parameters, batch: int, seq: int, precision: str, optimizer: str,
                     checkpointing: bool, attention=None, client: str = "loop", completion_share: float = 1.0,
                     head_trainable: bool = True, liger_kernel: bool = False, tensor_parallel: int = 1) -> dict:
    """The formula's peak, its phase and components (bytes), and `notes`; KeyError when the group was not
    fitted. `client` sft: SFTTrainer's fused head in place of the logits (`completion_share` of the
    positions labelled; `head_trainable` False under LoRA); the Trainer with `liger_kernel`: Liger's fused
    linear cross-entropy in their place (Liger's RMSNorm, RoPE and SwiGLU kernels are not modelled).
    `tensor_parallel` T: the saved terms that tensor parallelism splits (`features.TENSOR_PARALLEL_TERMS`) count
    a T-th (the weights' share is the caller's, as FSDP's is)."""
    precision = SAME_TENSORS_AS.get(precision, precision)
    group, note = fitted_group(peak_fits, precision, checkpointing)
    coefficients = peak_fits[group]["coefficients"]
    fitted = group.split("+")[0]
    x = saved_design(facts, seq, fitted, checkpointing, known_attention(attention))
    sft = client == "sft"
    fused = sft or (liger_kernel and client != "loop")
    saved = sum(coefficients.get(t, 0.0) * v / (tensor_parallel if t in TENSOR_PARALLEL_TERMS else 1)
                for t, v in zip(TERMS, x) if not (fused and t == "vocabulary"))
    if note is not None and precision_mode(precision).autocast:
        saved += autocast_fp32_bytes(facts, checkpointing)
    parts = branches(facts, parameters, batch, seq, precision, optimizer, checkpointing, saved)
    if fused:
        width = facts.embed_width or facts.hidden
        head = head_bytes(facts.vocab, width, batch, seq, precision, completion_share, head_trainable) if sft \
            else liger_head_bytes(facts.vocab, width, batch, seq, precision, head_trainable)
        parts["activations"] += head["saved"] - amp_copies(facts, precision, checkpointing) \
            + amp_copies(facts, precision, checkpointing, head=False) - batch * seq * softcap_bytes(facts, precision)
        parts["loss_backward"] = head["backward"]
        if checkpointing:  # later in the backward: a layer recomputed and back-propagated, beside the gradients
            layer = batch * seq * one_layer_bytes(peak_fits, facts, seq, group.split("+")[0], attention)
            layer += batch * seq * mlp_backward_bytes(facts, precision)
            gradient = facts.vocab * (facts.embed_width or facts.hidden) * WEIGHT_BYTES[precision] if head_trainable else 0
            parts["loss_backward"] = max(head["backward"], layer + gradient - head["saved"])
            parts["recompute"] = layer
    ssd = ssd_transient_bytes(facts.mixer, batch, seq) if facts.mixer_layers else 0.0
    if ssd:  # a Mamba-2 layer's backward: the loss's gradients freed by then, the head's weight gradient held
        gradient = facts.vocab * (facts.embed_width or facts.hidden) * WEIGHT_BYTES[precision] if head_trainable else 0
        parts["loss_backward"] = max(parts["loss_backward"], ssd + gradient - (head["saved"] if fused else 0.0))
    peak, phase = peak_of(parts)
    return {"peak_bytes": peak, "components": parts, "peak_phase": phase, "notes": [note] if note else []}
