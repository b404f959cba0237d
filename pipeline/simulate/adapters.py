"""LoRA and QLoRA under the simulator: PEFT's own wrapping (`pipeline.training.adapters.apply_adapters`) of a
meta model of its own (the shared meta model cache stays unwrapped: PEFT wraps modules in place).

LoRA: a meta model built for it (as the cache builds its own), then peft.get_peft_model; frozen weights get no
gradients and no optimizer state because the step's optimizer takes the trainable parameters only.

QLoRA (nf4): the 4-bit base as transformers' bitsandbytes integration makes it, on the meta device:
`transformers.integrations.bitsandbytes.replace_with_bnb_linear` swaps every nn.Linear but the
output head for bnb.nn.Linear4bit (the real integration, the real classes); then each weight becomes
what loading quantizes it into, without values: a bnb `Params4bit` over a meta uint8 tensor of the
packed size ((out*in+1)//2, 1), with a real `QuantState` whose absmax (fp32, one per 64-element
block) and code (the 16 NF4 values, fp32) are meta tensors, dtype the compute dtype. This is the one
stand-in: the quantization itself (values) does not run; the shapes and allocations are those that
`Params4bit._quantize` makes on CUDA (`bitsandbytes.functional.quantize_4bit`: packed, absmax,
code; no nested statistics with bnb_4bit_use_double_quant=False). The model is marked
`is_loaded_in_4bit`, so PEFT's real `prepare_model_for_kbit_training` (fp32 upcasts of every other
weight, enable_input_require_grads and checkpointing) and PEFT's bnb LoRA layers run as on the GPU.
The 4-bit matmul runs bitsandbytes' own code (MatMul4Bit) on the ops' registered fake kernels;
CUDA's gemm_4bit scratch (the dequantized weight of its dequantize+linear fallback) is a kernel rule
(`pipeline.simulate.kernels.cuda`), and the backward's dequantized copy is a real op output, counted as is.

int8 (LLM.int8, Linear8bitLt) is not simulated yet: a UserError says so.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import replace

from pipeline.core.errors import UserError


def check_adapter(adapter, variant: str) -> None:
    from pipeline.training.adapters import AdapterSpec

    if not isinstance(adapter, AdapterSpec):
        raise UserError(f"adapter must be an AdapterSpec, not {type(adapter).__name__}")
    if variant != "standard":
        raise UserError("adapters (lora, qlora) train with the standard variant only")
    if adapter.quantization == "int8":
        raise UserError("the simulator does not model 8-bit (int8) bases yet; nf4 is")


@functools.lru_cache(maxsize=2)
def cached_adapter_model(config_json: str, precision: str, attn_implementation: str | None, adapter,
                         gradient_checkpointing: bool):
    """The PeftModel on the meta device, built once per (config, precision, attention, adapter, checkpointing)."""
    from pipeline.training.adapters import apply_adapters

    model = fresh_base_model(config_json, precision, attn_implementation, adapter.quantization, adapter.quant_storage)
    return apply_adapters(model, adapter, gradient_checkpointing)


def fresh_base_model(config_json: str, precision: str, attn_implementation: str | None, quantization: str | None,
                     quant_storage: str = "uint8"):
    """A model on the meta device built anew (in the precision's dtype; `quantization` nf4: its 4-bit
    base stored in `quant_storage`, `quantize_on_meta`), for a client that wraps or patches the model it is given
    (SFTTrainer)."""
    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build
    from pipeline.training.adapters import AdapterSpec

    config = config_from_dict(json.loads(config_json))
    try:
        model = build(config, precision, attn_implementation or "default", device="meta")
    except Exception as exc:  # noqa: BLE001 - transformers rejects some configs / attention choices
        raise UserError(f"the model cannot be built from this config: {type(exc).__name__}: "
                        f"{(str(exc).strip().splitlines() or [''])[0]}"[:300]) from None
    if quantization:
        quantize_on_meta(model, replace(AdapterSpec.make(8, quantization=quantization), quant_storage=quant_storage))
    return model


def quantization_config(adapter):
    from pipeline.training.adapters import quantization_config as make

    return make(adapter)


def quantize_on_meta(model, adapter) -> None:
    """The 4-bit base (see the module docstring) in place of `model`'s linear layers, by transformers'
    own bnb quantizer (its modules to keep unquantized, replace_with_bnb_linear, the flags it sets)."""
    from transformers.quantizers import AutoHfQuantizer

    config = quantization_config(adapter)
    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
    quantizer._process_model_before_weight_loading(model, device_map=None)
    for module in model.modules():
        if type(module).__name__ == "Linear4bit":
            module.weight = packed_weight(module, config)
    quantizer._process_model_after_weight_loading(model)
    model.hf_quantizer = quantizer
    model.config.quantization_config = config


def packed_weight(module, config):
    """A Params4bit of the packed size with its QuantState, all on the meta device."""
    import torch
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Params4bit

    out_features, in_features = module.out_features, module.in_features
    numel = out_features * in_features
    blocksize = module.weight.blocksize
    state = QuantState(absmax=torch.empty((numel + blocksize - 1) // blocksize, dtype=torch.float32, device="meta"),
                       shape=torch.Size((out_features, in_features)),
                       code=torch.empty(16, dtype=torch.float32, device="meta"), blocksize=blocksize,
                       quant_type=config.bnb_4bit_quant_type, dtype=config.bnb_4bit_compute_dtype)
    storage = config.bnb_4bit_quant_storage
    data = torch.empty(((numel + 1) // (2 * storage.itemsize), 1), dtype=storage, device="meta")  # quantize_4bit's
    module.quant_state = state  # as Params4bit's quantization leaves it (FSDP's gathered weights recover it there)
    return Params4bit(data, requires_grad=False, quant_state=state, blocksize=blocksize,
                      compress_statistics=config.bnb_4bit_use_double_quant, quant_type=config.bnb_4bit_quant_type,
                      quant_storage=storage, module=module, bnb_quantized=True)


def loaded_from_checkpoint(model, tracker):
    """`model`, a 4-bit base built outside the trace, counted by `tracker` as `from_pretrained` loads it on
    a GPU (transformers 5.17, bitsandbytes 0.50; measured on an H100, Llama-3.2-1B: the same blocks in the
    same order): `caching_allocator_warmup` takes one block of the loaded model's size (4-bit weights at half
    a byte an element, the rest at their size; `torch.empty` in fp16) and frees it; then each weight in the
    checkpoint's (sorted) key order: a 4-bit one arrives whole in the model's dtype, `quantize_4bit` makes
    its absmax, packed data and code, and the whole copy goes; the others stay as they arrive."""
    import torch
    from bitsandbytes.nn import Params4bit

    weights = sorted(model.named_parameters(), key=lambda item: item[0])
    dtype = next((w.dtype for _, w in weights if not isinstance(w, Params4bit)), torch.bfloat16)
    size = sum(w.quant_state.shape.numel() // 2 if isinstance(w, Params4bit) else w.numel() * w.element_size()
               for _, w in weights)
    warmup = torch.empty(size // 2, dtype=torch.float16, device="meta")
    del warmup
    arrived = []  # a 4-bit weight as it arrives, until it is quantized
    for _, weight in weights:
        if isinstance(weight, Params4bit):
            arrived.append(torch.empty(weight.quant_state.shape, dtype=dtype, device="meta"))
            for tensor in (weight.quant_state.absmax, weight, weight.quant_state.code):
                tracker.track(tensor, "parameters")
            arrived.clear()
        else:
            tracker.track(weight, "parameters")
    return model


def quantization_state(model) -> list:
    """The tensors a quantized base keeps beside its packed weights (bitsandbytes' QuantState:
    absmax per block, the code; Int8Params' row scales), allocated with the weights."""
    tensors = []
    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        while state is not None:
            tensors += [t for t in (getattr(state, "absmax", None), getattr(state, "code", None),
                                    getattr(state, "offset", None)) if t is not None and hasattr(t, "device")]
            state = getattr(state, "state2", None)
        scales = getattr(param, "SCB", None)
        if scales is not None:
            tensors.append(scales)
    return tensors


def fresh_adapter_model(config_json: str, precision: str, attn_implementation: str | None, adapter,
                        gradient_checkpointing: bool):
    """The PeftModel of `cached_adapter_model`, new at every call (`predict.run_model`'s `anew`, outside a
    trace): the Trainer switches checkpointing and wraps the forward of the model it trains, which a
    cached model would keep. A deep copy of one that no step has run on (a fifth of a build for a 7B
    model); a quantized base is built anew (bitsandbytes' 4-bit parameters on the meta device cannot be
    deep-copied)."""
    if adapter.quantization:
        return cached_adapter_model.__wrapped__(config_json, precision, attn_implementation, adapter,
                                                gradient_checkpointing)
    return copy.deepcopy(untouched_adapter_model(config_json, precision, attn_implementation, adapter,
                                                 gradient_checkpointing))


@functools.lru_cache(maxsize=2)
def untouched_adapter_model(config_json: str, precision: str, attn_implementation: str | None, adapter,
                            gradient_checkpointing: bool):
    """A PeftModel as `cached_adapter_model` builds it, never trained: what `fresh_adapter_model` copies."""
    return cached_adapter_model.__wrapped__(config_json, precision, attn_implementation, adapter,
                                            gradient_checkpointing)
