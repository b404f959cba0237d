"""Several GPUs asked the way people launch them: an accelerate config file, the fsdp keys of a TrainingArguments
or SFTConfig file; the layouts table and the fewest GPUs that fit; the verdict with NCCL's memory outside PyTorch."""

from __future__ import annotations

import json

import pytest

from pipeline.cli import main
from pipeline.core.errors import UserError
from pipeline.estimate import estimate

from conftest import TINY_LLAMA

ACCELERATE_FSDP = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: false
"""


def answer(*arguments) -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["estimate", *arguments, "--json"]) == 0
    return json.loads(out.getvalue())


def test_an_accelerate_config_sets_the_gpus_the_sharding_and_the_autocast(tmp_path):
    """accelerate config's FSDP2 file with reshard_after_forward false: 4 GPUs, fsdp-no-reshard, bf16 autocast on
    bf16 weights (bf16-autocast); the same question as the options, the same answer."""
    path = tmp_path / "fsdp.yaml"
    path.write_text(ACCELERATE_FSDP)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_LLAMA, "torch_dtype": "bfloat16"}))
    from_file = answer("--config", str(config), "--client", "trainer", "--batch", "2", "--seq", "32",
                       "--accelerate-config", str(path), "--method", "exact")
    given = answer("--config", str(config), "--client", "trainer", "--batch", "2", "--seq", "32", "--num-gpus", "4",
                   "--sharding", "fsdp-no-reshard", "--precision", "bf16-autocast", "--method", "exact")
    assert (from_file["num_gpus"], from_file["sharding"], from_file["precision"]) == (4, "fsdp-no-reshard",
                                                                                     "bf16-autocast")
    assert from_file["peak_bytes"] == given["peak_bytes"] > 0


def test_the_fsdp_keys_of_a_training_file_launch_fsdp2():
    args = {"per_device_train_batch_size": 2, "bf16": True, "fsdp": "full_shard auto_wrap",
            "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                            "activation_checkpointing": True}}
    result = estimate(config={**TINY_LLAMA, "torch_dtype": "bfloat16"}, training_args=args, seq=32, num_gpus=2,
                      method="formula")
    assert (result["sharding"], result["num_gpus"], result["checkpointing"]) == ("fsdp", 2, True)
    assert any("activation_checkpointing" in note for note in result["notes"])
    with pytest.raises(Exception, match="needs the number of GPUs"):
        estimate(config=TINY_LLAMA, training_args=args, seq=32, method="formula")


@pytest.mark.parametrize("change, message", [
    (lambda c: c.replace("distributed_type: FSDP", "distributed_type: DEEPSPEED"), "needs a deepspeed_config"),
    (lambda c: c.replace("fsdp_version: 2", "fsdp_version: 1"), "FSDP version 1 is not simulated"),
    (lambda c: c + "fsdp_offload_params: true\n", "unknown accelerate config key 'fsdp_offload_params'"),
    (lambda c: c.replace("  fsdp_version: 2", "  fsdp_version: 2\n  fsdp_offload_params: true"),
     "FSDP2 with CPU offload (sharding fsdp-offload) would crash at the first optimizer step"),
    (lambda c: c.replace("  fsdp_version: 2", "  fsdp_version: 2\n  fsdp_bogus: 1"), "unknown fsdp_config key 'bogus'"),
    (lambda c: c.replace("num_processes: 4", "num_processes: -2"), "num_processes must be a positive integer"),
    (lambda c: c.replace("mixed_precision: bf16", "mixed_precision: fp8"), "mixed_precision 'fp8' is not simulated"),
    (lambda c: "[1, 2", "not an accelerate config"),
])
def test_bad_accelerate_configs_are_one_line(tmp_path, capsys, change, message):
    path = tmp_path / "accelerate.yaml"
    path.write_text(change(ACCELERATE_FSDP))
    code = main(["estimate", "--params", "1e9", "--batch", "1", "--seq", "8", "--client", "trainer",
                 "--accelerate-config", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err


def test_fsdp2_cpu_offload_answers_where_its_run_crashes(capsys):
    """FSDP2's CPU offload under the Trainer crashes at the first optimizer step (measured on 2 H200s: the gradient
    norm's all-reduce of host tensors over NCCL): asked by its sharding, a training file's fsdp words or fsdp_config,
    the answer is that crash in one line (exit 2); the loop's is not simulated; the Axolotl file's FSDP1 offload
    neither."""
    from pipeline.simulate.crashes import RunWouldCrash

    crash = "would crash at the first optimizer step"
    code = main(["estimate", "--model", "meta-llama/Llama-3.2-1B", "--batch", "2", "--seq", "1024", "--client",
                 "trainer", "--precision", "bf16", "--num-gpus", "2", "--sharding", "fsdp-offload"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and crash in err and "No backend type associated with device type cpu" in err \
        and "\n" not in err
    for fsdp, config in (("full_shard offload auto_wrap", {"version": 2}), ("full_shard auto_wrap",
                                                                           {"version": 2, "offload_params": True})):
        with pytest.raises(RunWouldCrash, match=crash):
            estimate(config=TINY_LLAMA, seq=32, num_gpus=2, method="formula",
                     training_args={"per_device_train_batch_size": 2, "bf16": True, "fsdp": fsdp, "fsdp_config": config})
    with pytest.raises(RunWouldCrash, match=crash):
        estimate(config=TINY_LLAMA, seq=32, num_gpus=2, method="formula", axolotl_config={
            "base_model": "x", "micro_batch_size": 1, "fsdp": ["full_shard", "auto_wrap"],
            "fsdp_config": {"fsdp_version": 2, "fsdp_offload_params": True}})
    with pytest.raises(UserError, match="with FSDP version 1 .*FSDP1's CPU offload is not simulated yet"):
        estimate(config=TINY_LLAMA, seq=32, num_gpus=2, method="formula", axolotl_config={
            "base_model": "x", "micro_batch_size": 1, "fsdp": ["full_shard", "auto_wrap"],
            "fsdp_config": {"fsdp_offload_params": True}})
    with pytest.raises(UserError, match="sharding fsdp-offload of the loop client is not simulated yet"):
        estimate(config=TINY_LLAMA, batch=2, seq=32, precision="bf16", num_gpus=2, sharding="fsdp-offload",
                 method="formula")


def test_the_layouts_table_and_the_fewest_gpus():
    """A 13B full fine-tune in bf16 (16 bytes of weights, gradients and AdamW state per parameter, 2 B a GPU,
    checkpointing) on H100s: ddp holds the whole state on each GPU and never fits; FSDP2 fits from 4 GPUs by the
    formula, which answers a table of N = 1..8 in milliseconds."""
    table = answer("--model", "meta-llama/Llama-2-13b-hf", "--batch", "2", "--seq", "2048", "--precision", "bf16",
                   "--checkpointing", "--method", "formula", "--gpu", "H100 80GB", "--layouts", "--num-gpus", "8")
    rows = {(r["num_gpus"], r["sharding"], r["tensor_parallel"]): r for r in table["layouts"]}
    assert not rows[(8, "ddp", 1)]["fits"] and "alone take" in rows[(8, "ddp", 1)]["reason"]
    assert rows[(8, "fsdp", 1)]["fits"] and rows[(8, "fsdp", 1)]["peak_bytes"] < rows[(4, "fsdp", 1)]["peak_bytes"]
    assert rows[(8, "fsdp", 2)]["peak_bytes"] <= rows[(8, "fsdp", 1)]["peak_bytes"]  # 4 x 2 shards as 8, fewer saved
    fewest = answer("--model", "meta-llama/Llama-2-13b-hf", "--batch", "2", "--seq", "2048", "--precision", "bf16",
                    "--checkpointing", "--method", "formula", "--gpu", "H100 80GB", "--min-gpus")
    assert fewest["min_gpus"] in (2, 4) and fewest["layout"]["fits"] and fewest["layout"]["num_gpus"] == fewest["min_gpus"]
    assert all(not r["fits"] for r in fewest["layouts"] if r["num_gpus"] < fewest["min_gpus"])


def test_the_verdict_counts_nccl_by_communicators():
    """Measured on an H200 x4: 846 MiB over the context for one communicator (ddp, fsdp), 1,524 for three
    (hsdp: the default group, replicate and shard)."""
    one = estimate(params=1_000_000_000, batch=1, seq=8, precision="bf16", method="blog", gpu="H200")
    fsdp = estimate(params=1_000_000_000, batch=1, seq=8, precision="bf16", method="blog", gpu="H200", num_gpus=2,
                    sharding="fsdp")
    hsdp = estimate(params=1_000_000_000, batch=1, seq=8, precision="bf16", method="blog", gpu="H200", num_gpus=4,
                    sharding="hsdp", shard_group=2)
    mib = 1 << 20
    assert fsdp["outside_bytes"] - one["outside_bytes"] == 846 * mib
    assert hsdp["outside_bytes"] - one["outside_bytes"] == 1524 * mib
