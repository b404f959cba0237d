"""CPU tests of the dpo client (pipeline.measure.clients.dpo, TRL's DPOTrainer) through the sweep's child
machinery, as tests/test_measure_sft.py runs the sft client: real forked processes running real
DPOTrainer steps on the CPU (no allocator peaks there: the sizes of weights, optimizer state and
adapters are what can be checked). CUDA is never touched.
"""

from __future__ import annotations


import pytest
from conftest import pick
from test_measure_sft import ADAPTERS, TINY, tiny_cpu_sweep

from pipeline.training.points import POINT_KEY

pytestmark = pytest.mark.forks  # measuring children forked from this process (tests/conftest.py)

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def dpo_sweep(tmp_path_factory):
    """tiny-llama with DPOTrainer's defaults in bf16-autocast (checkpointing on) at two pair counts, then
    LoRA r=4 with half of each sequence a completion. Returns (jobs, frame)."""
    return tiny_cpu_sweep(tmp_path_factory, "dpo", [
        {"name": "dpo", "client": "dpo", "gradient_checkpointing": True, "models": [TINY],
         "grid": {"batch_sizes": [1, 2], "seq_lens": [16]}},
        {"name": "dpo lora", "client": "dpo", "gradient_checkpointing": True, "lora": {"r": 4},
         "completion_share": 0.5, "models": [TINY]}], processes=2)


def test_dpo_points_run_with_their_keys(dpo_sweep):
    jobs, frame = dpo_sweep
    assert [(job.client, job.adapters) for job in jobs] == [("dpo", False), ("dpo", True)]
    assert len(frame) == 3 and not frame.duplicated(list(POINT_KEY)).any()
    assert set(frame["status"]) == {"ok"}, frame["reason"].tolist()


def test_dpo_trains_the_policy_only(dpo_sweep):
    """bf16-autocast: bf16 weights; fused AdamW's two bf16 moments and a 4-byte step per tensor of the
    policy (the reference model has no optimizer state); B pairs are 2B sequences of L tokens but the
    row counts the pairs' tokens as the other clients count rows (B x L x K)."""
    _, frame = dpo_sweep
    row = pick(frame, client="dpo", batch_size=2, lora_r=None)
    n = row["parameters"]
    assert row["status"] == "ok" and row["precision"] == "bf16-autocast" and row["gradient_checkpointing"]
    assert 2 * n <= row["weights_bytes"] < 2 * n + 1024
    tensors = 2 * 9 + 2 + 1
    assert row["optimizer_state_bytes"] == 2 * 2 * n + 4 * tensors
    assert row["steps"] == 3


def test_dpo_lora_wraps_the_base_itself(dpo_sweep):
    """peft_config: DPOTrainer wraps a fresh bf16 base (the reference: adapters disabled); PEFT keeps the
    adapters in fp32."""
    _, frame = dpo_sweep
    row = pick(frame, client="dpo", lora_r=4)
    assert row["status"] == "ok" and row["completion_share"] == 0.5
    assert row["trainable_parameters"] == ADAPTERS
    assert row["optimizer_state_bytes"] == 2 * 4 * ADAPTERS + 4 * 2 * 7 * 2
