"""Where the project's files are: the registry, the stage outputs, the committed results."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_REGISTRY = REPO_ROOT / "models.yaml"
DEFAULT_COEFFICIENTS = REPO_ROOT / "results" / "coefficients.json"

# Stage outputs, relative to the working directory (the workflow runs in the repository root).
CONFIGS = "results/configs.json"
MODELS = "results/models.parquet"
ACTIVATIONS = "results/activations.parquet"
PEAKS = "results/peak_memory.parquet"
PEAK_PARTS = "results/peak_memory_parts"
SIMULATED = "results/simulated.parquet"
COEFFICIENTS = "results/coefficients.json"
VALIDATION = "results/validation.parquet"

# The training settings beyond the standard step (Trainer, amp-fp16, optimizers, adapters): one
# measured table per GPU and plan, with its split (held-out rows are never tuned on).
SETTINGS_TABLES = {
    "results/trainer/h100/peak_memory.parquet": "tuned",
    "results/trainer_heldout/h100/peak_memory.parquet": "held-out",
    "results/trainer/h100_first_sweep/peak_memory.parquet": "tuned",
    "results/trainer/h200/peak_memory.parquet": "tuned",
    "results/trainer_heldout/h200/peak_memory.parquet": "held-out",
    "results/lora/h100/peak_memory.parquet": "tuned",
    "results/lora_heldout/h100/peak_memory.parquet": "held-out",
    # SFTTrainer, the Trainer in bf16-autocast and with Liger (config/sweep_sft*.yaml; tables absent until measured)
    "results/sft/h100/peak_memory.parquet": "tuned",
    "results/sft_qlora/h100/peak_memory.parquet": "tuned",
    "results/sft_heldout/h100/peak_memory.parquet": "held-out",
}
SETTINGS_SIMULATED = "results/settings_simulated.parquet"
SETTINGS_VALIDATION = "results/settings_validation.parquet"
SETTINGS_SUMMARY = "results/settings_validation.md"
