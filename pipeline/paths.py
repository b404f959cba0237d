"""Where the project's files are: the registry, the stage outputs, the committed results."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
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
