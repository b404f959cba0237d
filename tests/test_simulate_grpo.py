"""GRPOTrainer and RLOOTrainer (issue 35): TRL's own trainers run on meta tensors with their generation
(pipeline.simulate.clients.grpo) against the same code run for real on the CPU under the same tracker, and against
the points measured on an H200 with the KV cache (results/grpo_cache_heldout/h200, never tuned on).

What the CPU reference counts that a GPU run does not: the host tensors of TRL's data path (the sampler's
permutation, the prompts padded on the host before they move to the device), a few hundred bytes each; and what it
misses: `torch.tensor(x, device=...)`, which the CPU makes without a dispatched op (the meta run counts its copy,
as CUDA allocates one). So the phases agree within a few KiB, and the reserved bytes exactly."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, TINY_LLAMA

from pipeline.core.errors import UserError

pytest.importorskip("trl")

KIB = 1024


def run_rollout(device: str, client: str = "grpo", rollout: dict | None = None, lora: bool = False,
                accumulation: int = 1, batch: int = 4, seq: int = 12) -> dict:
    import datasets
    import torch

    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build
    from pipeline.simulate.clients.grpo import RolloutRun, meta_rollout_trainer, sampler_stand_ins
    from pipeline.simulate.clients.trainer import simulate_run, trainer_trace
    from pipeline.training.adapters import AdapterSpec
    from pipeline.training.rollout import Rollout
    from pipeline.training.step import Setting

    datasets.disable_progress_bars()
    torch.manual_seed(0)
    model = build(config_from_dict(TINY_LLAMA), "bf16-autocast", "eager", device=device)
    setting = Setting(client=client, gradient_checkpointing=True, gradient_accumulation=accumulation,
                      adapter=AdapterSpec.make(8) if lora else None,
                      rollout=Rollout.of(rollout or {"num_generations": 4, "max_completion_length": 16}, "test", client))
    trace = trainer_trace(device, more_stand_ins=sampler_stand_ins() if device == "meta" else None, host_values=True)
    trainer = meta_rollout_trainer(model, setting, "bf16-autocast", batch, seq, device, trace.rules)
    return simulate_run(RolloutRun(trainer, seq, "bf16-autocast", True, device), trace=trace)


@pytest.mark.parametrize("client, rollout, lora, accumulation", [
    ("grpo", {"num_generations": 4, "max_completion_length": 16, "beta": 0.04}, False, 1),  # a reference model
    ("grpo", {"num_generations": 2, "max_completion_length": 16, "num_iterations": 2}, True, 2),  # old log-probs
    ("rloo", {"max_completion_length": 16}, False, 1),  # RLOO's beta 0.05: a reference model
    # a generation every 3 optimizer steps: 4 steps run, the second generation beside the optimizer state
    ("grpo", {"num_generations": 4, "max_completion_length": 8, "steps_per_generation": 3}, False, 1),
], ids=["grpo-reference", "grpo-lora-iterations", "rloo", "grpo-steps-per-generation"])
def test_meta_rollout_equals_the_cpu_run(client, rollout, lora, accumulation):
    real = run_rollout("cpu", client, rollout, lora, accumulation)
    simulated = run_rollout("meta", client, rollout, lora, accumulation)
    assert set(simulated["phase_peaks"]) == set(real["phase_peaks"])
    assert {"generation", "forward", "backward", "optimizer"} <= set(real["phase_peaks"])
    for phase, value in real["phase_peaks"].items():
        assert abs(simulated["phase_peaks"][phase] - value) <= 4 * KIB, phase
    assert abs(simulated["peak_bytes"] - real["peak_bytes"]) <= 4 * KIB
    assert simulated["peak_reserved_bytes"] == real["peak_reserved_bytes"]
    assert simulated["optimizer_state_bytes"] == real["optimizer_state_bytes"]
    assert len(simulated["step_peaks"]) == len(real["step_peaks"]) == (
        4 if rollout.get("steps_per_generation") == 3 else 3)


def test_the_steps_reach_a_generation_after_the_optimizer_state_exists():
    """TRL generates every steps_per_generation x num_iterations micro-batches: a point runs until the second
    generation (the first beside the optimizer state), at least three optimizer steps."""
    from pipeline.training.grpo import rollout_steps
    from pipeline.training.rollout import Rollout
    from pipeline.training.step import Setting

    def steps(accumulation, **keys):
        return rollout_steps(Setting(client="grpo", gradient_accumulation=accumulation,
                                     rollout=Rollout.of(keys, "test", "grpo")))

    assert steps(1) == steps(4) == steps(2, num_iterations=2) == 3  # TRL's default: a generation every step
    assert steps(1, steps_per_generation=4) == 5 and steps(2, steps_per_generation=8) == 5
    assert steps(1, num_iterations=4) == 5 and steps(4, steps_per_generation=2) == 3


def test_generation_runs_every_completion_to_its_length():
    """The KV cache of 4 sequences of 12 + 32 tokens against 12 + 16: the generation phase grows by the cache
    (2 layers x K and V x 2 KV heads x 16 head dims x 2 bytes per token and sequence) and more."""
    short = run_rollout("meta", rollout={"num_generations": 4, "max_completion_length": 16})
    long = run_rollout("meta", rollout={"num_generations": 4, "max_completion_length": 32})
    cache = 4 * 16 * 2 * 2 * 2 * 16 * 2
    assert long["phase_peaks"]["generation"] - short["phase_peaks"]["generation"] >= cache


def measured_rows():
    import pandas as pd

    return pd.read_parquet(REPO / "results" / "grpo_cache_heldout" / "h200" / "peak_memory.parquet")


def test_exact_grpo_matches_an_h200_row_generated_with_the_kv_cache():
    """SmolLM2-135M, GRPO, 8 completions of 256 tokens per prompt of 64, B=8, generated with the KV cache as a
    checkpoint's generation config has it, measured on an H200 as its process's first point (never tuned on):
    allocated within 0.1%, reserved exact, the peak in backward, reached at the second step."""
    from pipeline.estimate import estimate

    row = measured_rows().set_index("model_id").loc["HuggingFaceTB/SmolLM2-135M"]
    rollout = json.loads(row["rollout"])
    assert rollout.pop("use_cache") is True and bool(row["use_cache"])
    answer = estimate("HuggingFaceTB/SmolLM2-135M", batch=int(row["batch_size"]), seq=int(row["seq_len"]),
                      client="grpo", precision="bf16-autocast", checkpointing=True, method="exact", **rollout)
    assert abs(answer["peak_bytes"] / row["peak_allocated_bytes"] - 1) < 0.001
    assert answer["peak_reserved_bytes"] == row["peak_reserved_bytes"]
    measured_phases = json.loads(row["phase_peaks"])
    assert answer["peak_phase"] == "backward" == max(measured_phases, key=measured_phases.get)
    steps = json.loads(row["step_peaks"])
    assert steps[0] < steps[1] == steps[2] and answer["step_peaks"][0] < answer["step_peaks"][1]
    assert answer["rollout"]["num_generations"] == 8


def test_decode_steps_replayed_equal_every_step_traced():
    """200-token completions: steps 2-4 traced and recorded, the rest replayed but for the checks at step 128
    and the last; the answer is the fully traced run's, byte for byte. A replay that would differ from a check
    step is caught, and the run traced again (the answer unchanged)."""
    from pipeline.simulate.memory import decode

    rollout = {"num_generations": 4, "max_completion_length": 200}
    replayed = []
    original = decode.Decode.replayed

    def counted(self, kwargs):
        replayed.append(self.index)
        return original(self, kwargs)

    decode.Decode.replayed = counted
    try:
        fast = run_rollout("meta", rollout=rollout)
    finally:
        decode.Decode.replayed = original
    with decode.replay_disabled():
        traced = run_rollout("meta", rollout=rollout)
    assert len(replayed) == 3 * (199 - 4 - 2)  # three generations of 199 decode steps
    for key in ("peak_bytes", "peak_reserved_bytes", "peak_reserved_expandable_bytes", "phase_peaks", "step_peaks",
                "components"):
        assert fast[key] == traced[key], key

    step = decode.Template.step
    decode.Template.step = lambda self, index: step(self, index + 1)  # a replay one token off
    try:
        with pytest.raises(decode.DecodeDiverged):
            run_rollout("meta", rollout=rollout)
    finally:
        decode.Template.step = step


@pytest.mark.parametrize("options, message", [
    ({"client": "grpo", "num_generations": 1}, "num_generations must be at least 2"),
    ({"client": "grpo", "batch": 6}, "must be a multiple of num_generations 8"),
    ({"client": "sft", "beta": 0.1}, "beta, max_completion_length: GRPO.s and RLOO.s settings"),
    ({"client": "rloo", "loss_type": "dapo"}, "loss_type 'dapo' is not one of none"),
    ({"client": "grpo", "vllm_gpu_memory_utilization": 1.5}, "vllm_gpu_memory_utilization must be a fraction"),
    ({"client": "grpo", "method": "formula"}, "estimated by the exact method only"),
    ({"client": "grpo", "steps_per_generation": 4096, "num_generations": 2}, "a generation every 4096 optimizer"),
])
def test_bad_rollouts_are_refused_in_one_line(options, message):
    from pipeline.estimate import estimate

    options = {"batch": 8, "seq": 16, "max_completion_length": 8, **options}
    for key in ("loss_type", "steps_per_generation"):  # not estimate() arguments: GRPOConfig keys of a file
        if key in options:
            options["grpo_config"] = {**options.get("grpo_config", {}), key: options.pop(key)}
    with pytest.raises(UserError, match=message):
        estimate(config={**TINY_LLAMA}, precision="bf16-autocast", **options)


def test_the_generation_batch_counts_every_gpu():
    """TRL's generation batch is per_device_train_batch_size x GPUs x steps_per_generation: 2 completions on each of
    4 GPUs make one prompt's 8; on one GPU they do not."""
    from pipeline.training.grpo import check
    from pipeline.training.rollout import Rollout

    check("grpo", Rollout(), batch=2, accumulation=1, seq=64, ranks=4)
    with pytest.raises(UserError, match=r"batch 2 x steps_per_generation 1 = 2 completions"):
        check("grpo", Rollout(), batch=2, accumulation=1, seq=64)


def test_a_grpo_config_file_is_read_like_an_sft_config(tmp_path):
    from pipeline.estimate.api import make_run

    path = tmp_path / "grpo.yaml"
    path.write_text("per_device_train_batch_size: 16\ngradient_accumulation_steps: 2\nnum_generations: 4\n"
                    "max_completion_length: 1024\nbeta: 0.04\nuse_peft: true\nlora_r: 8\nlora_target_modules: all-linear\n")
    run, _ = make_run(seq=128, client="grpo", grpo_config=str(path), weights_dtype="bf16")
    assert (run.batch, run.seq, run.gradient_accumulation, run.precision, run.checkpointing) == \
        (16, 128, 2, "bf16-autocast", True)
    assert (run.rollout.num_generations, run.rollout.max_completion_length, run.rollout.beta) == (4, 1024, 0.04)
    assert run.adapter.r == 8
    explicit, _ = make_run(seq=128, client="grpo", grpo_config=str(path), weights_dtype="bf16", rollout={"beta": 0.0})
    assert explicit.rollout.beta == 0.0 and explicit.rollout.num_generations == 4
    with pytest.raises(UserError, match="runs the grpo or rloo client, not sft"):
        make_run(seq=128, client="sft", grpo_config=str(path))


def test_the_command_answers_with_the_phases_and_refuses_in_one_line(tmp_path):
    from conftest import pipeline

    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_LLAMA))
    result = pipeline("estimate", "--client", "grpo", "--config", config, "--batch", 8, "--seq", 16,
                      "--num-generations", 4, "--max-completion-length", 8, "--beta", 0.04, "--precision",
                      "bf16-autocast", "--gpu", "H100 80GB", cwd=tmp_path)
    assert "GRPOTrainer" in result.stdout and "4 completions per prompt of 8 tokens (prompts of 16), beta 0.04, " \
        "a reference model" in result.stdout
    assert "peak in backward; by phase: setup" in result.stdout and "generation" in result.stdout
    assert "the peak is reached at step 2 of 3" in result.stdout
    bad = pipeline("estimate", "--client", "grpo", "--config", config, "--batch", 6, "--seq", 16, "--precision",
                   "bf16-autocast", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "multiple of num_generations 8" in bad.stderr
    unsized = pipeline("estimate", "--client", "rloo", "--config", config, "--batch", 4, "--max-completion-length", 4,
                       "--precision", "bf16-autocast", cwd=tmp_path)  # no --seq: TRL's former max_prompt_length
    assert "(prompts of 512)" in unsized.stdout and "note: prompts of 512 tokens (no --seq)" in unsized.stdout


def test_vllm_generates_outside_the_step_and_colocate_keeps_its_share_of_the_gpu():
    """use_vllm: no generation on the policy (its completions arrive as token ids), the old policy's log-probs for
    TRL's importance sampling correction instead; colocate mode's pool, vllm_gpu_memory_utilization of the GPU,
    is memory beside the step in the verdict; server mode's is not on the training GPU."""
    from pipeline.estimate import estimate

    common = dict(config={**TINY_LLAMA}, client="grpo", batch=8, seq=16, num_generations=4, max_completion_length=16,
                  precision="bf16-autocast", gpu="H100 80GB")
    plain = estimate(**common)
    colocate = estimate(**common, use_vllm=True, vllm_gpu_memory_utilization=0.5)
    server = estimate(**common, use_vllm=True, vllm_mode="server")
    assert "log-probs" not in plain["phase_peaks"] and "log-probs" in colocate["phase_peaks"]
    assert colocate["phase_peaks"]["generation"] < plain["phase_peaks"]["generation"]  # no KV cache on the policy
    assert colocate["vllm_pool_bytes"] == int(0.5 * colocate["device_total_bytes"])
    assert colocate["outside_bytes"] == plain["outside_bytes"] + colocate["vllm_pool_bytes"]
    assert server["outside_bytes"] == plain["outside_bytes"] and server.get("vllm_pool_bytes") is None
    assert server["peak_bytes"] == colocate["peak_bytes"]


def test_a_colocated_vllm_too_small_for_its_weights_would_not_start():
    from pipeline.estimate import estimate
    from pipeline.simulate.crashes import RunWouldCrash

    with pytest.raises(RunWouldCrash, match=r"vLLM \(colocate\) would not start: its bf16 copy of the weights"):
        estimate("Qwen/Qwen2.5-7B", client="grpo", batch=8, seq=16, use_vllm=True, vllm_gpu_memory_utilization=0.1,
                 gpu="H100 80GB")


def test_several_gpus_shard_the_policy_and_generate_on_each_rank():
    """GRPO on 2 GPUs as TRL launches it: DDP keeps the whole policy and its state per GPU; FSDP2 all-gathers it
    layer by layer (accelerate's FSDP2 keeps the bf16 weights as fp32 shards: the same bytes on 2 GPUs); ZeRO-3
    partitions the weights (half of them per GPU), gathering them whole for generation."""
    from pipeline.estimate import estimate

    common = dict(config={**TINY_LLAMA}, client="grpo", batch=8, seq=16, num_generations=4, max_completion_length=16,
                  precision="bf16-autocast", method="exact")
    one = estimate(**common)
    ddp = estimate(**common, num_gpus=2, sharding="ddp")
    fsdp = estimate(**common, num_gpus=2, sharding="fsdp")
    zero3 = estimate(**common, num_gpus=2, sharding="zero3")
    assert ddp["components"]["parameters"] == one["components"]["parameters"]
    assert ddp["components"]["optimizer_state"] == one["components"]["optimizer_state"]
    assert fsdp["components"]["all_gather"] > 0 and fsdp["components"]["gradients"] == 0
    assert abs(zero3["components"]["parameters"] * 2 - one["components"]["parameters"]) <= 1024  # partition padding
    for answer in (ddp, fsdp, zero3):
        assert {"generation", "forward", "backward", "optimizer"} <= set(answer["phase_peaks"])


def test_the_largest_batch_is_a_whole_number_of_prompts():
    """--max-batch-size for GRPO searches the batches TRL takes (multiples of num_generations here): the answer fits,
    one prompt more does not."""
    from pipeline.estimate import estimate, max_batch_size

    common = dict(config={**TINY_LLAMA}, client="grpo", seq=16, num_generations=4, max_completion_length=16,
                  precision="bf16-autocast", method="exact", gpu_memory_gib=1.5)
    largest = max_batch_size(**common)
    assert largest > 0 and largest % 4 == 0
    assert estimate(batch=largest, **common)["fits"] and not estimate(batch=largest + 4, **common)["fits"]
