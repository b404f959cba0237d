"""Tests of the SFTTrainer simulator (pipeline.simulate.clients.sft), of bf16-autocast in the loop and Trainer
simulators, and of Liger's kernels under the Trainer clients: the real code on the meta device equal,
byte for byte in every phase, to a real CPU run of the same code under the same tracker (the method of
tests/test_simulate_trainer.py).

What the CPU reference runs differently from CUDA, as the meta run does: the Triton launches of TRL's
fused head and of Liger are no-ops (TRL's fold kernels compute their values by their torch fallbacks,
outside the tracker), and Liger's CUDA-only branches are taken (pipeline.simulate.kernels.paths); the
one op the CPU has no kernel for, `addmm(out_dtype=float32, out=...)`, sums outside the tracker.
"""

from __future__ import annotations

import pytest
from conftest import TINY_LLAMA, flat

from pipeline.core.errors import UserError
from pipeline.training.values import Run

pytest.importorskip("trl")

TINY_QWEN2 = dict(model_type="qwen2", vocab_size=640, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
PHASES = ("setup", "forward", "backward", "optimizer")


def run_sft(device: str, config: dict, precision: str, checkpointing: bool, lora: bool = False, share: float = 1.0,
            accumulation: int = 1, liger: bool = False, batch: int = 2, seq: int = 24) -> dict:
    import datasets
    import torch

    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build
    from pipeline.simulate.clients.sft import SFTRun, meta_sft_trainer
    from pipeline.simulate.clients.trainer import simulate_run
    from pipeline.training.adapters import AdapterSpec
    from pipeline.training.step import Setting

    datasets.disable_progress_bars()
    torch.manual_seed(0)
    model = build(config_from_dict(config), precision, "eager", device=device)
    setting = Setting(client="sft", gradient_checkpointing=checkpointing, gradient_accumulation=accumulation,
                      adapter=AdapterSpec.make(8) if lora else None, liger_kernel=liger, completion_share=share)
    trainer = meta_sft_trainer(model, setting, precision, batch, seq, device)
    return simulate_run(SFTRun(trainer, seq, precision, checkpointing, device))


def assert_same(real: dict, simulated: dict) -> None:
    for phase in PHASES:
        assert simulated["phase_peaks"][phase] == real["phase_peaks"][phase], phase
    assert simulated["peak_bytes"] == real["peak_bytes"]
    assert simulated["components"] == real["components"]
    assert simulated["optimizer_state_bytes"] == real["optimizer_state_bytes"]
    assert simulated["peak_reserved_bytes"] == real["peak_reserved_bytes"]


@pytest.mark.parametrize("config, precision, checkpointing, lora, share, accumulation", [
    (TINY_LLAMA, "bf16-autocast", True, False, 1.0, 1),  # SFTTrainer's defaults on a bf16 model
    (TINY_LLAMA, "amp-bf16", True, False, 1.0, 1),  # ... on the fp32 model it loads from a model id
    (TINY_LLAMA, "bf16-autocast", False, True, 0.5, 1),
    (TINY_LLAMA, "amp-bf16", False, False, 0.5, 2),
    (TINY_QWEN2, "bf16-autocast", True, True, 1.0, 2),  # tied embeddings
    (TINY_QWEN2, "amp-bf16", False, True, 1.0, 1),
])
def test_meta_sft_equals_real_cpu_sft(config, precision, checkpointing, lora, share, accumulation):
    """SFTTrainer's three steps on the meta device count what a real CPU run of the same SFTTrainer counts,
    in every phase, reserved bytes included."""
    real = run_sft("cpu", config, precision, checkpointing, lora, share, accumulation)
    simulated = run_sft("meta", config, precision, checkpointing, lora, share, accumulation)
    assert_same(real, simulated)


def test_a_larger_sft_model_with_liger_equals_the_cpu_run():
    """Layer activations above the fused head's tile buffer, Liger's RMSNorm / RoPE / SwiGLU wrappers
    (SFTTrainer keeps its own head: no fused linear cross-entropy), and a completion share of 0.7."""
    big = dict(TINY_LLAMA, hidden_size=256, intermediate_size=704, vocab_size=2048, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    real = run_sft("cpu", big, "bf16-autocast", False, True, 0.7, liger=True, seq=256)
    simulated = run_sft("meta", big, "bf16-autocast", False, True, 0.7, liger=True, seq=256)
    assert_same(real, simulated)
    assert real["peak_bytes"] == 148115456  # the prototype's validate.py, same case


def test_the_fused_head_scores_labelled_positions_only():
    """A completion share of 0.5 halves what the fused head scores. Its tile buffer is M x 32768 in bf16
    for M < 4096 labelled positions, however small the vocabulary (TRL's chunk is 32768 wide): 508
    positions (4 rows of 127 shifted labels) against 256 (the last 64 of each row), and per position
    less than 2 KiB more (the gathered hidden row, its fp32 and bf16 gradients, the statistics)."""
    full = run_sft("meta", TINY_LLAMA, "bf16-autocast", False, share=1.0, batch=4, seq=128)
    half = run_sft("meta", TINY_LLAMA, "bf16-autocast", False, share=0.5, batch=4, seq=128)
    tiles = (508 - 256) * 32768 * 2
    assert tiles < full["phase_peaks"]["backward"] - half["phase_peaks"]["backward"] < tiles + (508 - 256) * 2048


@pytest.mark.parametrize("precision, checkpointing", [("bf16-autocast", False), ("bf16-autocast", True)])
def test_bf16_autocast_loop_equals_real_cpu_loop(precision, checkpointing):
    """The standard step with bf16 weights under autocast: meta against a real CPU run."""
    import torch

    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build
    from pipeline.simulate.step import simulate_training_step

    results = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        model = build(config_from_dict(TINY_LLAMA), precision, "eager", device=device)
        results[device] = simulate_training_step(model, 2, 24, precision, "adamw", checkpointing, device_type=device)
    for phase in ("forward", "backward", "optimizer"):
        assert results["meta"]["phase_peaks"][phase] == results["cpu"]["phase_peaks"][phase], phase
    assert results["meta"]["saved_bytes"] == results["cpu"]["saved_bytes"]


@pytest.mark.parametrize("precision, liger, checkpointing", [("bf16-autocast", False, False),
                                                             ("bf16-autocast", True, False),
                                                             ("amp-bf16", True, True)])
def test_bf16_autocast_and_liger_trainer_equal_real_cpu_trainer(precision, liger, checkpointing):
    """transformers.Trainer with bf16=True on a bf16 model, and with use_liger_kernel=True (its fused
    linear cross-entropy included): meta against a real CPU run of the same Trainer."""
    import torch

    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build
    from pipeline.simulate.clients.trainer import simulate_trainer

    results = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        model = build(config_from_dict(TINY_LLAMA), precision, "eager", device=device)
        results[device] = simulate_trainer(model, 2, 24, precision, "adamw_torch_fused", 1, checkpointing,
                                           device_type=device, liger_kernel=liger)
    for phase in ("forward", "backward", "optimizer"):
        assert results["meta"]["phase_peaks"][phase] == results["cpu"]["phase_peaks"][phase], phase
    assert results["meta"]["peak_bytes"] == results["cpu"]["peak_bytes"]


def test_bf16_autocast_differs_from_bf16_where_autocast_runs_fp32_ops():
    """bf16 weights under autocast: no weight copies (llama's RMSNorm upcasts by itself: the same bytes
    as bf16), but a LayerNorm architecture keeps fp32 copies of its norms' inputs (gpt2)."""
    from conftest import TINY_GPT2

    from pipeline.simulate import loop_peak

    for config, same in ((TINY_LLAMA, True), (TINY_GPT2, False)):
        plain = loop_peak(config, Run(2, 64, "bf16"))
        autocast = loop_peak(config, Run(2, 64, "bf16-autocast"))
        assert (plain.details["saved_bytes"] == autocast.details["saved_bytes"]) is same
        assert plain.components["parameters"] == autocast.components["parameters"]


def test_out_calls_are_not_autocast():
    """CUDA registers autocast kernels for functional overloads only: `torch.addmm(acc, a, b,
    out_dtype=float32, out=acc)` keeps its fp32 accumulator under bf16 autocast (Liger's and TRL's dW
    accumulation), while `torch.addmm(acc, a, b)` is cast to bf16."""
    import torch

    from pipeline.training.autocast import CudaAutocast

    acc = torch.zeros(4, 4, device="meta")
    a = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    b = torch.empty(8, 4, dtype=torch.bfloat16, device="meta")
    with CudaAutocast("meta").autocast(torch.bfloat16):
        assert torch.addmm(acc, a, b).dtype == torch.bfloat16
        assert torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc).dtype == torch.float32


def test_sft_peak_answers_from_a_config_with_qlora():
    """sft_peak on a 4-bit base: SFTTrainer casts the adapters to bf16 (no prepare_model_for_kbit_training:
    the base's other weights stay bf16); its trainable parameters are the loop's QLoRA adapters."""
    from pipeline.simulate import simulate
    from pipeline.training.adapters import AdapterSpec

    spec = AdapterSpec.make(8, quantization="nf4")
    sft = simulate(TINY_LLAMA, Run(2, 24, "bf16-autocast", checkpointing=True, client="sft", adapter=spec))
    loop = simulate(TINY_LLAMA, Run(2, 24, "bf16", checkpointing=True, adapter=spec))
    assert sft.details["trainable_parameters"] == loop.details["trainable_parameters"] == 17920
    # bf16 adapters: two bf16 moments and a 4-byte step each (28 adapter tensors)
    assert sft.details["optimizer_state_bytes"] == 2 * 2 * 17920 + 4 * 28
    assert sft.components["parameters"] < loop.components["parameters"]  # no fp32 upcasts of norms and embeddings


@pytest.mark.parametrize("kwargs, message", [
    (dict(client="loop", completion_share=0.5), "completion_share is TRL's trainers' (sft, dpo), not the loop client's"),
    (dict(client="sft", completion_share=0.0), "completion_share must be a number in (0, 1]"),
    (dict(client="loop", liger_kernel=True), "liger_kernel is use_liger_kernel of the Trainer clients"),
    (dict(client="sft", optimizer="sgd"), "optimizer is the loop client's; the sft client takes optim"),
    (dict(client="sft", liger_kernel=1), "liger_kernel must be true or false, not 1"),
])
def test_bad_sft_runs_raise_user_error(kwargs, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        Run(2, 24, "bf16-autocast", **kwargs)


def test_sft_and_trainer_through_simulate_differ_by_the_logits():
    """The same model, batch and precision: the Trainer holds the (B, L, V) logits and their fp32
    gradients, SFTTrainer's fused head a bf16 tile of M x 32768 (M = 4 x 255 labelled positions) instead."""
    from pipeline.simulate import simulate

    big = dict(TINY_LLAMA, vocab_size=65536)
    sft = flat(simulate(big, Run(4, 256, "bf16-autocast", client="sft")))
    trainer = flat(simulate(big, Run(4, 256, "bf16-autocast", client="trainer")))
    assert trainer["peak_bytes"] - sft["peak_bytes"] > 4 * 256 * 65536 * 4 - 4 * 255 * 32768 * 2
