"""DeepSpeed's ZeRO as the Trainer clients run it: its configs read and checked (one line, exit 2, for what is
unknown or contradictory), and the simulation (DeepSpeed's own code on meta under the fake process group) against
points measured on H200s (results/deepspeed*/h200, rank 0's row), asserted to the bytes the GPU reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.errors import UserError
from pipeline.training.adapters import AdapterSpec
from pipeline.training.values import Run
from pipeline.training.zero import default_config, read_deepspeed

REPO = Path(__file__).resolve().parent.parent
TABLES = {"tuned": REPO / "results" / "deepspeed" / "h200" / "peak_memory.parquet",
          "held-out": REPO / "results" / "deepspeed_heldout" / "h200" / "peak_memory.parquet"}
ZERO3 = REPO / "config" / "deepspeed" / "zero3.json"


def test_a_config_file_names_its_stage_and_leaves_autos_to_the_trainer():
    settings = read_deepspeed(ZERO3)
    assert settings["sharding"] == "zero3"
    assert "batch" not in settings and "autocast" not in settings  # "auto": the training arguments decide
    config = json.loads(settings["deepspeed"])
    assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"
    fixed = read_deepspeed({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4,
                            "bf16": {"enabled": True}})
    assert (fixed["sharding"], fixed["batch"], fixed["autocast"]) == ("zero2", 4, "bf16")


@pytest.mark.parametrize("config, message", [
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket": 5}}, "unknown zero_optimization key"),
    ({"zero_optimisation": {"stage": 3}}, "unknown DeepSpeed key"),
    ({"zero_optimization": {"stage": 0}}, "stage 0 is DeepSpeed's plain data parallelism"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param is stage 3's"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, "zero_force_ds_cpu_optimizer"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "NVMe is not simulated"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "ZeRO++"),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both enabled"),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Lamb"}}, "optimizer 'Lamb' is not simulated"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "big"}}, "whole number of elements"),
])
def test_unknown_or_contradictory_keys_are_refused(config, message):
    with pytest.raises(UserError, match=message):
        read_deepspeed(config)


def test_the_run_must_agree_with_the_config():
    config = read_deepspeed({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4})["deepspeed"]
    with pytest.raises(UserError, match="batch 4 is not the run's 2"):
        Run(2, 512, "bf16-autocast", client="sft", num_gpus=2, sharding="zero3", deepspeed=config)
    with pytest.raises(UserError, match="stage 3 is zero3, not sharding zero2"):
        Run(4, 512, "bf16-autocast", client="sft", num_gpus=2, sharding="zero2", deepspeed=config)
    with pytest.raises(UserError, match="use the trainer, sft or dpo client"):
        Run(4, 512, "bf16", num_gpus=2, sharding="zero3")
    assert json.loads(Run(4, 512, "bf16-autocast", client="trainer", num_gpus=2, sharding="zero2").deepspeed) \
        ["zero_optimization"] == {"stage": 2}


def test_training_files_and_accelerate_configs_name_deepspeed():
    from pipeline.estimate.api import make_run

    run, _ = make_run(seq=1024, training_args={"per_device_train_batch_size": 2, "bf16": True,
                                               "deepspeed": str(ZERO3)}, num_gpus=4)
    assert (run.client, run.sharding, run.batch, run.precision) == ("trainer", "zero3", 2, "amp-bf16")
    run, _ = make_run(batch=2, seq=1024, client="sft", accelerate_config={
        "distributed_type": "DEEPSPEED", "num_processes": 8, "mixed_precision": "bf16",
        "deepspeed_config": {"zero_stage": 2, "gradient_accumulation_steps": 4}})
    assert (run.num_gpus, run.sharding, run.gradient_accumulation) == (8, "zero2", 4)
    with pytest.raises(UserError, match="fsdp and deepspeed are both given"):
        make_run(seq=1024, num_gpus=2, training_args={"per_device_train_batch_size": 2, "fsdp": "full_shard",
                                                      "deepspeed": str(ZERO3)})
    with pytest.raises(UserError, match="not the DeepSpeed config's"):
        make_run(batch=2, seq=1024, client="sft", num_gpus=2, sharding="zero2", deepspeed=str(ZERO3))


def test_the_command_refuses_a_bad_config_in_one_line(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 3, "overlap_communication": True}}))
    out = subprocess.run([sys.executable, "-m", "pipeline", "estimate", "--model", "Qwen/Qwen2.5-1.5B", "--client",
                          "sft", "--num-gpus", "2", "--deepspeed", str(bad), "--batch", "2", "--seq", "512"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"error: {bad}: unknown zero_optimization key 'overlap_communication'"


def test_the_closed_forms_point_to_the_exact_method():
    from pipeline.estimate import estimate

    with pytest.raises(UserError, match="estimated by the exact method only"):
        estimate("Qwen/Qwen2.5-1.5B", batch=2, seq=512, client="sft", num_gpus=2, sharding="zero3",
                 method="formula")


def measured(table: str, model: str, client: str, n: int, sharding: str, lora: bool, batch: int, seq: int,
             config: Path | None) -> dict:
    from pipeline.training.points import read_peaks

    rows = read_peaks(TABLES[table])
    text = read_deepspeed(config)["deepspeed"] if config else default_config(sharding)  # None: the stage's defaults
    found = rows[(rows.model_id == model) & (rows.client == client) & (rows.num_gpus == n) & (rows["rank"] == 0)
                 & (rows.sharding == sharding) & (rows.lora_r.notna() == lora) & (rows.batch_size == batch)
                 & (rows.seq_len == seq) & (rows.deepspeed == text)]
    assert len(found) == 1, (model, client, sharding, batch, seq)
    return found.iloc[0].to_dict()


# (table, model, client, N, sharding, LoRA, B, L, config file): each a rank 0 row of the tables
CASES = [
    ("tuned", "Qwen/Qwen2.5-1.5B", "trainer", 2, "zero1", False, 4, 1024, None),
    ("tuned", "Qwen/Qwen2.5-1.5B", "trainer", 2, "zero2", False, 4, 1024, None),
    ("tuned", "Qwen/Qwen2.5-1.5B", "trainer", 2, "zero3", False, 4, 1024, None),
    ("held-out", "stabilityai/stablelm-2-1_6b", "dpo", 2, "zero2", False, 2, 1024, REPO / "config/deepspeed/zero2.json"),
    ("held-out", "Qwen/Qwen3-1.7B", "trainer", 2, "zero3", False, 4, 1024, ZERO3),
    ("held-out", "Qwen/Qwen3-1.7B", "trainer", 2, "zero3", False, 4, 1024, REPO / "config/deepspeed/zero3_offload.json"),
]


@pytest.mark.slow
@pytest.mark.parametrize("table, model, client, n, sharding, lora, batch, seq, config", CASES)
def test_the_simulation_reproduces_measured_zero_points(table, model, client, n, sharding, lora, batch, seq, config):
    from pipeline.inputs.configs import resolve_model
    from pipeline.simulate import simulate

    row = measured(table, model, client, n, sharding, lora, batch, seq, config)
    run = Run(batch, seq, row["precision"], client=client, checkpointing=bool(row["gradient_checkpointing"]),
              num_gpus=n, sharding=sharding, adapter=AdapterSpec.make(16) if lora else None,
              deepspeed=row["deepspeed"])
    estimate = simulate(resolve_model(model_id=model).config, run)
    assert abs(estimate.peak_bytes / row["peak_allocated_bytes"] - 1) < 0.01
    assert abs(estimate.reserved_bytes / row["peak_reserved_bytes"] - 1) < 0.1
    if "offload" in row["deepspeed"]:  # the host's share: below the process's growth of resident memory
        host = estimate.details["host_peak_bytes"]
        assert 0.85 < host / (row["host_peak_bytes"] - row["host_before_bytes"]) < 1.0


def test_the_server_takes_a_deepspeed_object_and_reads_no_path():
    from pipeline.serve.questions import check

    question = check({"config": {"model_type": "llama"}, "batch": 2, "seq": 512, "client": "sft", "num_gpus": 2,
                      "deepspeed": {"zero_optimization": {"stage": 3}}})
    assert question["deepspeed"] == {"zero_optimization": {"stage": 3}}
    with pytest.raises(UserError, match="deepspeed must be a JSON object"):
        check({"batch": 2, "seq": 512, "deepspeed": str(ZERO3)})
    with pytest.raises(UserError, match="training_args's deepspeed names a file; the server reads no paths"):
        check({"batch": 2, "seq": 512, "training_args": {"deepspeed": str(ZERO3)}})
    with pytest.raises(UserError, match="deepspeed_config_file names a file"):
        check({"batch": 2, "seq": 512, "accelerate_config": {"distributed_type": "DEEPSPEED", "deepspeed_config": {
            "deepspeed_config_file": str(ZERO3)}}})


def test_zero_offload_answers_the_host_memory_beside_the_gpu():
    """ZeRO-3 with the optimizer on the host: the GPU's peak drops, the host's bytes are in the answer (a tiny model:
    its fp32 partition, gradient and two AdamW moments on the host, 4 bytes each per element of rank 0's half)."""
    from pipeline.estimate import estimate

    config = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1024,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}
    on_gpu = {"zero_optimization": {"stage": 3}}
    offloaded = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
                 "zero_force_ds_cpu_optimizer": False}
    gpu = estimate(config=config, client="trainer", num_gpus=2, batch=2, seq=256, deepspeed=on_gpu)
    host = estimate(config=config, client="trainer", num_gpus=2, batch=2, seq=256, deepspeed=offloaded)
    assert gpu["method"] == host["method"] == "exact" and "host_peak_bytes" not in gpu
    assert host["peak_bytes"] < gpu["peak_bytes"] - 3 * 4 * 21_000_000
    assert 4 * 4 * 21_000_000 < host["host_peak_bytes"] < 6 * 4 * 22_000_000


def test_zero3_without_overlapped_communication_reduces_on_the_default_stream():
    """`overlap_comm: false` (LLaMA-Factory's ds_z3_config.json): DeepSpeed reduces on CUDA's default stream, whose
    `synchronize()` it calls; the simulation answers it (it raised AttributeError before): on a tiny model ~1 MiB
    less allocated and less reserved than the overlapped run, whose reduce stream keeps a pool of its own."""
    from pipeline.estimate import estimate

    config = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 1024, "torch_dtype": "bfloat16"}
    answers = {overlap: estimate(config=config, client="trainer", num_gpus=2, batch=2, seq=128,
                                 deepspeed={"zero_optimization": {"stage": 3, "overlap_comm": overlap}})
               for overlap in (True, False)}
    assert answers[False]["method"] == "exact" and answers[False]["peak_bytes"] > 0
    assert answers[True]["peak_bytes"] - answers[False]["peak_bytes"] == 1_048_064  # 1 MiB less 512 bytes
    assert answers[False]["peak_reserved_bytes"] < answers[True]["peak_reserved_bytes"]
