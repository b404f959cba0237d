"""CPU tests of the sft client (pipeline.measure.clients.sft, TRL's SFTTrainer) and of the Trainer
client in bf16-autocast, run through the sweep's child machinery as tests/test_measure_clients.py runs
the Trainer: real forked processes running real SFTTrainer steps on the CPU (no allocator peaks there:
the sizes of weights, optimizer state and adapters are what can be checked). CUDA is never touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import pick, run_cpu_sweep

from pipeline.core.errors import UserError
from pipeline.inputs.records import load_model_records
from pipeline.measure import sweep
from pipeline.training.points import POINT_KEY
from pipeline.training.step import Setting

pytestmark = pytest.mark.forks  # measuring children forked from this process (tests/conftest.py)

pytest.importorskip("trl")

REPO = Path(__file__).resolve().parent.parent
TINY = "test/tiny-llama"
TINY_CONFIG = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
GRID = {"batch_sizes": [1], "seq_lens": [16]}
# LoRA r=4 on every linear of a layer: q (32->32), k and v (32->16), o (32->32), gate and up (32->64), down (64->32)
ADAPTERS = 2 * 4 * ((32 + 32) + 2 * (32 + 16) + (32 + 32) + 2 * (32 + 64) + (64 + 32))


@pytest.fixture(scope="module")
def sft_sweep(tmp_path_factory):
    """tiny-llama with SFTTrainer's defaults in bf16-autocast (checkpointing on) at two batch sizes, without
    checkpointing at K=2, LoRA r=4 with half of each row's positions labelled, Liger (skipped: no GPU),
    and the Trainer in bf16-autocast. Returns (jobs, frame)."""
    return tiny_cpu_sweep(tmp_path_factory, "sft", [
        {"name": "sft", "client": "sft", "gradient_checkpointing": True, "models": [TINY],
         "grid": {"batch_sizes": [1, 2], "seq_lens": [16]}},
        {"name": "sft K=2", "client": "sft", "gradient_accumulation": 2, "models": [TINY]},
        {"name": "sft lora", "client": "sft", "gradient_checkpointing": True, "lora": {"r": 4},
         "completion_share": 0.5, "models": [TINY]},
        {"name": "sft liger", "client": "sft", "gradient_checkpointing": True, "liger_kernel": True,
         "models": [TINY]},
        {"name": "trainer", "client": "trainer", "models": [TINY]}], processes=3)


def tiny_cpu_sweep(tmp_path_factory, name: str, variants: list, processes: int):
    """The sweep of `variants` (bf16-autocast) on tiny-llama in real forked processes on the CPU, each of its
    `processes` finished. Returns (jobs, the aggregated frame)."""
    configs = {TINY: {"family": "test", "model_type": "llama", "status": "ok", "reason": None,
                      "config_source": "embedded", "config_revision": None, "config": TINY_CONFIG}}
    path = tmp_path_factory.mktemp("configs") / "configs.json"
    path.write_text(json.dumps(configs))
    plan = {"grid": GRID, "precisions": ["bf16-autocast"], "models": [], "variants": variants}
    return run_cpu_sweep(tmp_path_factory, path, plan, name, processes)


def test_sft_points_have_their_own_processes_and_keys(sft_sweep):
    jobs, frame = sft_sweep
    assert [(job.client, job.adapters, job.name.split("__", 3)[-1]) for job in jobs] == [
        ("trainer", False, "trainer"), ("sft", False, "sft"), ("sft", True, "sft__adapters")]
    assert len(frame) == 6 and not frame.duplicated(list(POINT_KEY)).any()
    assert set(frame["status"]) == {"ok", "skipped"}


def test_sft_rows_hold_bf16_weights_and_state(sft_sweep):
    """bf16-autocast: bf16 weights (2 bytes each, plus the rotary buffer) and fused AdamW's two bf16
    moments and a 4-byte step per parameter (on the device for the fused optimizer)."""
    _, frame = sft_sweep
    row = pick(frame, client="sft", batch_size=2, lora_r=None)
    n = row["parameters"]
    assert row["status"] == "ok" and row["precision"] == "bf16-autocast" and row["gradient_checkpointing"]
    assert row["optim"] == "adamw_torch_fused" and row["completion_share"] == 1.0 and not row["liger_kernel"]
    assert 2 * n <= row["weights_bytes"] < 2 * n + 1024
    tensors = 2 * 9 + 2 + 1  # per layer 7 linears + 2 norms, the embedding, the final norm, the head (untied)
    assert row["optimizer_state_bytes"] == 2 * 2 * n + 4 * tensors
    assert row["tokens"] == 2 * 16 and row["steps"] == 3


def test_sft_accumulates_and_the_model_comes_back_unpatched(sft_sweep):
    """Two SFTTrainer points in one process: the second (K=2, no checkpointing) runs on the model the
    first left, with the same state as a first point would have."""
    _, frame = sft_sweep
    first = pick(frame, client="sft", batch_size=1, gradient_checkpointing=True, lora_r=None, liger_kernel=False)
    accumulating = pick(frame, client="sft", gradient_accumulation=2)
    assert first["child_pid"] == accumulating["child_pid"]
    assert accumulating["status"] == "ok" and accumulating["tokens"] == 32
    assert accumulating["optimizer_state_bytes"] == first["optimizer_state_bytes"]


def test_sft_lora_wraps_the_base_itself_with_a_completion_mask(sft_sweep):
    """peft_config: SFTTrainer wraps a fresh bf16 base; PEFT keeps the adapters in fp32 (fused AdamW:
    two fp32 moments and a step per adapter tensor)."""
    _, frame = sft_sweep
    row = pick(frame, client="sft", lora_r=4)
    assert row["status"] == "ok" and row["completion_share"] == 0.5 and row["lora_targets"] == "all-linear"
    assert row["trainable_parameters"] == ADAPTERS
    assert row["optimizer_state_bytes"] == 2 * 4 * ADAPTERS + 4 * 2 * 7 * 2
    assert row["parameters"] == pick(frame, client="sft", batch_size=2, lora_r=None)["parameters"]


def test_liger_points_are_skipped_without_a_gpu(sft_sweep):
    _, frame = sft_sweep
    row = pick(frame, client="sft", liger_kernel=True)
    assert row["status"] == "skipped"
    assert row["reason"] == "liger_kernel runs Triton kernels, which need a CUDA device, not cpu"


def test_trainer_in_bf16_autocast_keeps_bf16_weights(sft_sweep):
    _, frame = sft_sweep
    row = pick(frame, client="trainer")
    n = row["parameters"]
    assert row["status"] == "ok" and row["precision"] == "bf16-autocast"
    assert 2 * n <= row["weights_bytes"] < 2 * n + 1024


@pytest.mark.parametrize("variant, message", [
    ({"client": "sft", "completion_share": 1.5}, "completion_share must be a number in (0, 1], not 1.5"),
    ({"client": "sft", "completion_share": "half"}, "completion_share must be a number in (0, 1], not 'half'"),
    ({"client": "trainer", "completion_share": 0.5}, "completion_share is TRL's trainers' (sft, dpo), not the trainer client's"),
    ({"liger_kernel": True}, "liger_kernel is use_liger_kernel of the Trainer clients (trainer, sft, dpo, grpo, rloo), not of the loop"),
    ({"client": "sft", "liger_kernel": "yes"}, "liger_kernel must be true or false, not 'yes'"),
    ({"client": "sft", "optimizer": "sgd"}, "optimizer is the loop client's; the sft client takes optim"),
])
def test_bad_sft_settings_are_one_line_errors(variant, message):
    with pytest.raises(UserError) as info:
        sweep.parse_plan({"grid": GRID, "variants": [{"models": [TINY], **variant}]}, "plan.yaml")
    assert str(info.value).startswith(f"plan.yaml: variants[0]: {message}") and "\n" not in str(info.value)


def test_sft_defaults_and_its_overhead_in_the_estimate(tmp_path):
    plan = sweep.parse_plan({"grid": GRID, "models": [], "precisions": ["bf16-autocast"],
                             "variants": [{"client": "sft", "models": [TINY]}]})
    assert plan.groups[1].setting == Setting(client="sft", optim="adamw_torch_fused")
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps({TINY: {"family": "test", "model_type": "llama", "status": "ok",
                                          "config": TINY_CONFIG}}))
    records, _ = load_model_records(configs, [TINY])
    estimate = sweep.TimeModel(trainer_point_overhead_seconds=1.5)
    loop = sweep.point_seconds(records[TINY], sweep.Point(Setting(), 1, 16), "bf16-autocast", estimate)
    sft = sweep.point_seconds(records[TINY], sweep.Point(Setting(client="sft"), 1, 16), "bf16-autocast", estimate)
    assert sft == pytest.approx(loop + 1.5)


def test_every_committed_sft_plan_parses():
    """The SFT plans (and their QLoRA part) name registry models and valid settings."""
    for name in ("sweep_sft.yaml", "sweep_sft_heldout.yaml", "sweep_sft_qlora.yaml"):
        plan = sweep.load_plan(REPO / "config" / name)
        assert plan.models, name
        assert {g.setting.client for g in plan.groups[1:]} <= {"sft", "trainer"}, name
        assert yaml.safe_load((REPO / "config" / name).read_text())["gpu_memory_gib"] == 79.1


def test_a_second_sft_point_on_the_same_model_runs_as_the_first():
    """SFTTrainer patches the model it is given (its fused LM head as the model's forward, accelerate's
    autocast wrapper, checkpointing): the client takes it all off, so a second point of the process
    counts what the first counted (live bytes on the CPU, by the simulator's tracker)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pipeline.measure.clients import sft as client
    from pipeline.measure.clients.tracking import PhaseTracker
    from pipeline.simulate.memory.tracker import LiveBytesTracker

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in TINY_CONFIG.items() if k != "model_type"}))
    model.to(torch.bfloat16)
    before = dict(vars(model))

    def peak() -> int:
        tracker = LiveBytesTracker("cpu")
        for parameter in model.parameters():
            tracker.track(parameter, "parameters")
        with tracker:
            client.run_steps(model, Setting(client="sft", gradient_checkpointing=True), "bf16-autocast", 2, 16,
                             "cpu", PhaseTracker("cpu"), False)
        return tracker.peaks["total"].total

    assert peak() == peak()
    assert vars(model).keys() == before.keys() and not model.is_gradient_checkpointing
