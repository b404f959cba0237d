"""CPU tests of LoRA and QLoRA (pipeline.training.adapters): the adapter setting, PEFT's adapter_config.json,
PEFT's own wrapping of a tiny real model, and LoRA points measured through the sweep's children.

The children are real forked processes running real training steps on the CPU (no allocator peaks
there: the sizes of weights, optimizer state and trainable parameters are what can be checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.inputs.records import load_model_records
from pipeline.measure import sweep
from pipeline.training.adapters import AdapterSpec
from pipeline.core.errors import UserError
from pipeline.training.step import Setting
from pipeline.training.points import POINT_KEY

pytestmark = pytest.mark.forks  # measuring children forked from this process (tests/conftest.py)

TINY = "test/tiny-llama"
TINY_LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# per layer: q (32x32), k and v (32x16, GQA), o (32x32), gate and up (32x64), down (64x32)
LINEARS = {"q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32),
           "gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32)}


def lora_parameters(r: int, names) -> int:
    """r * (in + out) per targeted linear, per layer."""
    return 2 * sum(r * (LINEARS[n][0] + LINEARS[n][1]) for n in names)


def tiny_model(precision="bf16"):
    import torch

    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build

    torch.manual_seed(0)
    return build(config_from_dict(dict(TINY_LLAMA)), precision, "eager", device="cpu")


# ----------------------------------------------------------------------------- the setting


def test_spec_defaults_and_normalised_targets():
    spec = AdapterSpec.make(16, targets="v_proj, q_proj")
    assert (spec.method, spec.r, spec.alpha, spec.targets, spec.quantization) == ("lora", 16, 32, "q_proj,v_proj", None)
    assert AdapterSpec.make(8, quantization="nf4").method == "qlora"
    assert AdapterSpec("qlora", 8).quantization == "nf4"
    assert AdapterSpec.from_row(spec.columns()) == spec
    assert AdapterSpec.from_row({"lora_r": None}) is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(r=0), "lora r must be a positive integer"),
    (dict(r=8, alpha=-1), "lora alpha"),
    (dict(r=8, quantization="fp8"), "quantization 'fp8' is not one of nf4, int8"),
    (dict(r=8, targets=""), "lora targets"),
    (dict(r=8, targets="all-linear,q_proj"), "cannot be combined"),
])
def test_bad_specs_are_one_line_errors(kwargs, message):
    with pytest.raises(UserError, match=message) as caught:
        AdapterSpec.make(**kwargs)
    assert "\n" not in str(caught.value)


def test_peft_adapter_config_is_read(tmp_path):
    """An adapter_config.json as PEFT writes it (save_pretrained of a real PeftModel)."""
    from pipeline.training.adapters import apply_adapters

    model = apply_adapters(tiny_model(), AdapterSpec.make(4, 12, "q_proj,v_proj"), False)
    model.save_pretrained(tmp_path)
    spec = AdapterSpec.from_peft_config(tmp_path)
    assert (spec.r, spec.alpha, spec.targets) == (4, 12, "q_proj,v_proj")
    assert AdapterSpec.from_peft_config(tmp_path / "adapter_config.json", quantization="nf4").method == "qlora"
    with pytest.raises(UserError, match="not found"):
        AdapterSpec.from_peft_config(tmp_path / "nothing.json")
    with pytest.raises(UserError, match="peft_type"):
        AdapterSpec.from_peft_config({"peft_type": "IA3", "r": 4, "target_modules": ["q_proj"]})


def test_unknown_targets_name_the_modules_that_exist():
    from pipeline.training.adapters import apply_adapters

    with pytest.raises(UserError) as caught:
        apply_adapters(tiny_model(), AdapterSpec.make(4, targets="c_attn"), False)
    assert str(caught.value) == ("lora targets c_attn: no such module in llama; its linear modules are down_proj, "
                                 "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj")


@pytest.mark.parametrize("targets, names", [("all-linear", list(LINEARS)), ("q_proj,v_proj", ["q_proj", "v_proj"])])
def test_peft_wraps_the_targets_and_freezes_the_base(targets, names):
    from pipeline.training.adapters import apply_adapters, trainable_parameters

    model = apply_adapters(tiny_model(), AdapterSpec.make(8, targets=targets), True)
    assert trainable_parameters(model) == lora_parameters(8, names)
    # PEFT keeps the adapters in fp32 on a bf16 base (autocast_adapter_dtype)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {__import__("torch").float32}


# ----------------------------------------------------------------------------- through the sweep


@pytest.fixture(scope="module")
def configs_path(tmp_path_factory) -> Path:
    configs = {TINY: {"family": "test", "model_type": "llama", "status": "ok", "reason": None,
                      "config_source": "embedded", "config_revision": None, "config": TINY_LLAMA}}
    path = tmp_path_factory.mktemp("configs") / "configs.json"
    path.write_text(json.dumps(configs))
    return path


@pytest.fixture(scope="module")
def lora_sweep(configs_path, tmp_path_factory):
    """tiny-llama's standard step in bf16, LoRA r=8 all-linear (bf16) and LoRA r=4 on q/v with
    checkpointing (amp-bf16), two points each; QLoRA (nf4, a real bitsandbytes base on the CPU) and
    the Trainer with LoRA, one point each."""
    import os

    bases = tmp_path_factory.mktemp("bases")
    os.environ["AVP_ADAPTER_BASES"] = str(bases)  # the forked children's
    plan = sweep.parse_plan({
        "grid": {"batch_sizes": [1, 2], "seq_lens": [16]}, "precisions": ["bf16"], "models": [TINY],
        "variants": [
            {"name": "lora", "lora": {"r": 8, "targets": "all-linear"}, "models": [TINY]},
            {"name": "lora qv ckpt", "precisions": ["amp-bf16"], "gradient_checkpointing": True,
             "lora": {"r": 4, "targets": "q_proj,v_proj"}, "models": [TINY]},
            {"name": "qlora", "lora": {"r": 8, "quantization": "nf4"}, "points": [[2, 16]], "models": [TINY]},
            {"name": "trainer lora", "client": "trainer", "lora": {"r": 8}, "points": [[2, 16]], "models": [TINY]}]})
    records, missing = load_model_records(configs_path, plan.models)
    assert not missing
    jobs = sweep.plan_jobs(plan, records)
    assert [(j.precision, j.client, j.adapters) for j in jobs] == [
        ("bf16", "loop", False), ("bf16", "loop", True), ("bf16", "trainer", True), ("amp-bf16", "loop", True)]
    parts = tmp_path_factory.mktemp("lora") / "parts"
    outcomes = sweep.run_sweep(jobs, parts, device="cpu", child_timeout=300, log=lambda line: None)
    del os.environ["AVP_ADAPTER_BASES"]
    assert outcomes["finished"] == 4 and outcomes["error"] == 0
    assert not list(bases.iterdir())  # the QLoRA job removed the random init it saved
    return sweep.aggregate(parts, parts.parent / "peak_memory.parquet")


def test_lora_rows_have_their_columns(lora_sweep):
    frame = lora_sweep[lora_sweep["quantization"].isna() & (lora_sweep["client"] == "loop")]
    assert len(frame) == 6 and set(lora_sweep["status"]) == {"ok"}
    assert not frame.duplicated(list(POINT_KEY)).any()
    full = frame[frame["lora_r"].isna()]
    assert full["trainable_parameters"].isna().all() and full["quantization"].isna().all()
    lora = frame[frame["lora_r"] == 8]
    assert set(lora["lora_targets"]) == {"all-linear"} and set(lora["lora_alpha"]) == {16}
    assert set(lora["trainable_parameters"]) == {lora_parameters(8, LINEARS)}
    # AdamW's two fp32 moments over the adapters only (and on the CPU its step counters: 28 adapter matrices)
    assert set(lora["optimizer_state_bytes"]) == {2 * 4 * lora_parameters(8, LINEARS) + 4 * 28}
    assert (lora["weights_bytes"].to_numpy() == full["weights_bytes"].iloc[0] + 4 * lora_parameters(8, LINEARS)).all()
    qv = frame[frame["lora_r"] == 4]
    assert set(qv["lora_targets"]) == {"q_proj,v_proj"} and qv["gradient_checkpointing"].all()
    assert set(qv["trainable_parameters"]) == {lora_parameters(4, ["q_proj", "v_proj"])}
    assert set(qv["precision"]) == {"amp-bf16"}
    assert set(frame["parameters"]) == {full["parameters"].iloc[0]}


def test_qlora_and_trainer_rows(lora_sweep):
    """QLoRA (a real NF4 base loaded from the saved random init) trains the same adapters as LoRA;
    so does the Trainer (its AdamW over them only)."""
    frame = lora_sweep
    qlora = frame[frame["quantization"] == "nf4"].iloc[0]
    lora = frame[(frame["lora_r"] == 8) & frame["quantization"].isna() & (frame["client"] == "loop")].iloc[0]
    assert qlora["lora_targets"] == "all-linear" and qlora["trainable_parameters"] == lora["trainable_parameters"]
    assert qlora["optimizer_state_bytes"] == lora["optimizer_state_bytes"]
    trainer = frame[(frame["client"] == "trainer")].iloc[0]
    assert trainer["trainable_parameters"] == lora["trainable_parameters"]
    assert trainer["optimizer_state_bytes"] == 2 * 4 * lora_parameters(8, LINEARS) + 4 * 28


def test_lora_points_resume_from_their_rows(lora_sweep, configs_path):
    """A rerun finds every adapter point settled (their key columns round-trip)."""
    rows = lora_sweep.astype(object).where(lora_sweep.notna(), None).to_dict("records")
    setting = Setting(adapter=AdapterSpec.make(4, targets="q_proj,v_proj"), gradient_checkpointing=True)
    assert Setting.from_row(next(r for r in rows if r["lora_r"] == 4)) == setting


def test_plan_lora_key_errors():
    base = {"grid": {"batch_sizes": [1], "seq_lens": [16]}, "models": []}
    with pytest.raises(UserError, match=r"variants\[0\]: lora: unknown key 'rank'"):
        sweep.parse_plan(dict(base, variants=[{"lora": {"rank": 8}, "models": [TINY]}]))
    with pytest.raises(UserError, match="standard variant only"):
        sweep.parse_plan(dict(base, variants=[{"lora": {"r": 8}, "variant": "blog", "models": [TINY]}]))


@pytest.mark.parametrize("plan_file, models, architectures", [("config/sweep_lora.yaml", 15, 8),
                                                              ("config/sweep_lora_heldout.yaml", 8, 6)])
def test_lora_plans_are_valid_and_sized_for_one_run(plan_file, models, architectures, tmp_path):
    """Every model of the plans has a config; LoRA and QLoRA both planned; one ~9-minute H100 run."""
    from pipeline.core.paths import CONFIGS
    from pipeline.measure.sweep.cost import plan_report

    repo = Path(__file__).resolve().parent.parent
    plan = sweep.load_plan(repo / plan_file)
    records, missing = load_model_records(repo / CONFIGS, plan.models)
    assert not missing
    assert len(records) >= models and len({r.model_type for r in records.values()}) >= architectures
    methods = {g.setting.adapter.method for g in plan.groups if g.setting.adapter is not None}
    assert methods == {"lora", "qlora"}
    _, seconds = plan_report(sweep.plan_jobs(plan, records), tmp_path, plan)
    assert seconds < 500


def test_command_line_adapter_arguments(tmp_path):
    import argparse

    from pipeline.training.adapters import add_adapter_arguments, adapter_from_arguments

    parser = argparse.ArgumentParser()
    add_adapter_arguments(parser)
    assert adapter_from_arguments(parser.parse_args([])) is None
    spec = adapter_from_arguments(parser.parse_args(["--lora-r", "8", "--lora-targets", "q_proj,v_proj",
                                                     "--quantization", "nf4"]))
    assert spec == AdapterSpec("qlora", 8, 16, "q_proj,v_proj", "nf4")
    config = tmp_path / "adapter_config.json"
    config.write_text(json.dumps({"peft_type": "LORA", "r": 32, "lora_alpha": 16, "target_modules": ["v_proj"]}))
    assert adapter_from_arguments(parser.parse_args(["--peft-config", str(config)])) == AdapterSpec.make(32, 16, "v_proj")
    with pytest.raises(UserError, match="need --lora-r"):
        adapter_from_arguments(parser.parse_args(["--quantization", "nf4"]))
    with pytest.raises(UserError, match="leave out --lora-r"):
        adapter_from_arguments(parser.parse_args(["--peft-config", str(config), "--lora-r", "4"]))
