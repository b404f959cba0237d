"""Where the project's files are: the registry, the stage outputs, the committed results."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REGISTRY = REPO_ROOT / "models.yaml"

# Stage outputs: the checkout's own results/, resolved from the code's location, never from the
# working directory (a command given no path reads and writes the project's files wherever it runs).
RESULTS = REPO_ROOT / "results"
CONFIGS = RESULTS / "configs.json"
MODELS = RESULTS / "models.parquet"
ACTIVATIONS = RESULTS / "activations.parquet"
PEAKS = RESULTS / "peak_memory.parquet"
PEAK_PARTS = RESULTS / "peak_memory_parts"
SIMULATED = RESULTS / "simulated.parquet"
COEFFICIENTS = RESULTS / "coefficients.json"
VALIDATION = RESULTS / "validation.parquet"
DATASET = RESULTS / "dataset"
FIGURES = RESULTS / "figures"

# The training settings beyond the standard step (Trainer, amp-fp16, optimizers, adapters): one
# measured table per GPU and plan, with its split (held-out rows are never tuned on); named by their
# path in the repository (a results folder holds them under the same names without "results/").
SETTINGS_TABLES = {
    "results/trainer/h100/peak_memory.parquet": "tuned",
    "results/trainer_heldout/h100/peak_memory.parquet": "held-out",
    "results/trainer/h100_first_sweep/peak_memory.parquet": "tuned",
    "results/trainer/h200/peak_memory.parquet": "tuned",
    "results/trainer_heldout/h200/peak_memory.parquet": "held-out",
    "results/lora/h100/peak_memory.parquet": "tuned",
    "results/lora_heldout/h100/peak_memory.parquet": "held-out",
    # SFTTrainer, the Trainer in bf16-autocast and with Liger (config/sweep_sft*.yaml); QLoRA under SFTTrainer
    # (sft_qlora: its first points showed how from_pretrained loads a 4-bit base, hence tuned)
    "results/sft/h100/peak_memory.parquet": "tuned",
    "results/sft_qlora/h100/peak_memory.parquet": "tuned",
    "results/sft_heldout/h100/peak_memory.parquet": "held-out",
    # DPOTrainer (config/sweep_dpo.yaml): first measured after the simulator's DPO client was written, and
    # never tuned on
    "results/dpo/h100/peak_memory.parquet": "held-out",
    # The 2025-26 architectures (config/sweep_new_arch*.yaml): the loop and the Trainer in fp32, bf16 and amp-bf16;
    # the held-out plan's models are fit.formula.HELD_OUT_MODELS, out of the formula's fit as well
    "results/new_arch/h100/peak_memory.parquet": "tuned",
    "results/new_arch_heldout/h100/peak_memory.parquet": "held-out",
    # config/sweep_norms_heldout.yaml: models of HELD_OUT_MODELS measured after the formula's query/key-norm and
    # soft-cap terms (the loop in bf16 and amp-bf16)
    "results/norms_heldout/h100/peak_memory.parquet": "held-out",
    # Several GPUs (config/sweep_distributed_clients.yaml, _heldout.yaml): the Trainer, SFTTrainer and DPOTrainer
    # under DDP and FSDP2, the loop under hsdp and tensor parallelism; every rank a row
    "results/distributed/h200/peak_memory.parquet": "tuned",
    "results/distributed_heldout/h200/peak_memory.parquet": "held-out",
    # mp-bf16 (FSDP2's mixed precision, the loop), measured after its simulation was written
    "results/distributed_mp_bf16/h200/peak_memory.parquet": "held-out",
    # DeepSpeed's ZeRO as the Trainer clients run it (config/sweep_deepspeed*.yaml): the held-out plan's models
    # were never looked at while its simulation was written
    "results/deepspeed/h200/peak_memory.parquet": "tuned",
    "results/deepspeed_heldout/h200/peak_memory.parquet": "held-out",
    # The edge of the GPU (config/sweep_edge*.yaml, issue 34): FSDP2 and ZeRO within the last GiB of an 80 GB H100
    # and past it, expandable segments, the DeepSpeed guide's configs with optimizer and scheduler sections; the
    # held-out plan measured after the code it checks
    "results/edge/h100/peak_memory.parquet": "tuned",
    "results/edge_heldout/h100/peak_memory.parquet": "held-out",
    # GRPOTrainer and RLOOTrainer (benchmarks/grpo/points.txt, issue 35): measured after their simulation was
    # written, never tuned on
    "results/grpo_heldout/h100/peak_memory.parquet": "held-out",
    "results/grpo_heldout/h200/peak_memory.parquet": "held-out",
    # config/sweep_grpo_distributed_heldout.yaml: GRPO and RLOO under FSDP2 and ZeRO-3 on 2 GPUs
    "results/grpo_distributed_heldout/h200/peak_memory.parquet": "held-out",
    # benchmarks/grpo/points.txt lines 11-17: generation with the KV cache, completions to 2,048, a 14B point past
    # the GPU (with and without expandable segments)
    "results/grpo_cache_heldout/h200/peak_memory.parquet": "held-out",
    # config/sweep_grpo_cache_distributed_heldout.yaml: the KV cache under ZeRO-3 on 2 GPUs
    "results/grpo_cache_distributed_heldout/h200/peak_memory.parquet": "held-out",
    # config/sweep_grpo_4gpu_heldout.yaml: the KV cache on 4 GPUs, FSDP2 with a reference model and ZeRO-3 at issue
    # 35's done-when question
    "results/grpo_4gpu_heldout/h200/peak_memory.parquet": "held-out",
    # Packed and padding-free SFTTrainer batches (benchmarks/packing/points.txt, issue 36): lines 1-5 looked at while
    # the simulation was checked, lines 6-14 measured beside them and never tuned on (a point past the GPU among them)
    "results/packing/h200/peak_memory.parquet": "tuned",
    "results/packing_heldout/h200/peak_memory.parquet": "held-out",
    # config/sweep_packing_distributed_heldout.yaml: packed SFT under DDP, FSDP2 and ZeRO-3 on 2 GPUs
    "results/packing_distributed_heldout/h200/peak_memory.parquet": "held-out",
    # config/sweep_qlora_distributed_heldout.yaml: QLoRA across GPUs (issue 36): SFTTrainer on an nf4 base under
    # FSDP2, ZeRO-3 and DDP on 2 and 4 GPUs
    "results/qlora_distributed_heldout/h200/peak_memory.parquet": "held-out",
    # config/sweep_lora_dropout_heldout.yaml: LoRA dropout (lora_dropout > 0) under the Trainer and SFTTrainer, on
    # LoRA and QLoRA bases, measured after the simulation ran PEFT's dropout, never tuned on
    "results/lora_dropout_heldout/h200/peak_memory.parquet": "held-out",
    # config/sweep_lora_dropout_distributed_heldout.yaml: LoRA dropout under FSDP2, ZeRO-3 and DDP on 2 GPUs
    "results/lora_dropout_distributed_heldout/h200/peak_memory.parquet": "held-out",
}
SETTINGS_SIMULATED = RESULTS / "settings_simulated.parquet"
SETTINGS_VALIDATION = RESULTS / "settings_validation.parquet"
SETTINGS_SUMMARY = RESULTS / "settings_validation.md"
