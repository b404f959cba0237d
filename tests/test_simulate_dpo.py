"""Tests of the DPOTrainer simulator (pipeline.simulate.clients.dpo, client dpo): TRL 1.16's real DPOTrainer on the
meta device equal, byte for byte in every phase, to a real CPU run of the same DPOTrainer under the same
trace (the method of tests/test_simulate_sft.py), with a reference model beside the policy or, with
LoRA, the base with its adapters disabled; and what a step holds that SFTTrainer's does not.
"""

from __future__ import annotations

import pytest
from conftest import TINY_LLAMA

from pipeline.core.errors import UserError
from pipeline.training.values import Run

pytest.importorskip("trl")

TINY_QWEN2 = dict(model_type="qwen2", vocab_size=640, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
PHASES = ("setup", "forward", "backward", "optimizer")


def run_dpo(device: str, config: dict, precision: str, checkpointing: bool, lora: bool = False, share: float = 1.0,
            accumulation: int = 1, batch: int = 2, seq: int = 24) -> dict:
    import datasets
    import torch

    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build
    from pipeline.simulate.clients.dpo import DPORun, meta_dpo_trainer
    from pipeline.simulate.clients.trainer import simulate_run, trainer_trace
    from pipeline.training.adapters import AdapterSpec
    from pipeline.training.dpo import reference_model
    from pipeline.training.step import Setting

    datasets.disable_progress_bars()
    torch.manual_seed(0)
    model = build(config_from_dict(config), precision, "eager", device=device)
    setting = Setting(client="dpo", gradient_checkpointing=checkpointing, gradient_accumulation=accumulation,
                      adapter=AdapterSpec.make(8) if lora else None, completion_share=share)
    trace = trainer_trace(device)
    trainer = meta_dpo_trainer(model, reference_model(model, setting, device), setting, precision, batch, seq, device,
                               trace.rules)
    return simulate_run(DPORun(trainer, seq, precision, checkpointing, device), trace=trace)


def assert_same(real: dict, simulated: dict) -> None:
    for phase in PHASES:
        assert simulated["phase_peaks"][phase] == real["phase_peaks"][phase], phase
    for key in ("peak_bytes", "components", "optimizer_state_bytes", "peak_reserved_bytes",
                "peak_reserved_expandable_bytes"):
        assert simulated[key] == real[key], key


@pytest.mark.parametrize("config, precision, checkpointing, lora, share, accumulation", [
    (TINY_LLAMA, "bf16-autocast", True, False, 1.0, 1),  # DPOTrainer's defaults on a bf16 model: a reference copy
    (TINY_LLAMA, "amp-bf16", True, True, 1.0, 1),  # LoRA: the base with adapters disabled is the reference
    (TINY_LLAMA, "amp-bf16", False, False, 0.5, 2),
    (TINY_QWEN2, "bf16-autocast", True, True, 0.5, 1),  # tied embeddings
])
def test_meta_dpo_equals_real_cpu_dpo(config, precision, checkpointing, lora, share, accumulation):
    """DPOTrainer's three steps on the meta device count what a real CPU run of the same DPOTrainer counts,
    in every phase, reserved bytes included."""
    real = run_dpo("cpu", config, precision, checkpointing, lora, share, accumulation)
    simulated = run_dpo("meta", config, precision, checkpointing, lora, share, accumulation)
    assert_same(real, simulated)


def test_a_reference_copy_doubles_the_weights_and_adapters_need_none():
    """Full fine-tuning holds the policy and its reference copy (parameters twice the policy's weights);
    LoRA's reference is the frozen base itself."""
    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build
    from pipeline.simulate.clients.dpo import dpo_peak
    from pipeline.training.adapters import AdapterSpec

    weights = sum(p.untyped_storage().nbytes() for p in build(config_from_dict(TINY_LLAMA), "bf16", device="meta").parameters())
    full = dpo_peak(TINY_LLAMA, Run(2, 24, "bf16-autocast", checkpointing=True, client="dpo", fresh_process=False))
    lora = dpo_peak(TINY_LLAMA, Run(2, 24, "bf16-autocast", checkpointing=True, client="dpo",
                                    adapter=AdapterSpec.make(8), fresh_process=False))
    assert 2 * weights <= full.components["parameters"] < 2 * weights + 8192  # and buffers (RoPE's inverse frequencies)
    assert weights <= lora.components["parameters"] < full.components["parameters"]
    assert lora.details["trainable_parameters"] > 0


def test_a_pair_is_two_sequences():
    """B preference pairs run 2B sequences: DPO at B pairs holds more activations than SFT at B rows."""
    from pipeline.simulate.clients.dpo import dpo_peak
    from pipeline.simulate.clients.sft import sft_peak

    dpo = dpo_peak(TINY_LLAMA, Run(4, 64, "bf16-autocast", checkpointing=False, client="dpo", fresh_process=False))
    sft = sft_peak(TINY_LLAMA, Run(4, 64, "bf16-autocast", checkpointing=False, client="sft", fresh_process=False))
    assert dpo.components["activations"] > sft.components["activations"]


@pytest.mark.parametrize("kwargs, message", [(dict(client="trainer"), "client dpo"),
                                             (dict(optimizer="adamw"), "optim")])
def test_bad_runs_are_one_line(kwargs, message):
    from pipeline.simulate.clients.dpo import dpo_peak

    with pytest.raises(UserError, match=message):
        dpo_peak(TINY_LLAMA, Run(**dict(dict(batch=1, seq=8, precision="bf16-autocast", client="dpo"), **kwargs)))


def test_estimate_answers_dpo_by_the_exact_method_only(capsys):
    """`estimate(client="dpo")` (and `estimate --client dpo`): TRL's defaults (checkpointing, bf16 autocast
    with the weights' dtype) and the DPO simulator; the closed forms do not know DPO yet."""
    from pipeline.cli import main
    from pipeline.estimate import estimate

    result = estimate(config=TINY_LLAMA, batch=1, seq=16, client="dpo", method="exact", weights_dtype="bf16")
    assert result["client"] == "dpo" and result["checkpointing"] and result["precision"] == "bf16-autocast"
    assert "dpo_peak" in result["notes"][0] and result["peak_bytes"] > 0
    with pytest.raises(UserError, match="client dpo is estimated by the exact method only"):
        estimate(config=TINY_LLAMA, batch=1, seq=16, client="dpo", method="formula", weights_dtype="bf16")
    assert main(["estimate", "--params", "1000000", "--batch", "1", "--seq", "16", "--client", "dpo",
                 "--precision", "bf16-autocast", "--method", "heuristic"]) == 2
    assert "exact method only" in capsys.readouterr().err
    unnamed = estimate(config=TINY_LLAMA, batch=1, seq=16, client="dpo", weights_dtype="bf16")  # no method: exact
    assert unnamed["method"] == "exact" and unnamed["peak_bytes"] == result["peak_bytes"]
