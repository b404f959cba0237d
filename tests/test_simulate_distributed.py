"""Tests of the sharded simulation (pipeline.simulate.distributed.peak): DDP and FSDP2 on N ranks.

The CPU check: a real multi-process run (gloo, N processes) of a tiny model, rank 0's live bytes
counted by the simulator's tracker on the CPU, against the simulation (one process, fake process
group, meta tensors): equal byte for byte, per phase and per role.
"""

from __future__ import annotations

import pytest
from conftest import TINY_LLAMA, flat

from pipeline.core.errors import UserError
from pipeline.training.values import Run

COMPARED = ("peak_bytes", "peak_phase", "phase_peaks", "components", "phase_components")


def simulate(num_gpus: int, sharding: str, **kwargs) -> dict:
    from pipeline.simulate.distributed.peak import distributed_peak

    checkpointing = kwargs.pop("gradient_checkpointing", False)
    return flat(distributed_peak(TINY_LLAMA, Run(2, 24, kwargs.pop("precision", "fp32"), checkpointing=checkpointing,
                                                 attn_implementation="eager", num_gpus=num_gpus, sharding=sharding,
                                                 **kwargs)))


@pytest.mark.parametrize("num_gpus, shardings, precision, checkpointing", [
    (2, ("ddp", "fsdp", "fsdp-no-reshard"), "bf16", True),
    (4, ("ddp", "fsdp"), "fp32", False),
])
def test_simulation_equals_real_gloo_run_on_the_cpu(num_gpus, shardings, precision, checkpointing):
    """Also checked by hand, equal likewise: fp32/bf16/amp-bf16 with and without checkpointing at
    N = 2, and a tiny gpt2 (tied embeddings, dropout)."""
    from pipeline.simulate.distributed.check import run_cpu_check

    real = run_cpu_check(TINY_LLAMA, num_gpus, shardings, precision=precision,
                         gradient_checkpointing=checkpointing)
    for sharding in shardings:
        simulated = simulate(num_gpus, sharding, precision=precision, gradient_checkpointing=checkpointing)
        for key in COMPARED:
            assert simulated[key] == real[sharding][key], (sharding, key)
        assert real[sharding]["peak_bytes"] > 0


def test_hsdp_tensor_parallel_and_mp_bf16_equal_real_gloo_runs_on_the_cpu():
    """HSDP (2 replicas x 2 shards), tensor parallelism 2 x FSDP2 2 and tensor parallelism 2 alone, and FSDP2's
    mixed precision (mp-bf16) on 2, on gloo ranks: the simulation (fake process group, meta) counts rank 0's
    bytes as the real run does."""
    from pipeline.simulate.distributed.check import run_cpu_check
    from pipeline.training.layout import Layout

    by_size = {4: [Layout(4, "hsdp", 2), Layout(4, "fsdp", tensor_parallel=2)], 2: [Layout(2, None, tensor_parallel=2)]}
    # the real runs first: a process forks its ranks before its own autograd has run
    real = {str(layout): result for n, layouts in by_size.items()
            for layout, result in zip(layouts, run_cpu_check(TINY_LLAMA, n, layouts, precision="bf16").values())}
    mixed = run_cpu_check(TINY_LLAMA, 2, ["fsdp"], precision="mp-bf16")["fsdp"]  # FSDP2's mixed precision
    for layout in by_size[4] + by_size[2]:
        simulated = simulate(layout.num_gpus, layout.sharding, precision="bf16", shard_group=layout.shard_group,
                             tensor_parallel=layout.tensor_parallel)
        for key in COMPARED:
            assert simulated[key] == real[str(layout)][key], (layout, key)
    simulated = simulate(2, "fsdp", precision="mp-bf16")
    for key in COMPARED:
        assert simulated[key] == mixed[key], ("mp-bf16", key)
    # fp32 shards, gradients and moments; the layers gathered in bf16 (half fp32's unsharded bytes)
    fp32 = simulate(2, "fsdp", precision="fp32")["phase_components"]["forward"]
    assert mixed["phase_components"]["forward"]["parameters"] == fp32["parameters"]
    assert 0.45 < mixed["phase_components"]["forward"]["unsharded_parameters"] / fp32["unsharded_parameters"] < 0.55
    hsdp = simulate(4, "hsdp", shard_group=2)["phase_components"]["optimizer"]
    fsdp = simulate(4, "fsdp")["phase_components"]["optimizer"]
    # a replica of 2 shards keeps half of each parameter (a quarter under FSDP2 over 4)
    assert 1.9 < hsdp["parameters"] / fsdp["parameters"] < 2.1


def test_fsdp_holds_a_shard_of_the_parameters_and_ddp_a_bucket_copy_of_the_gradients():
    """TINY_LLAMA has 151,872 parameters (607,488 fp32 bytes); components at the optimizer peak."""
    ddp = simulate(4, "ddp")["phase_components"]["optimizer"]
    fsdp = simulate(4, "fsdp")["phase_components"]["optimizer"]
    assert simulate(1, "ddp")["phase_components"]["optimizer"] == ddp  # DDP's memory does not depend on N
    assert ddp["parameters"] == 609_792  # each tensor in its own 512-byte blocks, and the rotary buffer
    assert ddp["ddp_buckets"] == 607_744  # one bucket (under 25 MiB): all the gradients, one block
    assert ddp["gradients"] == 608_768 and ddp["optimizer_state"] == 2 * 608_768
    # FSDP2 keeps a quarter of each parameter (padded to N equal shards), its gradient and AdamW moments
    assert fsdp["parameters"] == 155_136 and fsdp["gradients"] == 153_088 and fsdp["optimizer_state"] == 308_224
    assert fsdp["ddp_buckets"] == ddp["all_gather"] == ddp["unsharded_parameters"] == 0


def test_reshard_after_forward_keeps_fewer_layers_unsharded():
    reshard = simulate(2, "fsdp")["phase_components"]["forward"]
    keep = simulate(2, "fsdp-no-reshard")["phase_components"]["forward"]
    assert keep["unsharded_parameters"] > reshard["unsharded_parameters"] > 0


def test_the_fake_world_and_the_fsdp_patches_are_undone():
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    validate, all_gather = param_group.FSDPParamGroup._validate_no_meta_params, param_group.foreach_all_gather
    simulate(2, "fsdp")
    assert not dist.is_initialized()
    assert param_group.FSDPParamGroup._validate_no_meta_params is validate
    assert param_group.foreach_all_gather is all_gather


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_gpus=0, sharding="fsdp"), "num_gpus must be a positive integer"),
    (dict(num_gpus=2, sharding="zero4"),
     "sharding 'zero4' is not one of ddp, fsdp, fsdp-no-reshard, hsdp, zero1, zero2, zero3"),
    (dict(num_gpus=2, sharding="zero3"), "sharding zero3 is DeepSpeed's as the Trainer runs it"),
])
def test_bad_arguments_raise_user_error(kwargs, message):
    from pipeline.simulate.distributed.peak import distributed_peak

    with pytest.raises(UserError, match=message):
        distributed_peak(TINY_LLAMA, Run(2, 24, "fp32", **kwargs))


# ----------------------------------------------------------------------------- the GPU sweep's plan


def test_distributed_plan_names_registry_models_that_do_not_fit_one_gpu():
    """config/sweep_distributed.yaml: 8+ models with configs, 13B-34B among them, N in 2, 4, 8, ddp and fsdp."""
    from pathlib import Path

    from pipeline.measure.distributed.plan import groups, read_plan
    from pipeline.inputs.configs import read_config_records

    repo = Path(__file__).resolve().parent.parent
    plan = read_plan(repo / "config" / "sweep_distributed.yaml")
    records = read_config_records(repo / "results" / "configs.json")
    assert len(plan["models"]) >= 8 and all(records[m]["status"] == "ok" for m in plan["models"])
    assert {"meta-llama/Llama-2-13b-hf", "codellama/CodeLlama-34b-hf"} <= set(plan["models"])
    assert {"ddp", "fsdp"} <= set(plan["shardings"]) and set(plan["num_gpus"]) == {2, 4, 8}
    assert {g.num_gpus for g in groups(plan, gpus=4)} == {2, 4}
    assert len(groups(plan)) == len(plan["models"]) * 3 * len(plan["shardings"]) * len(plan["precisions"])


def test_distributed_dry_run_prints_one_torchrun_per_point(tmp_path):
    import subprocess
    import sys

    plan = tmp_path / "plan.yaml"
    plan.write_text("models: [Qwen/Qwen2.5-0.5B]\nnum_gpus: [2, 4]\nshardings: [fsdp]\n"
                    "grid: {batch_sizes: [1], seq_lens: [512, 2048]}\n")
    result = subprocess.run([sys.executable, "-m", "pipeline.measure.distributed", "--plan", str(plan), "--dry-run"],
                            capture_output=True, text=True, timeout=120)
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and len(lines) == 4
    assert "--nproc-per-node=2" in lines[0] and "--batch 1 --seq 512" in lines[0] and "--sharding fsdp" in lines[0]
    assert "--nproc-per-node=4" in lines[3] and "--batch 1 --seq 2048" in lines[3]
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [x]\nshardings: [zero3]\ngrid: {batch_sizes: [1], seq_lens: [8]}\n")
    result = subprocess.run([sys.executable, "-m", "pipeline.measure.distributed", "--plan", str(bad), "--dry-run"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == (
        f"error: {bad}: zero1-3 and deepspeed configs run with the trainer, sft and dpo clients, not loop")


def test_packings_are_sft_groups_of_their_own_passed_to_the_rank(tmp_path):
    """`packings`: each mapping a group of its own (its Packing.to_text() in the group's key and the rank's
    --packing), for sft alone; config/sweep_packing_distributed_heldout.yaml: three packed held-out points."""
    from conftest import REPO

    from pipeline.measure.distributed.plan import groups, read_plan

    plan = tmp_path / "plan.yaml"
    plan.write_text("models: [Qwen/Qwen2.5-0.5B]\nclients: [sft, trainer]\nshardings: [ddp]\npoints: [[2, 512]]\n"
                    "packings: [{packing: true}, {padding_free: true}, {packing: false}]\n")
    found = groups(read_plan(plan))
    assert [(g.client, g.packing) for g in found] == [
        ("sft", '{"packing": true, "padding_free": true}'), ("sft", '{"packing": false, "padding_free": true}'),
        ("sft", None), ("trainer", None)]
    assert len({g.key for g in found}) == 4
    arguments = found[1].rank_arguments(2, 512)
    assert arguments[arguments.index("--packing") + 1] == '{"packing": false, "padding_free": true}'
    assert "--packing" not in found[2].rank_arguments(2, 512) + found[3].rank_arguments(2, 512)

    heldout = read_plan(REPO / "config" / "sweep_packing_distributed_heldout.yaml")
    packed = '{"packing": true, "padding_free": true}'
    assert [(g.model_id, g.sharding, g.points, g.num_gpus, g.split, g.checkpointing, g.packing)
            for g in groups(heldout)] == [
        ("Qwen/Qwen2.5-1.5B", "fsdp", ((4, 4096),), 2, "held-out", True, packed),
        ("Qwen/Qwen2.5-0.5B", "zero3", ((8, 2048),), 2, "held-out", True, packed),
        ("meta-llama/Llama-3.2-1B", "ddp", ((4, 2048),), 2, "held-out", True, packed)]
    assert all(g.client == "sft" and g.precision == "bf16-autocast" and g.timeout == 240 for g in groups(heldout))


@pytest.mark.parametrize("packings, clients, message", [
    ("[{packing: true}]", "[trainer, dpo]", "packings are the sft client's settings"),
    ("[{packing: yes please}]", "[sft]", "packings: packing must be true or false, not 'yes please'"),
    ("[{padding_free: 1}]", "[sft]", "packings: padding_free must be true or false, not 1"),
    ("[{packing: true, max_length: 512}]", "[sft]", "each of packings is a mapping of packing and padding_free"),
    ("[{}]", "[sft]", "each of packings is a mapping of packing and padding_free"),
    ("{packing: true}", "[sft]", "packings is a list of mappings of packing and padding_free"),
    ("[true]", "[sft]", "packings is a list of mappings of packing and padding_free"),
])
def test_bad_packings_are_one_line_refusals(tmp_path, packings, clients, message):
    from pipeline.measure.distributed.plan import read_plan

    plan = tmp_path / "plan.yaml"
    plan.write_text(f"models: [Qwen/Qwen2.5-0.5B]\nclients: {clients}\nshardings: [ddp]\npoints: [[2, 512]]\n"
                    f"groups:\n  - {{packings: {packings}}}\n")
    with pytest.raises(UserError) as raised:
        read_plan(plan)
    assert str(raised.value) == f"{plan}: {message}"


def test_measure_distributed_runs_torchrun_on_the_cpu(tmp_path):
    """The GPU measurement path for real on the CPU: torchrun with 2 gloo ranks, a tiny llama: the loop under ddp
    and fsdp, SFTTrainer with LoRA under DDP, with packed batches under FSDP2 and with QLoRA under FSDP2 (the saved
    random init quantized by bitsandbytes on each rank), GRPOTrainer with a reference model under FSDP2; one ok row
    per rank with its num_gpus, sharding and rank (CUDA peaks are empty on the CPU)."""
    import json
    import os
    import subprocess
    import sys

    import pandas as pd

    plan = tmp_path / "plan.yaml"
    plan.write_text("models: [test/tiny-llama]\nnum_gpus: [2]\ngrid: {batch_sizes: [2], seq_lens: [16]}\ngroups:\n"
                    "  - {clients: [loop], shardings: [ddp, fsdp]}\n"
                    "  - {clients: [sft], shardings: [ddp], adapters: [lora]}\n"
                    "  - {clients: [sft], shardings: [fsdp], packings: [{packing: true}]}\n"
                    "  - {clients: [sft], shardings: [fsdp], adapters: [qlora]}\n"
                    "  - {clients: [grpo], shardings: [fsdp], rollouts: [{num_generations: 2, max_completion_length: 4,"
                    " beta: 0.04}]}\n")
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64)))
    out, scratch = tmp_path / "peaks.parquet", tmp_path / "scratch"
    scratch.mkdir()
    result = subprocess.run([sys.executable, "-m", "pipeline", "measure-distributed", "--plan", str(plan),
                             "--config", str(config), "--devices", "2", "--out", str(out)],
                            capture_output=True, text=True, timeout=600, env=dict(os.environ, TMPDIR=str(scratch)))
    assert result.returncode == 0, result.stderr[-2000:]
    assert not list(scratch.glob("avp-point-*"))  # each point's folder goes once its rows are read
    rows = pd.read_parquet(out)
    assert set(rows["status"]) == {"ok"}, rows["reason"].tolist()
    assert sorted(zip(rows["client"], rows["sharding"], rows["rank"])) == [
        ("grpo", "fsdp", 0), ("grpo", "fsdp", 1), ("loop", "ddp", 0), ("loop", "ddp", 1), ("loop", "fsdp", 0),
        ("loop", "fsdp", 1), ("sft", "ddp", 0), ("sft", "ddp", 1), ("sft", "fsdp", 0), ("sft", "fsdp", 0),
        ("sft", "fsdp", 1), ("sft", "fsdp", 1)]
    qlora = rows[rows["quantization"].notna()]
    assert set(qlora["quantization"]) == {"nf4"} and set(qlora["sharding"]) == {"fsdp"} and len(qlora) == 2
    assert set(qlora["lora_r"]) == {16} and set(qlora["trainable_parameters"]) == {16_384}
    packed = rows[(rows["client"] == "sft") & rows["quantization"].isna()].set_index("sharding")["packing"]
    assert set(packed["fsdp"]) == {'{"packing": true, "padding_free": true}'} and packed["ddp"].isna().all()
    grpo = rows[rows["client"] == "grpo"]
    assert set(grpo["rollout"]) == {'{"beta": 0.04, "max_completion_length": 4, "num_generations": 2, "use_cache": true}'}
    assert set(grpo["gradient_checkpointing"]) == {True}  # GRPOConfig's default
    assert set(rows["num_gpus"]) == {2} and set(rows["first_in_process"]) == {True}
    sft = rows[(rows["client"] == "sft") & (rows["sharding"] == "ddp")]
    # LoRA r=16, r x (in + out) on q, k, v, o (64, 48, 48, 64) and gate, up, down (96 each): 8,192 a layer, 2 layers
    assert set(sft["lora_r"]) == {16} and sft["trainable_parameters"].nunique() == 1
    assert sft["trainable_parameters"].iloc[0] == 16_384
    loop = rows[rows["client"] == "loop"].set_index(["sharding", "rank"])
    # AdamW's two moments of every parameter on each DDP rank, of half of them on each FSDP2 rank
    assert loop.loc[("ddp", 0), "optimizer_state_bytes"] > 1.9 * loop.loc[("fsdp", 0), "optimizer_state_bytes"]


def test_a_point_that_lost_the_port_race_is_run_again():
    """On 4 GPUs two torchrun groups run side by side; `--standalone` picks a free port and binds it later, and
    once the other group took it first: the 4 rows of that point (results/distributed/h200) say so. The launcher
    queues such a point again instead of recording errors; other failures are recorded."""
    import pandas as pd

    from conftest import REPO

    from pipeline.measure.distributed.launcher import port_race

    rows = pd.read_parquet(REPO / "results/distributed/h200/peak_memory.parquet")
    errors = rows[rows["status"] == "error"]
    assert len(errors) == 4 and all(port_race(reason) for reason in errors["reason"])
    others = rows[rows["status"] == "oom"]["reason"].dropna()
    assert len(others) > 0 and not any(port_race(reason) for reason in others)
