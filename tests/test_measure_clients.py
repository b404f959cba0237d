"""CPU tests of the clients (pipeline.measure.clients): transformers.Trainer run through the sweep's child
machinery, amp-fp16 in the loop, the plan's client keys, and tables written before the client
columns existed.

The children are real forked processes running real training steps on the CPU (no allocator
peaks there: sizes of weights and optimizer state are what can be checked). CUDA is never touched.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import pick, run_cpu_sweep

from pipeline.inputs.records import load_model_records
from pipeline.measure import sweep
from pipeline.core.errors import UserError
from pipeline.training.points import COLUMNS, POINT_KEY
from pipeline.training.step import Setting

pytestmark = pytest.mark.forks  # measuring children forked from this process (tests/conftest.py)

REPO = Path(__file__).resolve().parent.parent
PYTHIA = "EleutherAI/pythia-14m"
TINY = "test/tiny-llama"
GRID = {"batch_sizes": [1], "seq_lens": [16]}


@pytest.fixture(scope="module")
def configs_path(tmp_path_factory) -> Path:
    small = {m["id"]: m for m in yaml.safe_load((REPO / "tests/data/models_small.yaml").read_text())["models"]}
    tiny = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    configs = {model_id: {"family": family, "model_type": facts["model_type"], "status": "ok", "reason": None,
                          "config_source": "embedded", "config_revision": None, "config": facts}
               for model_id, family, facts in ((PYTHIA, "pythia", small[PYTHIA]["config"]), (TINY, "test", tiny))}
    path = tmp_path_factory.mktemp("configs") / "configs.json"
    path.write_text(json.dumps(configs))
    return path


@pytest.fixture(scope="module")
def client_sweep(configs_path, tmp_path_factory):
    """pythia-14m in fp32 with the loop and with the Trainer (AdamW foreach with K=2, SGD with
    checkpointing, 8-bit AdamW), and tiny-llama's loop in amp-fp16. Returns (jobs, frame)."""
    plan = {
        "grid": GRID, "precisions": ["fp32"], "models": [PYTHIA],
        "variants": [
            {"name": "trainer adamw", "client": "trainer", "optim": "adamw_torch", "gradient_accumulation": 2,
             "models": [PYTHIA]},
            {"name": "trainer sgd ckpt", "client": "trainer", "optim": "sgd", "gradient_checkpointing": True,
             "models": [PYTHIA]},
            {"name": "trainer 8-bit", "client": "trainer", "optim": "adamw_bnb_8bit", "models": [PYTHIA]},
            {"name": "loop fp16", "precisions": ["amp-fp16"], "models": [TINY]}]}
    return run_cpu_sweep(tmp_path_factory, configs_path, plan, "clients", processes=3)


def test_each_client_has_its_own_process(client_sweep):
    jobs, frame = client_sweep
    assert [(job.model_id, job.precision, job.client, job.name.endswith("__trainer")) for job in jobs] == [
        (PYTHIA, "fp32", "loop", False), (PYTHIA, "fp32", "trainer", True), (TINY, "amp-fp16", "loop", False)]
    assert len(frame) == 5 and not frame.duplicated(list(POINT_KEY)).any()
    loop = frame[(frame["model_id"] == PYTHIA) & (frame["client"] == "loop")]
    trainer = frame[(frame["client"] == "trainer") & (frame["status"] == "ok")]
    assert len(trainer) >= 2 and trainer["child_pid"].nunique() == 1  # the Trainer's points share its process
    assert not set(trainer["child_pid"]) & set(loop["child_pid"])


def test_trainer_row_has_its_setting_and_real_sizes(client_sweep):
    _, frame = client_sweep
    loop = pick(frame, client="loop", model_id=PYTHIA)
    row = pick(frame, client="trainer", optim="adamw_torch")
    n = row["parameters"]
    assert row["status"] == "ok" and pd.isna(row["reason"])
    assert row["gradient_accumulation"] == 2 and pd.isna(row["optimizer"]) and row["variant"] == "standard"
    assert row["steps"] == 3 and row["step_seconds"] > 0
    assert row["tokens"] == 1 * 16 * 2 and row["step_flops"] == 6.0 * n * 32
    assert row["tokens_per_second"] == pytest.approx(32 / row["step_seconds"])
    # fp32 weights (plus a 32-byte rotary buffer), as the loop's process built them
    assert row["weights_bytes"] == loop["weights_bytes"] and 4 * n <= row["weights_bytes"] < 4 * n + 1024
    # AdamW's two fp32 moments, plus its 4-byte step counters, which are on the CPU here (on CUDA the
    # foreach AdamW keeps them on the CPU and they are not counted): the loop's AdamW state exactly
    state = row["optimizer_state_bytes"]
    assert state == loop["optimizer_state_bytes"]
    assert 0 < state - 2 * 4 * n <= 4 * 100 and (state - 2 * 4 * n) % 4 == 0
    assert row["train_mode"] and not row["use_cache"]


def test_trainer_sgd_has_no_state_and_checkpointing_runs(client_sweep):
    _, frame = client_sweep
    row = pick(frame, client="trainer", optim="sgd")
    assert row["status"] == "ok" and row["gradient_checkpointing"] and row["gradient_accumulation"] == 1
    assert row["optimizer_state_bytes"] == 0  # transformers' "sgd": no momentum


def test_8bit_adamw_runs_where_bitsandbytes_is_installed(client_sweep):
    """bitsandbytes keeps the two moments in 8 bits (plus a 4-byte absmax per 256 values), except
    for the embeddings, which the Trainer registers for 32-bit state (8 bytes per parameter; the
    H100's Qwen2.5-0.5B row agrees: 1,816,486,912 bytes = 8 x 136M tied embedding + 2 x the rest);
    without bitsandbytes the row is skipped with its reason."""
    _, frame = client_sweep
    row = pick(frame, optim="adamw_bnb_8bit")
    if importlib.util.find_spec("bitsandbytes") is None:
        assert row["status"] == "skipped"
        assert row["reason"] == "optim adamw_bnb_8bit needs bitsandbytes, which is not installed here"
        return
    n, embedding = row["parameters"], 50304 * 128  # pythia-14m's embed_in (embed_out is a Linear)
    assert row["status"] == "ok"
    assert row["optimizer_state_bytes"] == pytest.approx(8 * embedding + 2 * (n - embedding), rel=0.01)


def test_loop_amp_fp16_keeps_fp32_weights_and_state(client_sweep):
    _, frame = client_sweep
    row = pick(frame, model_id=TINY)
    n = row["parameters"]
    assert row["status"] == "ok" and row["precision"] == "amp-fp16" and row["optim"] == "adamw_torch"
    assert row["weights_bytes"] >= 4 * n and 0 < row["optimizer_state_bytes"] - 2 * 4 * n <= 4 * 100


def test_loop_rows_carry_the_loop_columns(client_sweep):
    _, frame = client_sweep
    loop = pick(frame, client="loop", model_id=PYTHIA)
    assert (loop["optimizer"], loop["optim"], loop["gradient_accumulation"]) == ("adamw", "adamw_torch", 1)


# --- plans -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant, message", [
    ({"client": "peft"}, "client 'peft' is not one of loop, trainer"),
    ({"client": "trainer", "optimizer": "sgd"}, "optimizer is the loop client's; the trainer client takes optim"),
    ({"client": "trainer", "optim": "adam"}, "optim 'adam' is not one of adamw_torch_fused"),
    ({"client": "trainer", "gradient_accumulation": 0}, "gradient_accumulation must be a positive integer"),
    ({"client": "trainer", "variant": "blog"}, "the trainer client runs the standard variant only"),
    ({"optim": "adafactor"}, "optim is the trainer client's; the loop takes optimizer"),
    ({"gradient_accumulation": 4}, "gradient_accumulation other than 1 needs a Trainer client"),
])
def test_bad_client_settings_are_one_line_errors(variant, message):
    with pytest.raises(UserError, match=message) as info:
        sweep.parse_plan({"grid": GRID, "variants": [{"models": [PYTHIA], **variant}]}, "plan.yaml")
    assert str(info.value).startswith("plan.yaml: variants[0]: ") and "\n" not in str(info.value)


def test_trainer_defaults_and_the_budget_count_accumulation(configs_path):
    plan = sweep.parse_plan({"grid": {"batch_sizes": [1, 2], "seq_lens": [16]}, "models": [], "precisions": ["fp32"],
                             "max_step_flops": 6 * 14_067_712 * 16 * 4,
                             "variants": [{"client": "trainer", "gradient_accumulation": 4, "models": [PYTHIA]}]})
    assert plan.groups[1].setting == Setting(client="trainer", optim="adamw_torch_fused", gradient_accumulation=4)
    records, _ = load_model_records(configs_path, [PYTHIA])
    [job] = sweep.plan_jobs(plan, records)
    reasons = {p.batch_size: p.skip_reason for p in job.points}
    assert reasons[1] is None and reasons[2].startswith("over compute budget: 6*N*B*L*K = ")


def test_the_trainer_costs_its_overhead_in_the_estimate(configs_path):
    records, _ = load_model_records(configs_path, [PYTHIA])
    estimate = sweep.TimeModel(trainer_point_overhead_seconds=1.5)
    loop = sweep.point_seconds(records[PYTHIA], sweep.Point(Setting(), 1, 16), "fp32", estimate)
    trainer = sweep.point_seconds(records[PYTHIA], sweep.Point(Setting(client="trainer"), 1, 16), "fp32", estimate)
    assert trainer == pytest.approx(loop + 1.5)
    accumulating = sweep.point_seconds(records[PYTHIA], sweep.Point(Setting(client="trainer", gradient_accumulation=4),
                                                                    1, 16), "fp32", estimate)
    assert accumulating > trainer


# --- tables written before the client columns ------------------------------------------------------

def test_old_rows_merge_as_the_loop_and_only_gain_columns(client_sweep, tmp_path):
    _, frame = client_sweep
    new_columns = ["client", "optim", "gradient_accumulation"]
    loop = frame[frame["client"] == "loop"]
    old = loop.drop(columns=new_columns)
    old.to_parquet(tmp_path / "old.parquet")
    merged = sweep.aggregate(tmp_path / "no-parts", tmp_path / "merged.parquet", [tmp_path / "old.parquet"])
    assert tuple(merged.columns) == COLUMNS
    pd.testing.assert_frame_equal(merged[list(old.columns)], old.reset_index(drop=True))
    assert merged[new_columns].astype(object).values.tolist() == loop[new_columns].astype(object).values.tolist()
    # old part rows (no client keys) settle the loop's points: nothing is pending again
    jobs, _ = client_sweep
    rows = [{k: v for k, v in r.items() if k not in new_columns} for r in loop.astype(object).to_dict("records")]
    assert sweep.pending_points(jobs[0], rows) == []


def test_a_second_trainer_on_the_same_model_runs_as_the_first():
    """accelerate never re-wraps a model it prepared once (`_is_accelerate_prepared`): without the
    client's restore, a second Trainer point of a process ran without bf16 autocast (on the H100,
    Qwen3-0.6B's B=4, L=512 measured 20.4 GB after another point against 16.9 GB as a first point).
    Live bytes of two identical points on the CPU, counted by the simulator's tracker, must agree."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pipeline.measure.clients import trainer as client
    from pipeline.measure.clients.tracking import PhaseTracker
    from pipeline.simulate.memory.tracker import LiveBytesTracker

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))

    def peak() -> int:
        tracker = LiveBytesTracker("cpu")
        for parameter in model.parameters():
            tracker.track(parameter, "parameters")
        with tracker:
            client.run_steps(model, Setting(client="trainer"), "amp-bf16", 2, 64, "cpu", PhaseTracker("cpu"), False)
        return tracker.peaks["total"].total

    first, second = peak(), peak()
    assert first == second
    assert "_is_accelerate_prepared" not in vars(model)
