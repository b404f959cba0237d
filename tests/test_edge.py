"""The answer at the edge (issue 34): DeepSpeed configs as people copy them (transformers' guide: optimizer and
scheduler sections, "auto" everywhere), runs that would crash said as such, the caching allocator's retry at the
GPU's capacity, and bad DeepSpeed input in one line.

The allocator's behaviour is checked against the real thing: allocator histories recorded on H100s
(results/edge*/h100/peak_memory.history, `training.memory_history`), every malloc and free of a measured point,
replayed through the simulator's allocator with the GPU's capacity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from pipeline.cli import main
from pipeline.core.errors import UserError

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "config" / "deepspeed" / "guide"
EDGE = REPO / "results" / "edge" / "h100"
EDGE_HELDOUT = REPO / "results" / "edge_heldout" / "h100"
GIB = 2**30
TINY = {"model_type": "llama", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "torch_dtype": "bfloat16"}


def estimate_cli(tmp_path, capsys, deepspeed, training_args=None, extra=()):
    """(exit code, stdout, stderr) of `python -m pipeline estimate` on the tiny model with a DeepSpeed config."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    argv = ["estimate", "--config", str(config), "--client", "trainer", "--num-gpus", "2", "--batch", "2", "--seq",
            "128", "--deepspeed", str(deepspeed), "--gpu", "H100 80GB", *extra]
    if training_args is not None:
        args = tmp_path / "args.json"
        args.write_text(json.dumps(training_args))
        argv += ["--training-args", str(args)]
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


GUIDE_CONFIGS = sorted(path.name for path in GUIDE.glob("*.json") if "nvme" not in path.name)


@pytest.mark.parametrize("name", GUIDE_CONFIGS)
def test_the_guides_configs_are_answered_with_the_runs_warmup(tmp_path, capsys, name):
    """Each config of transformers' DeepSpeed guide (optimizer AdamW and a Warmup* scheduler, "auto" everywhere)
    with a training file that sets warmup_steps: the exact answer, its optimizer section named in a note."""
    code, out, err = estimate_cli(tmp_path, capsys, GUIDE / name, {"per_device_train_batch_size": 2, "bf16": True,
                                                                   "warmup_steps": 10})
    assert code == 0, err
    assert out.startswith("exact: ") and "zero" in out.splitlines()[0]
    assert "its optimizer section (AdamW) runs" in out
    assert "WARNING" not in out + err  # DeepSpeed's own logs stay off the terminal


@pytest.mark.parametrize("name", GUIDE_CONFIGS)
def test_the_guides_configs_without_a_warmup_would_crash(tmp_path, capsys, name):
    """The same configs with the Trainer's default warmup of 0 steps: DeepSpeed's WarmupLR / WarmupDecayLR /
    WarmupCosineLR refuse it at deepspeed.initialize (the real run stops there): exit 2, one line naming the
    setting to change."""
    code, out, err = estimate_cli(tmp_path, capsys, GUIDE / name, {"per_device_train_batch_size": 2, "bf16": True})
    assert code == 2 and out == ""
    line, = err.strip().splitlines()
    assert "the run would stop before its first step" in line and "warmup_num_steps must be a positive integer" in line
    assert "set warmup_steps above 0" in line


def test_the_guides_nvme_config_is_refused_in_one_line(tmp_path, capsys):
    code, out, err = estimate_cli(tmp_path, capsys, GUIDE / "zero3_nvme.json", {"warmup_steps": 10})
    assert code == 2 and len(err.strip().splitlines()) == 1 and "aio" in err


def test_a_config_value_that_disagrees_with_the_training_arguments_would_crash(tmp_path, capsys):
    """transformers' own test config (tests/deepspeed/ds_config_zero3.json) fixes lr 3e-5 and betas (0.8, 0.999):
    with the Trainer's defaults the real run stops in deepspeed_init ("mismatch"); with a training file that says
    the same, it is answered."""
    config = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8,
                                                        "weight_decay": 3e-7}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5,
                                                           "warmup_num_steps": 500}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    code, _, err = estimate_cli(tmp_path, capsys, path, {"bf16": True})
    assert code == 2 and "mismatch" in err and "optimizer.params.lr=3e-05" in err and "\"auto\"" in err
    matching = {"bf16": True, "learning_rate": 3e-5, "adam_beta1": 0.8, "weight_decay": 3e-7, "warmup_steps": 500}
    code, out, err = estimate_cli(tmp_path, capsys, path, matching)
    assert code == 0, err


def test_a_refusal_is_one_line_in_a_real_process(tmp_path):
    """The same refusal from `python -m pipeline estimate` in its own process: exit 2, one line, no traceback."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    done = subprocess.run([sys.executable, "-m", "pipeline", "estimate", "--config", str(config), "--client",
                           "trainer", "--num-gpus", "2", "--batch", "2", "--seq", "128", "--deepspeed",
                           str(GUIDE / "zero2_offload.json")], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "warmup_steps" in done.stderr


def test_training_files_give_the_optimizer_and_schedule_numbers():
    from pipeline.estimate.training_args import read_training_args
    from pipeline.training.hyperparameters import Hyperparameters

    settings = read_training_args({"per_device_train_batch_size": 2, "warmup_steps": 0.03, "max_steps": 1000,
                                   "learning_rate": 1e-5, "lr_scheduler_type": "SchedulerType.COSINE"})
    assert settings["hyperparameters"] == Hyperparameters(learning_rate=1e-5, warmup_steps=0.03, max_steps=1000,
                                                          lr_scheduler_type="cosine")
    assert settings["hyperparameters"].arguments() == {"learning_rate": 1e-5, "warmup_steps": 0.03,
                                                       "lr_scheduler_type": "cosine"}
    with pytest.raises(UserError, match="warmup_ratio is not an argument of transformers' TrainingArguments"):
        read_training_args({"warmup_ratio": 0.1})
    with pytest.raises(UserError, match="max_steps must be a positive whole number"):
        read_training_args({"max_steps": 2.5})


def test_a_library_refusal_is_a_crash_and_a_simulator_failure_is_not():
    import deepspeed.runtime.lr_schedules as schedules
    import torch

    from pipeline.simulate.crashes import RunWouldCrash, refusals_are_crashes

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(RunWouldCrash, match="DeepSpeed \\(deepspeed.runtime.lr_schedules\\) refuses it"):
        with refusals_are_crashes():
            schedules.WarmupLR(optimizer, warmup_num_steps=0)
    with pytest.raises(ValueError, match="not the library's"):  # raised here, not by a library: as it was
        with refusals_are_crashes():
            raise ValueError("not the library's")


@pytest.mark.parametrize("config, message", [
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e30}}, "more than 1e\\+13 elements"),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e30}}, "more than 1e\\+18 elements"),
    ({"zero_optimization": {"stage": 2, "allgather_bucket_size": float("nan")}}, "whole number of elements"),
])
def test_sizes_beyond_any_gpu_are_refused_before_simulating(config, message):
    from pipeline.training.zero import read_deepspeed

    with pytest.raises(UserError, match=message):
        read_deepspeed(config)
    assert read_deepspeed({"zero_optimization": {"stage": 3, "sub_group_size": 1e14}})["sharding"] == "zero3"


def nested(depth: int) -> dict:
    value = {"stage": 2}
    for _ in range(depth):
        value = {"zero_optimization": value}
    return value


def test_a_deeply_nested_object_is_refused_in_one_line(tmp_path, capsys):
    from pipeline.estimate import estimate

    with pytest.raises(UserError, match="nested more than 32 levels deep"):
        estimate(config=TINY, client="trainer", num_gpus=2, batch=2, seq=128, deepspeed=nested(500))
    path = tmp_path / "deep.json"
    path.write_text('{"zero_optimization": ' * 5000 + '{"stage": 2}' + "}" * 5000)  # deeper than json.loads goes
    code, _, err = estimate_cli(tmp_path, capsys, path)
    assert code == 2 and len(err.strip().splitlines()) == 1


# -- the allocator at the edge, against recorded allocator histories ------------------------------------------------

def edge_rows(table: Path) -> pd.DataFrame:
    rows = pd.read_parquet(table / "peak_memory.parquet")
    return rows[rows["rank"] == 0]


def history_of(table: Path, **where):
    from pipeline.training import memory_history

    rows = edge_rows(table)
    for key, value in where.items():
        rows = rows[rows[key] == value]
    row = rows.iloc[0]
    return row, memory_history.load(table / row["memory_history"])


def capacity_of(row) -> int:
    """The bytes the point could reserve: the GPU's total less the memory outside PyTorch, as the verdict counts."""
    from pipeline.validate.settings import row_outside_bytes

    return int(row["gpu_total_bytes"]) - row_outside_bytes(pd.Series(row))


@pytest.mark.parametrize("where", [
    {"sharding": "fsdp", "batch_size": 6},  # FSDP2, Qwen2.5-7B: the real allocator freed 84 cached segments
    {"sharding": "zero2", "batch_size": 12, "client": "trainer"},  # ZeRO-2, Llama-3.2-3B: 17 segments given back
])
def test_the_replay_gives_cached_segments_back_at_the_capacity_as_the_allocator_did(where):
    """The real requests of a point that ran within the last GiB of an 80 GB H100, replayed: without the GPU's edge
    the segments would pass it (84-90 GiB); with its capacity, the replay gives its cached segments back and tries
    again, as the caching allocator did, and lands on the reserved bytes the GPU reported."""
    from pipeline.simulate.memory.history import replay

    row, history = history_of(EDGE, **where)
    assert history["action"].count("oom") == 0 and row["status"] == "ok"
    unbounded, bounded = replay(history), replay(history, capacity_of(row))
    assert unbounded.real_freed > 10 and unbounded.real_peak_reserved == row["peak_reserved_bytes"]
    assert unbounded.peak_reserved > 82 * GIB > capacity_of(row)
    assert bounded.retries >= 1 and not bounded.out_of_memory
    assert abs(bounded.peak_reserved - row["peak_reserved_bytes"]) <= 0.001 * row["peak_reserved_bytes"]


def test_expandable_segments_unmap_free_pages_at_the_capacity():
    """expandable_segments:True at the edge (Qwen2.5-7B FSDP2, B=8: it trained, the default allocator ran out of
    memory): the real allocator unmapped pages 33 times; the replay of its requests with the capacity lands within
    1% of the 77.29 GiB it reserved, where mapping every page it ever used would need 97 GiB."""
    from pipeline.simulate.memory.history import replay

    row, history = history_of(EDGE, sharding="fsdp", batch_size=8, status="ok")
    assert "expandable_segments:True" in row["alloc_conf"]
    unbounded, bounded = replay(history, expandable=True), replay(history, capacity_of(row), expandable=True)
    assert unbounded.peak_reserved > 90 * GIB
    assert abs(bounded.peak_reserved - row["peak_reserved_bytes"]) <= 0.01 * row["peak_reserved_bytes"]


def test_the_reduction_staging_buffers_are_those_the_gpu_allocated():
    """Reduce.cuh's global-reduce buffer and semaphores, ported (`simulate.kernels.reduce`), for the two norm-weight
    gradient sums of the ZeRO points: the sizes and counts the allocator histories hold (3 steps x (2 norms x 28
    layers + 1))."""
    from pipeline.simulate.kernels.reduce import scratch_bytes

    for where, shape, expected in (({"sharding": "zero1"}, (4, 1024, 1536), [50_331_648, 48]),
                                   ({"sharding": "zero2", "client": "sft"}, (2, 2048, 3072), [100_663_296, 96])):
        strides = (shape[1] * shape[2], shape[2], 1)
        assert scratch_bytes(shape, strides, [0, 1], 4) == expected
        _, history = history_of(EDGE, **where)
        sizes = [int(size) for action, size in zip(history["action"], history["size"]) if action == "alloc"]
        assert sizes.count(expected[1]) >= 171 and sizes.count(expected[0]) >= 171


def simulated(row):
    from pipeline.core.paths import RESULTS
    from pipeline.estimate.estimators import ExactEstimator
    from pipeline.validate.settings import ConfigTargets, run_of

    run = run_of(row)
    estimate = ExactEstimator().predict(ConfigTargets(RESULTS / "configs.json").target(row), run)
    return estimate, estimate.reserved(run.expandable_segments)


@pytest.mark.slow
@pytest.mark.parametrize("table, where", [
    (EDGE, {"sharding": "zero2", "batch_size": 12, "client": "trainer"}),  # fit within 0.2 GiB of the capacity
    (EDGE, {"sharding": "zero1"}),
    (EDGE_HELDOUT, {"model_id": "HuggingFaceTB/SmolLM3-3B"}),  # the guide's zero2 offload config, DeepSpeedCPUAdam
    (EDGE_HELDOUT, {"model_id": "allenai/OLMo-2-1124-7B", "batch_size": 16}),
])
def test_measured_edge_points_are_reproduced_with_their_verdict(table, where):
    """Measured points (H100 x2), simulated: allocated and reserved bytes as the GPU reported them (within 0.1%), and
    the verdict right within the last GiB of the GPU."""
    row, _ = history_of(table, **where)
    estimate, reserved = simulated(row)
    assert abs(estimate.peak_bytes - row["peak_allocated_bytes"]) <= 0.001 * row["peak_allocated_bytes"]
    assert abs(reserved - row["peak_reserved_bytes"]) <= 0.002 * row["peak_reserved_bytes"]
    assert reserved <= capacity_of(row)


@pytest.mark.slow
@pytest.mark.parametrize("table, model, batch", [(EDGE, "Qwen/Qwen2.5-7B", 8), (EDGE_HELDOUT, "Qwen/Qwen3-4B", 24)])
def test_points_that_ran_out_of_memory_do_not_fit(table, model, batch):
    rows = edge_rows(table)
    row = rows[(rows["model_id"] == model) & (rows["batch_size"] == batch) & rows["alloc_conf"].isna()].iloc[0]
    assert row["status"] == "oom"
    _, reserved = simulated(row)
    assert reserved > capacity_of(row)


# -- the readers' bounds and the allocator's rules, on their own ------------------------------------------------------

def test_allocator_settings_are_read_or_refused_in_one_line():
    from pipeline.training.alloc_conf import read_alloc_conf

    assert read_alloc_conf("expandable_segments:True")["expandable_segments"] is True
    settings = read_alloc_conf(" expandable_segments : false , garbage_collection_threshold:0.6")
    assert settings["expandable_segments"] is False and "memory fraction" in settings["notes"][0]
    for text, words in (("max_split_size_mb:128", "is not replayed"), ("backend:cudaMallocAsync", "not replayed"),
                        ("expandable_segments:yes", "True or False"), ("colour:red", "unknown key"),
                        ("garbage_collection_threshold:2", "between 0 and 1")):
        with pytest.raises(UserError, match=words):
            read_alloc_conf(text)


def test_a_yaml_alias_bomb_is_walked_once_per_container(tmp_path):
    """Ten levels of YAML aliases, each repeating the one below nine times: 9**10 paths, a few containers. The
    depth check visits each container once per depth, so it answers at once (a walk of every path would not end)."""
    import time

    from pipeline.estimate.sft_config import read_sft_config

    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, "
              f"*a{i - 1}]" for i in range(1, 11)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\nper_device_train_batch_size: 2\n")
    started = time.perf_counter()
    assert read_sft_config(path)["batch"] == 2  # the aliased keys are no option of SFTConfig: read past
    assert time.perf_counter() - started < 60  # a generous bound: the walk of 9**10 paths takes hours


def test_expandable_segments_map_pages_and_unmap_free_ones_at_the_capacity():
    """A pool's pages (20 MiB, large pool) are mapped as blocks need them and stay mapped when freed; at the
    capacity the free blocks' whole pages are unmapped first, so the new block fits where the mapped pages would
    not."""
    from pipeline.simulate.memory.allocator import ExpandableSegments

    page = 20 << 20
    allocator = ExpandableSegments(capacity=5 * page)
    first, _ = allocator.malloc(3 * page)
    second, _ = allocator.malloc(page)
    assert allocator.reserved == 4 * page
    allocator.free(first)
    assert allocator.reserved == 4 * page  # freed pages stay mapped
    allocator.malloc(2 * page)  # reuses the free block's addresses: its pages are still mapped
    assert allocator.reserved == 4 * page
    allocator.malloc(2 * page)  # 6 pages would pass the capacity: the free page is unmapped first
    assert allocator.reserved == 5 * page and not allocator.out_of_memory
    allocator.malloc(page)
    assert allocator.out_of_memory  # nothing left to unmap
