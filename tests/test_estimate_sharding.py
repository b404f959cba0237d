"""`estimate` for several GPUs (num_gpus, sharding): the exact method runs the DDP / FSDP2
simulation (pipeline.simulate.distributed.peak, checked against a real gloo run in test_simulate_distributed.py),
the closed forms shard their terms, bad options are one line."""

from __future__ import annotations

import pytest
from conftest import flat

from pipeline.cli import main
from pipeline.estimate import estimate
from pipeline.training.values import Run

TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def test_exact_fsdp_is_the_distributed_simulation():
    from pipeline.simulate.distributed.peak import distributed_peak

    answer = estimate(config=TINY, batch=2, seq=64, precision="bf16", method="exact", num_gpus=4, sharding="fsdp",
                      gpu_memory_gib=80)
    direct = flat(distributed_peak(TINY, Run(2, 64, "bf16", num_gpus=4, sharding="fsdp")))
    assert answer["peak_bytes"] == direct["peak_bytes"] and answer["peak_reserved_bytes"] == direct["peak_reserved_bytes"]
    assert (answer["num_gpus"], answer["sharding"], answer["fits"]) == (4, "fsdp", True)
    one = estimate(config=TINY, batch=2, seq=64, precision="bf16", method="exact")
    assert answer["components"]["parameters"] < one["components"]["parameters"] / 3  # a quarter of the weights


def test_closed_forms_shard_weights_gradients_and_state():
    n = 8_000_000_000
    one = estimate(params=n, batch=1, seq=2048, precision="bf16", method="blog")["components"]
    fsdp = estimate(params=n, batch=1, seq=2048, precision="bf16", method="blog", num_gpus=8,
                    sharding="fsdp")["components"]
    ddp = estimate(params=n, batch=1, seq=2048, precision="bf16", method="blog", num_gpus=8,
                   sharding="ddp")["components"]
    assert fsdp["parameters"] == one["parameters"] / 8 == 2 * n / 8
    assert fsdp["optimizer_state"] == one["optimizer_state"] / 8 and fsdp["activations"] == one["activations"]
    # ddp: the Reducer's buckets, a second copy of the gradients made when the model is wrapped, held in every phase
    assert ddp["ddp_buckets"] == ddp["gradients"] == one["gradients"] and ddp["parameters"] == one["parameters"]
    ddp_peak = estimate(params=n, batch=1, seq=2048, precision="bf16", method="blog", num_gpus=8, sharding="ddp")
    one_peak = estimate(params=n, batch=1, seq=2048, precision="bf16", method="blog")
    assert ddp_peak["peak_bytes"] == one_peak["peak_bytes"] + one["gradients"]


def test_the_formula_knows_what_fsdp2_gathers_and_pads():
    """A mixture of experts past its experts' count of GPUs: FSDP2 shards the fused 3D expert weights on the
    experts, padded to the GPUs, so each GPU keeps one expert's rows and gathers one per GPU; tensor parallelism
    leaves the input embedding whole. The formula and the exact simulator (torch's own FSDP2) agree on both."""
    mixtral = dict(model="mistralai/Mixtral-8x7B-v0.1", batch=1, seq=1024, precision="bf16", checkpointing=True)
    eight = estimate(**mixtral, num_gpus=8, sharding="fsdp", method="formula")
    sixty_four = estimate(**mixtral, num_gpus=64, sharding="fsdp", method="formula")
    assert sixty_four["peak_bytes"] > 1.8 * eight["peak_bytes"]  # more GPUs, more memory each: the padding
    assert sixty_four["components"]["weights_in_flight"] > 7 * eight["components"]["weights_in_flight"]
    exact = estimate(**mixtral, num_gpus=64, sharding="fsdp", method="exact")
    assert abs(sixty_four["peak_bytes"] / exact["peak_bytes"] - 1) < 0.05


@pytest.mark.parametrize("arguments, message", [
    (["--num-gpus", "4"], "num_gpus 4 needs a sharding"),
    (["--num-gpus", "4", "--sharding", "zero4"], "invalid choice"),
    (["--num-gpus", "4", "--sharding", "zero3"], "sharding zero3 is DeepSpeed's as the Trainer runs it"),
    (["--sharding", "fsdp"], "sharding fsdp needs the number of GPUs"),
    (["--num-gpus", "4", "--sharding", "fsdp", "--tensor-parallel", "3"], "tensor_parallel 3 does not divide num_gpus 4"),
    (["--num-gpus", "8", "--sharding", "hsdp"], "sharding hsdp needs a shard_group"),
    (["--num-gpus", "8", "--sharding", "hsdp", "--shard-group", "3"], "shard_group 3 does not divide the 8"),
    (["--num-gpus", "4", "--sharding", "fsdp", "--shard-group", "2"], "shard_group is hsdp's"),
    (["--num-gpus", "4", "--sharding", "ddp", "--tensor-parallel", "2"], "tensor parallelism with ddp"),
    (["--num-gpus", "4", "--sharding", "fsdp", "--layouts"], "--gpu NAME"),
])
def test_bad_sharding_options_are_one_line(arguments, message, capsys):
    try:
        code = main(["estimate", "--params", "1e9", "--batch", "1", "--seq", "8", "--precision", "bf16",
                     "--method", "blog", *arguments])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err


def test_the_exact_layouts_table_prints_no_torch_warnings(tmp_path):
    """`python -m pipeline estimate --layouts --method exact`: the simulations in its processes (DDP on meta, FSDP2)
    keep torch's C++ and Python warnings off the user's terminal; the table is on stdout."""
    import json
    import os
    import subprocess
    import sys

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    result = subprocess.run([sys.executable, "-m", "pipeline", "estimate", "--config", str(config), "--batch", "2",
                             "--seq", "64", "--precision", "bf16", "--method", "exact", "--gpu", "T4", "--layouts",
                             "--num-gpus", "2"], capture_output=True, text=True, timeout=600,
                            env={k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "2 GPUs, fsdp " in result.stdout and "2 GPUs, ddp " in result.stdout
    assert "Warning" not in result.stderr, result.stderr[-2000:]
