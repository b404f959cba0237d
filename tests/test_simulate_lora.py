"""The simulator with LoRA and QLoRA adapters (pipeline.simulate.adapters): PEFT's own wrapping on the
meta device must agree byte for byte with the same step run for real on the CPU with real weights
(the same tracker and rules): LoRA on a bf16 base and on an fp32 base under bf16 autocast, QLoRA
on a real NF4 base quantized by bitsandbytes on the CPU (loaded by transformers from a saved
random init) against the meta stand-in of its packed weights, checkpointing on and off."""

from __future__ import annotations

import pytest
from conftest import TINY_LLAMA, flat

from pipeline.training.adapters import AdapterSpec
from pipeline.core.errors import UserError
from pipeline.training.values import Run

KEYS = ("peak_bytes", "phase_peaks", "components", "saved_bytes", "optimizer_state_bytes")


def real_cpu_step(spec: AdapterSpec, precision: str, checkpointing: bool, bases) -> dict:
    import torch

    from pipeline.training.adapters import apply_adapters, build_adapter_model
    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build
    from pipeline.simulate.step import simulate_training_step

    torch.manual_seed(0)
    config = config_from_dict(dict(TINY_LLAMA))
    if spec.quantization:
        model = build_adapter_model(config, "test/tiny-llama", spec, precision, "eager", "cpu", checkpointing)
    else:
        model = apply_adapters(build(config, precision, "eager", device="cpu"), spec, checkpointing)
    return simulate_training_step(model, 2, 24, precision, gradient_checkpointing=checkpointing, device_type="cpu")


@pytest.fixture
def bases(tmp_path, monkeypatch):
    monkeypatch.setenv("AVP_ADAPTER_BASES", str(tmp_path))


@pytest.mark.parametrize("spec", [AdapterSpec.make(8), AdapterSpec.make(16, targets="q_proj,v_proj"),
                                  AdapterSpec.make(8, quantization="nf4")], ids=["lora", "lora-qv", "qlora"])
@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_meta_simulation_equals_real_cpu_step(spec, precision, checkpointing, bases):
    from pipeline.simulate import loop_peak

    real = real_cpu_step(spec, precision, checkpointing, bases)
    # the real step runs on a model built before it: a process past its first point (fresh_process=False)
    simulated = flat(loop_peak(TINY_LLAMA, Run(2, 24, precision, checkpointing=checkpointing, attn_implementation="eager",
                                               adapter=spec, fresh_process=False)))
    for key in KEYS:
        assert simulated[key] == real[key], key
    assert real["components"]["optimizer_state"] > 0 and real["saved_bytes"] > 0
    assert simulated["trainable_parameters"] == 2 * spec.r * (
        (64 + 64) * 2 + (64 + 32) * 2 + (64 + 160) * 3 if spec.targets == "all-linear" else (64 + 64) + (64 + 32))


def test_qlora_base_on_meta_is_packed_and_upcast():
    """The meta QLoRA base: every linear but the head a Params4bit of (out*in/2, 1) uint8 with an fp32
    absmax per 64 weights; embeddings, norms and head upcast to fp32 by prepare_model_for_kbit_training;
    only the adapters train. The shared meta model cache is left unwrapped."""
    import torch

    from pipeline.simulate.adapters import cached_adapter_model
    from pipeline.simulate.predict import as_config, cached_meta_model, config_key

    key = config_key(as_config(dict(TINY_LLAMA)))
    model = cached_adapter_model(key, "bf16", None, AdapterSpec.make(8, quantization="nf4"), False)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert type(q_proj.weight).__name__ == "Params4bit"
    assert (tuple(q_proj.weight.shape), q_proj.weight.dtype) == ((64 * 64 // 2, 1), torch.uint8)
    assert q_proj.weight.quant_state.absmax.shape == (64 * 64 // 64,)
    others = {p.dtype for n, p in model.named_parameters() if "lora_" not in n and type(p).__name__ != "Params4bit"}
    assert others == {torch.float32}
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    assert type(model.get_output_embeddings()).__name__ == "Linear"
    plain = cached_meta_model(key, "bf16", None)
    assert not any("lora_" in n for n, _ in plain.named_parameters())
    assert {p.dtype for p in plain.parameters()} == {torch.bfloat16}


def test_cuda_gemm_4bit_dequantizes_the_weight_where_bitsandbytes_falls_back():
    """bitsandbytes' own sm90 heuristic: its kernel for a few rows, dequantize + linear beyond (a bf16
    copy of the whole weight, scratch inside the op)."""
    import torch

    from pipeline.simulate.kernels.bnb import gemm_4bit_workspace

    def scratch(rows):
        a = torch.empty(rows, 2048, dtype=torch.bfloat16, device="meta")
        return gemm_4bit_workspace((a, None, [4096, 2048], None, 64, "nf4"), {}, None)

    assert scratch(4) == []
    assert scratch(2048) == scratch(512) == [4096 * 2048 * 2]


def test_adapter_bad_input_is_one_line():
    from pipeline.simulate import loop_peak

    with pytest.raises(UserError, match="its linear modules are down_proj, gate_proj"):
        loop_peak(TINY_LLAMA, Run(1, 8, "bf16", adapter=AdapterSpec.make(8, targets="c_attn")))
    with pytest.raises(UserError, match="int8"):
        loop_peak(TINY_LLAMA, Run(1, 8, "bf16", adapter=AdapterSpec.make(8, quantization="int8")))
    with pytest.raises(UserError, match="AdapterSpec"):
        loop_peak(TINY_LLAMA, Run(1, 8, "bf16", adapter={"r": 8}))
