"""Tests of the Trainer client's simulator (pipeline.simulate.trainer): the real transformers.Trainer
code under the live-byte tracker, on the meta device equal to a real CPU run, and against a
committed H100 measurement."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import UserError

REPO = Path(__file__).resolve().parent.parent
TINY_LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def run_trainer(device: str, precision: str, optim: str, accumulation: int = 1, checkpointing: bool = False) -> dict:
    import torch

    from pipeline.configs import config_from_dict
    from pipeline.modeling import build
    from pipeline.simulate.trainer import simulate_trainer

    torch.manual_seed(0)
    model = build(config_from_dict(TINY_LLAMA), precision, "eager", device=device)
    return simulate_trainer(model, 2, 24, precision, optim, accumulation, checkpointing, device_type=device)


@pytest.mark.parametrize("precision,optim,accumulation", [("fp32", "adamw_torch_fused", 1),
                                                          ("fp32", "adamw_torch_fused", 2), ("bf16", "sgd", 1)])
def test_meta_trainer_equals_real_cpu_trainer(precision, optim, accumulation):
    """The Trainer's three steps on the meta device count what a real CPU run of the same code counts."""
    real = run_trainer("cpu", precision, optim, accumulation)
    simulated = run_trainer("meta", precision, optim, accumulation)
    for phase in ("forward", "backward", "optimizer"):
        assert simulated["phase_peaks"][phase] == real["phase_peaks"][phase], phase
    assert simulated["optimizer_state_bytes"] == real["optimizer_state_bytes"]  # sgd: none (momentum 0)
    assert simulated["peak_bytes"] == real["peak_bytes"]
    # (adamw_torch is left out: its `step` counters are host tensors, which a CPU run cannot tell apart)


def test_fused_adamw_state_is_two_moments_and_device_steps():
    """adamw_torch_fused on meta: exp_avg and exp_avg_sq per parameter plus a 0-dim fp32 step each."""
    import torch

    from pipeline.configs import config_from_dict
    from pipeline.modeling import build

    model = build(config_from_dict(TINY_LLAMA), "fp32", "eager", device="meta")
    params = [p for p in model.parameters() if p.requires_grad]
    expected = sum(2 * p.numel() * 4 for p in params) + 4 * len(params)
    result = run_trainer("meta", "fp32", "adamw_torch_fused")
    assert result["optimizer_state_bytes"] == expected
    from torch.optim import optimizer

    assert "meta" not in optimizer._get_fused_kernels_supported_devices()  # restored


def test_gpt2_prediction_matches_the_committed_h100_row():
    """openai-community/gpt2, B=4, L=512, amp-bf16, adamw_torch_fused (results/trainer/h100)."""
    import pandas as pd

    from pipeline.configs import load_configs
    from pipeline.simulate.trainer import predict_trainer_peak

    peaks = pd.read_parquet(REPO / "results/trainer/h100/peak_memory.parquet")
    row = peaks[(peaks["model_id"] == "openai-community/gpt2") & (peaks["client"] == "trainer")
                & (peaks["optim"] == "adamw_torch_fused") & (peaks["precision"] == "amp-bf16")
                & (peaks["batch_size"] == 4) & (peaks["seq_len"] == 512) & (peaks["gradient_accumulation"] == 1)
                & ~peaks["gradient_checkpointing"]].iloc[0]
    assert row["peak_allocated_bytes"] == 4711264768
    config = load_configs(REPO / "results/configs.json")["openai-community/gpt2"].config
    result = predict_trainer_peak(config, 4, 512, "amp-bf16", "adamw_torch_fused")
    assert result["peak_bytes"] == 4712725504  # +0.03%
    assert abs(result["peak_bytes"] / row["peak_allocated_bytes"] - 1) < 0.005
    assert result["peak_phase"] == "backward"


@pytest.mark.parametrize("kwargs,message", [(dict(optim="lion"), "optim"), (dict(precision="amp-fp16"), "fp16"),
                                            (dict(gradient_accumulation=0), "gradient_accumulation")])
def test_bad_arguments_raise_user_error(kwargs, message):
    from pipeline.simulate.trainer import predict_trainer_peak

    with pytest.raises(UserError, match=message):
        predict_trainer_peak(TINY_LLAMA, **dict(dict(batch_size=1, seq_len=8), **kwargs))
