"""The closed forms' terms for LoRA and QLoRA, from config facts (no torch): the adapters' trainable
parameters and the bytes of a frozen, possibly quantized, base. The exact estimator runs PEFT and
bitsandbytes themselves (pipeline.simulate.adapters); these are the formulas' approximations.

- LoRA of rank r on a linear (in -> out) adds r x (in + out) trainable parameters; `all-linear`
  targets every decoder linear (PEFT leaves the lm head out), named targets count the llama-style
  names below (other names: the exact method).
- The frozen base keeps the precision's weight bytes and has no gradients or optimizer state; the
  adapters have both, in the precision's weight dtype.
- QLoRA: nf4 decoder linears take half a byte per weight plus a 4-byte absmax per 64 (0.5625 B);
  int8 ones one byte plus a 4-byte scale per row; `prepare_model_for_kbit_training` upcasts the
  rest (embeddings, lm head, norms) to fp32, and PEFT keeps the adapters in fp32. The residual
  stream is then fp32 (fp32 embeddings and norm weights), and bitsandbytes casts each 4-bit
  matmul's output back to its input's dtype: the activations are fp32 training's
  (`activation_precision`), the logits too.
- LoRA dropout (`lora_dropout_bytes_per_token`): a mask and, where no cast copied the input before, a copy per
  targeted linear.
- SFTTrainer (client sft) never calls `prepare_model_for_kbit_training`: on a 4-bit base the other
  weights stay in the loaded dtype, the activations are the precision's, and it casts the adapters to
  bf16 (`upcast` False).
"""

from __future__ import annotations

from pipeline.core.errors import UserError
from pipeline.formulas.features import Facts, matmul_parameters
from pipeline.formulas.components import optimizer_bytes
from pipeline.core.vocabulary import ACTIVATION_BYTES, WEIGHT_BYTES

QUANTIZED_BYTES = {"nf4": 0.5 + 4 / 64, "int8": 1.0}
# Bytes per element of the copy of a targeted linear's input that LoRA's lora_A saves, by the base's precision.
INPUT_COPY_BYTES = {"bf16": 4, "bf16-autocast": 2}


def linear_shapes(facts: Facts) -> dict:
    """(in, out) of each llama-style decoder linear of one layer, by module name."""
    h, q, kv = facts.hidden, facts.q_dim or facts.hidden, facts.kv_dim or 2 * facts.hidden
    shapes = {"q_proj": (h, q), "k_proj": (h, kv // 2), "v_proj": (h, kv // 2), "o_proj": (q, h)}
    if facts.intermediate:
        shapes.update(up_proj=(h, facts.intermediate), down_proj=(facts.intermediate, h))
        if facts.gated:
            shapes["gate_proj"] = (h, facts.intermediate)
    return shapes


def adapter_parameters(facts: Facts, r: int, targets: str) -> int:
    """Trainable parameters of LoRA rank `r` on `targets` ("all-linear" or names joined by commas)."""
    shapes = linear_shapes(facts)
    names = list(shapes) if targets == "all-linear" else targets.split(",")
    unknown = [name for name in names if name not in shapes]
    if unknown:
        raise UserError(f"the closed forms count LoRA on {', '.join(shapes)} (or all-linear), not "
                        f"{', '.join(unknown)}: use method exact")
    return facts.layers * sum(r * (shapes[name][0] + shapes[name][1]) for name in names)


def base_bytes(facts: Facts, parameters: int, precision: str, quantization: str | None, upcast: bool = True) -> float:
    """Bytes of the frozen base's weights (`upcast`: prepare_model_for_kbit_training made the rest fp32)."""
    if quantization is None:
        return parameters * WEIGHT_BYTES[precision]
    linears = matmul_parameters(facts) - facts.vocab * (facts.embed_width or facts.hidden)
    return linears * QUANTIZED_BYTES[quantization] + (parameters - linears) * (4 if upcast else WEIGHT_BYTES[precision])


def lora_saved_bytes_per_token(facts: Facts, targets: str, precision: str, quantization: str | None,
                               checkpointing: bool = False) -> float:
    """What LoRA changes in the saved-for-backward bytes per token, bf16 bases (the formula's term).

    PEFT keeps the adapters in fp32 and casts each targeted linear's input to fp32, which lora_A
    saves: 4 bytes x its input width per targeted linear. The frozen base linears no longer save
    their inputs for their weights' gradients: the norm outputs feeding q/k/v and gate/up, and the
    MLP product feeding down (the attention output feeding o stays saved by attention itself).
    Llama-3.2-1B, r=16 on all linears, B=4, L=2048: +7.52 GB by this, +6.37 GB simulated. With
    checkpointing one layer's tensors live at a time (its recomputation in the backward). Under bf16
    autocast on a bf16 base (bf16-autocast) the fp32 input is cast back to bf16 for lora_A's matmul, and
    that bf16 copy is what is saved: 2 bytes x the input width."""
    if quantization or precision not in INPUT_COPY_BYTES:
        return 0.0
    shapes = linear_shapes(facts)
    names = list(shapes) if targets == "all-linear" else [n for n in targets.split(",") if n in shapes]
    added = INPUT_COPY_BYTES[precision] * sum(shapes[name][0] for name in names)
    released = 2 * (2 * facts.hidden + facts.intermediate)
    return (1 if checkpointing else facts.layers) * (added - released)


def lora_dropout_bytes_per_token(facts: Facts, targets: str, precision: str, quantization: str | None,
                                 checkpointing: bool = False, upcast: bool = True) -> float:
    """What LoRA dropout adds to the saved bytes per token (the formula's term; 0 without dropout).

    PEFT drops each targeted linear's input out anew for its adapter: CUDA's fused dropout keeps a bool
    mask (1 byte x the input width) for its backward, and lora_A saves the dropped-out tensor. Where the
    input was cast for lora_A anyway (bf16 bases: to the fp32 adapters; autocast: to its dtype), the
    saved copy replaces the cast one; where it was not (fp32 and upcast 4-bit bases, SFTTrainer's bf16
    adapters on a 4-bit base), it is new: the activations' bytes x the input width more."""
    shapes = linear_shapes(facts)
    names = list(shapes) if targets == "all-linear" else [n for n in targets.split(",") if n in shapes]
    copy = ACTIVATION_BYTES[activation_precision(precision, quantization, upcast)] \
        if quantization or precision == "fp32" else 0
    return (1 if checkpointing else facts.layers) * (1 + copy) * sum(shapes[name][0] for name in names)


def activation_precision(precision: str, quantization: str | None, upcast: bool = True) -> str:
    """The precision whose activations a run keeps: fp32 on a quantized base that prepare_model_for_kbit_training
    upcast (`upcast`; see the module docstring)."""
    return "fp32" if quantization and upcast else precision


def adapter_components(components: dict, facts: Facts, parameters: int, precision: str, optimizer_key: str,
                       r: int, targets: str, quantization: str | None, upcast: bool = True) -> dict:
    """A closed form's components with the base frozen (and quantized) and the adapters trained (`upcast`
    False: SFTTrainer's 4-bit base, not upcast, bf16 adapters)."""
    trainable = adapter_parameters(facts, r, targets)
    weight = WEIGHT_BYTES[activation_precision(precision, quantization, upcast)]
    if quantization and not upcast:
        weight = 2  # SFTTrainer casts the adapters of a quantized base to bf16
    state, temporaries = optimizer_bytes(optimizer_key, trainable, weight)
    parts = dict(components)
    parts.update(parameters=base_bytes(facts, parameters, precision, quantization, upcast) + trainable * weight,
                 gradients=trainable * weight, optimizer_state=state, optimizer_intermediates=temporaries)
    return parts
