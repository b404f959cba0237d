# Configuration and registry validation, the file names of the stage outputs, and the decisions
# that depend on the machine (measure on a GPU or reuse the committed peak table).

import os
import shutil
import subprocess
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from pipeline.inputs.configs import read_config_records
from pipeline.publish.dataset import failure_report
from pipeline.publish.figures import expected_figures
from pipeline.core import paths
from pipeline.core.paths import SETTINGS_TABLES
from pipeline.inputs.registry import SCHEMA_PATH as REGISTRY_SCHEMA
from pipeline.inputs.registry import safe_name, validate_registry_data


def in_workdir(path) -> str:
    """A stage output's path in the workflow's working directory (the package resolves its defaults
    to its own checkout; the workflow writes where it runs)."""
    return str(Path(path).relative_to(paths.REPO_ROOT))


ACTIVATIONS, COEFFICIENTS, CONFIGS, MODELS, PEAKS = map(in_workdir, (paths.ACTIVATIONS, paths.COEFFICIENTS, paths.CONFIGS,
                                                                     paths.MODELS, paths.PEAKS))
SETTINGS_SIMULATED, SETTINGS_SUMMARY, SETTINGS_VALIDATION, SIMULATED, VALIDATION = map(in_workdir, (
    paths.SETTINGS_SIMULATED, paths.SETTINGS_SUMMARY, paths.SETTINGS_VALIDATION, paths.SIMULATED, paths.VALIDATION))


# `--config publish=true` arrives as the string "true" (Snakemake only reads True/False as booleans).
if str(config.get("publish")).lower() in ("true", "false"):
    config["publish"] = str(config["publish"]).lower() == "true"

validate(config, "../config/config.schema.json")
if config["publish"] and config["publish_repo"].startswith("OWNER/"):
    raise WorkflowError("publish=True needs publish_repo=OWNER/NAME set to your dataset repo")


def load_registry_file(path):
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise WorkflowError(f"registry {path} not found (set it with --config registry=PATH)")
    except yaml.YAMLError:
        raise WorkflowError(f"registry {path} is not valid YAML")
    validate(data, str(REGISTRY_SCHEMA))
    validate_registry_data(data, str(path), check_model_types=False)  # duplicates; model types: configs stage
    return data


REGISTRY = load_registry_file(config["registry"])
MODEL_IDS = {safe_name(entry["id"]): entry["id"] for entry in REGISTRY["models"]}


wildcard_constraints:
    # safe_name(model_id): owner--name, no path separators, no '..'
    model=r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9_.-]*--[A-Za-z0-9][A-Za-z0-9_.-]*",


RESULTS = Path("results")
VALIDATION_SUMMARY = "results/validation_summary.md"
DATASET_CARD = "results/dataset/README.md"
PUBLISH_MANIFEST = "results/publish.json"


def gpu_present():
    """nvidia-smi lists a GPU (asks the driver only: no CUDA in this process)."""
    if not shutil.which("nvidia-smi"):
        return False
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def measure_mode():
    if config["measure"] == "auto":
        return "gpu" if gpu_present() else "reuse"
    return config["measure"]


MEASURE = measure_mode()
# With measure=reuse the committed peak table is a plain input (no rule makes it, so Snakemake
# never deletes or rebuilds it); without it, the peak-based outputs are left out.
HAVE_PEAKS = MEASURE == "gpu" or Path(PEAKS).exists()


def model_id(wildcards):
    """The registry id behind a {model} file name; an id not in the registry is an error."""
    if wildcards.model not in MODEL_IDS:
        raise WorkflowError(f"{wildcards.model}: not a model of {config['registry']}")
    return MODEL_IDS[wildcards.model]


def plan_models():
    from pipeline.measure.sweep.plan import load_plan, plan_models

    return plan_models(load_plan(config["sweep_plan"]))


def measured_models(wildcards):
    """Per-model tables of the plan's models that are in the registry and have a config.

    Known once the configs checkpoint has run (a model without a config has nothing to measure).
    """
    records = read_config_records(checkpoints.configs.get().output.configs)
    ok = {model for model, record in records.items() if record["status"] == "ok"}
    return [
        f"results/peak_memory_parts/{safe_name(model)}.parquet"
        for model in plan_models()
        if model in ok and safe_name(model) in MODEL_IDS
    ]


def peak_inputs(wildcards):
    return {"peaks": PEAKS} if HAVE_PEAKS else {}


def simulate_mode():
    if config["simulate"] == "auto":
        if MEASURE == "gpu":
            return "run"
        return "reuse" if Path(SIMULATED).exists() else "off"
    return config["simulate"]


# With simulate=reuse the committed table is a plain input, as the peaks are with measure=reuse.
SIMULATE = simulate_mode() if HAVE_PEAKS else "off"
if SIMULATE == "reuse" and not Path(SIMULATED).exists():
    raise WorkflowError(f"simulate=reuse needs {SIMULATED}; use simulate=run to make it")


def simulated_inputs(wildcards):
    """The simulate stage's table (exact estimator, simulated subset), unless simulate=off."""
    return {"simulated": SIMULATED} if SIMULATE != "off" else {}


# Committed tables some figures draw (measured, or made by a benchmark script), under results/.
FIGURE_TABLES = ("lora/h100/peak_memory.parquet", "sft/h100/peak_memory.parquet", "layouts/formula_vs_exact.parquet",
                 "layouts/peak_vs_gpus.parquet")


def available_results():
    """File names under results/ that exist or will be made by this run."""
    names = {"configs.json", "models.parquet", "activations.parquet", "coefficients.json"}
    if HAVE_PEAKS:
        names |= {"peak_memory.parquet", "validation.parquet"}
    if HAVE_SETTINGS:
        names.add("settings_validation.parquet")
    names |= {name for name in FIGURE_TABLES if Path("results", name).exists()}
    return names


def figure_path(name):
    return f"results/figures/{name}.png"


# Several GPUs: measured only when asked (measure=gpu distributed=true) on a machine with them.
DISTRIBUTED = MEASURE == "gpu" and str(config.get("distributed", False)).lower() == "true"
# Each several-GPU table and its plan; `--config distributed_gpu=h100` names the GPU the tables are measured on.
DISTRIBUTED_GPU = config.get("distributed_gpu", "h200")
DISTRIBUTED_PLANS = {
    f"results/distributed/{DISTRIBUTED_GPU}/peak_memory.parquet": "config/sweep_distributed_clients.yaml",
    f"results/distributed_heldout/{DISTRIBUTED_GPU}/peak_memory.parquet": "config/sweep_distributed_heldout.yaml",
    f"results/distributed_8/{DISTRIBUTED_GPU}/peak_memory.parquet": "config/sweep_distributed.yaml",
    f"results/distributed_mp_bf16/{DISTRIBUTED_GPU}/peak_memory.parquet": "config/sweep_distributed_mp_bf16.yaml",
    f"results/deepspeed/{DISTRIBUTED_GPU}/peak_memory.parquet": "config/sweep_deepspeed.yaml",
    f"results/deepspeed_heldout/{DISTRIBUTED_GPU}/peak_memory.parquet": "config/sweep_deepspeed_heldout.yaml",
}
# The measured training-settings tables (committed; measured with `sweep --plan config/sweep_trainer*.yaml`).
SETTINGS_PRESENT = [path for path in SETTINGS_TABLES if Path(path).exists()]
HAVE_SETTINGS = bool(SETTINGS_PRESENT) and (SIMULATE == "run" or Path(SETTINGS_SIMULATED).exists())
FIGURES = expected_figures(available_results())


def final_outputs():
    outputs = [DATASET_CARD, PUBLISH_MANIFEST] + [figure_path(name) for name in FIGURES]
    if HAVE_PEAKS:
        outputs.append(VALIDATION)
    if HAVE_SETTINGS:
        outputs.append(SETTINGS_VALIDATION)
    if DISTRIBUTED:
        outputs.extend(DISTRIBUTED_PLANS)
    return outputs


onstart:
    if MEASURE == "reuse":
        note = "reusing the committed" if HAVE_PEAKS else "no GPU and no committed"
        print(f"measure: {note} {PEAKS} (measure=gpu re-measures on a GPU)")
    if SIMULATE == "reuse":
        print(f"simulate: reusing the committed {SIMULATED} (simulate=run re-simulates)")


onsuccess:
    failed = failure_report(str(RESULTS))
    if failed:
        print(f"{len(failed)} failure(s), each a row in the tables (subset: model: status: reason):")
        print("\n".join(f"  {line}" for line in failed))


onerror:
    failed = failure_report(str(RESULTS))
    if failed:
        print("failures recorded so far (subset: model: status: reason):")
        print("\n".join(f"  {line}" for line in failed))
    print("see logs/ for each rule's log")
