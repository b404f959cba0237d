"""What the page offers and labels: the registry's models, the GPU catalogue, each method's measured
accuracy on the standard step, and on the setting a question asks (client, adapters, precision, Liger,
layout of its GPUs: `setting_accuracy`). Read once when the server starts or first asked; all pure data, no torch.

Imports that may move with the package's layout: the registry (`pipeline.inputs.registry.load_registry`,
`pipeline.core.paths.DEFAULT_REGISTRY`), the GPU catalogue (`pipeline.formulas.gpus.DEVICES`), the stage
outputs' paths (`pipeline.core.paths.MODELS`, `CONFIGS`: relative to the working directory, as the
`estimate` command reads them).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from pipeline.core.errors import UserError

VALIDATION_SUMMARY = "results/validation_summary.json"
# The accuracy shown beside each method: the summary's row for it (the formula's on families left
# out of its fit, as the README quotes it), over the measured H200 peaks.
ACCURACY_ROWS = {"formula": ("formula-lofo", "families left out of the fit"), "exact": ("exact", "every point"),
                 "heuristic": ("heuristic-lofo", "families left out of the fit"), "blog": ("blog", "as published")}


def models() -> list[dict]:
    """The registry: id, family, model_type, parameters and active parameters, context length
    (from the activations stage's table when there is one), and whether the formula has its config facts."""
    from pipeline.core.paths import CONFIGS, DEFAULT_REGISTRY, MODELS
    from pipeline.inputs.registry import load_registry

    counted = _counted_models(MODELS)
    records = _config_records(CONFIGS)
    listed = []
    for entry in load_registry(DEFAULT_REGISTRY, check_model_types=False):
        row = counted.get(entry.id, {})
        listed.append({"id": entry.id, "family": entry.family, "model_type": entry.model_type,
                       "parameters": row.get("parameters"), "active_parameters": row.get("active_parameters"),
                       "context_length": row.get("context_length"),
                       "trust_remote_code": entry.trust_remote_code,
                       "formula": records.get(entry.id, {}).get("status") == "ok"})
    return listed


def _counted_models(path) -> dict:
    if not Path(path).is_file():
        return {}
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["model_id", "status", "parameters", "active_parameters", "context_length"])
    rows = {}
    for row in table.to_pylist():
        if row["status"] == "ok":
            rows[row["model_id"]] = {key: None if value is None else int(value) for key, value in row.items()
                                     if key in ("parameters", "active_parameters", "context_length")}
    return rows


def _config_records(path) -> dict:
    from pipeline.inputs.configs import read_config_records
    from pipeline.core.errors import UserError

    if not Path(path).is_file():
        return {}
    try:
        return read_config_records(path)
    except UserError:
        return {}


def gpus() -> list[dict]:
    """The GPU catalogue: name, nvidia-smi total (MiB and bytes), CUDA's total where known, the source."""
    from pipeline.formulas.gpus import DEVICES

    return [{"name": d.name, "total_mib": d.total_mib, "total_bytes": d.total_bytes,
             "cuda_total_mib": d.cuda_total_mib, "driver_reserved_bytes": d.driver_reserved_bytes,
             "source": d.source} for d in DEVICES.values()]


def accuracy() -> dict:
    """Per method: |error| of the peak (median, 90th percentile, worst) and the fit verdict's accuracy
    over the measured points, from the validate stage's summary ({} without one)."""
    path = Path(VALIDATION_SUMMARY)
    if not path.is_file():
        return {}
    overall = json.loads(path.read_text()).get("overall", {})
    found = {}
    for method, (row, basis) in ACCURACY_ROWS.items():
        if row in overall:
            r = overall[row]
            found[method] = {"basis": basis, "points": r.get("points"),
                             "median": r.get("median_abs_relative_error"), "p90": r.get("p90_abs_relative_error"),
                             "worst": r.get("worst_abs_relative_error"), "fit_accuracy": r.get("fit_accuracy"),
                             "source": f"{VALIDATION_SUMMARY} ({row})"}
    return found


# The words of a setting, as `estimate` names them (the answer's own fields), and their defaults.
# padding_free: packed or padding-free rows (TRL's packing turns it on), measured apart
SETTING_WORDS = {"client": "loop", "precision": None, "lora_r": None, "quantization": None, "liger_kernel": False,
                 "num_gpus": 1, "sharding": None, "tensor_parallel": 1, "padding_free": False}
CLIENT_NAMES = {"loop": "the standard loop", "trainer": "Trainer", "sft": "SFTTrainer", "dpo": "DPOTrainer",
                "grpo": "GRPOTrainer", "rloo": "RLOOTrainer"}
SPLIT_ORDER = ("held-out", "tuned")  # rows no estimator was tuned on first
SINGLE_GPU = "1 GPU"  # the validation's layout of one GPU (tables from before several GPUs have no layout column)


def setting_of(words: dict) -> dict:
    """The setting a question asks, from estimate's words (one-line UserError for a bad one); its layout is the
    validation's group (`validate.settings.layout_name`: 1 GPU, ddp, fsdp, fsdp-no-reshard, hsdp, fsdp+tp, tp)."""
    from types import SimpleNamespace

    from pipeline.core.vocabulary import CLIENTS, PRECISIONS, QUANTIZATIONS, SHARDINGS, check_choice
    from pipeline.validate.settings import layout_name

    unknown = sorted(set(words) - set(SETTING_WORDS))
    if unknown:
        raise UserError(f"unknown field {unknown[0]!r}; a setting is named by {', '.join(SETTING_WORDS)}")
    setting = {**SETTING_WORDS, **{k: v for k, v in words.items() if v is not None}}
    if setting["precision"] is None:
        raise UserError("precision is required (the answer's precision, bf16-autocast included)")
    check_choice("client", setting["client"], CLIENTS)
    check_choice("precision", setting["precision"], PRECISIONS)
    for name in ("lora_r", "num_gpus", "tensor_parallel"):
        value = setting[name]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise UserError(f"{name} must be a positive integer, not {value!r}")
    if setting["quantization"] is not None:
        check_choice("quantization", setting["quantization"], QUANTIZATIONS)
    if setting["sharding"] is not None:
        check_choice("sharding", setting["sharding"], SHARDINGS)
    for name in ("liger_kernel", "padding_free"):
        if not isinstance(setting[name], bool):
            raise UserError(f"{name} must be true or false, not {setting[name]!r}")
    if setting["num_gpus"] > 1 and setting["sharding"] is None and setting["tensor_parallel"] == 1:
        raise UserError(f"{setting['num_gpus']} GPUs need a sharding ({', '.join(SHARDINGS)}) or tensor_parallel")
    adapters = "qlora" if setting["quantization"] else "lora" if setting["lora_r"] else "full"
    layout = layout_name(SimpleNamespace(**{k: setting[k] for k in ("num_gpus", "sharding", "tensor_parallel")}))
    return {"client": setting["client"], "adapters": adapters, "quantization": setting["quantization"],
            "precision": setting["precision"], "liger_kernel": setting["liger_kernel"], "num_gpus": setting["num_gpus"],
            "layout": layout, "padding_free": setting["padding_free"]}


def setting_label(setting: dict) -> str:
    """The setting in words: "SFTTrainer, QLoRA (nf4), bf16-autocast, one GPU" (several: "4 GPUs, fsdp")."""
    adapters = {"full": "full fine-tuning", "lora": "LoRA", "qlora": f"QLoRA ({setting['quantization']})"}
    parts = [CLIENT_NAMES[setting["client"]], adapters[setting["adapters"]], setting["precision"]]
    if setting["liger_kernel"]:
        parts.append("Liger")
    if setting.get("padding_free"):
        parts.append("packed rows")
    parts.append("one GPU" if setting["num_gpus"] == 1 else f"{setting['num_gpus']} GPUs, {setting['layout']}")
    return ", ".join(parts)


def setting_accuracy(words: dict) -> dict:
    """Per method, the measured |error| of the peak (median, 90th percentile, worst) and the fit verdict's
    accuracy on the measured points of the setting the words name (`setting_of`: its layout too), from the
    settings' validation (results/settings_validation.parquet): its held-out points where the method has any, else
    its tuned ones (`split` says which; `gpu_counts` the numbers of GPUs they ran on). `missing` says why there is
    none (a setting or layout never measured)."""
    from pipeline.core.paths import REPO_ROOT, SETTINGS_VALIDATION

    setting = setting_of(words)
    found = {"setting": setting, "label": setting_label(setting),
             "source": str(SETTINGS_VALIDATION.relative_to(REPO_ROOT)), "methods": {}, "missing": None}
    rows = _matching_rows(setting)
    for method in _methods():
        summary = _method_accuracy(rows[rows["estimator"] == method])
        if summary:
            found["methods"][method] = summary
    if not found["methods"]:
        found["missing"] = f"no point of this setting ({found['label']}) is measured on a GPU: its accuracy is unknown"
    return found


def _methods() -> tuple:
    from pipeline.core.vocabulary import METHODS

    return METHODS


@functools.lru_cache(maxsize=1)
def _settings_validation():
    from pipeline.core.io import read_table
    from pipeline.core.paths import SETTINGS_VALIDATION

    return read_table(SETTINGS_VALIDATION, "settings validation")


def _matching_rows(setting: dict):
    table = _settings_validation()
    adapters = table["lora_r"].isna().map({True: "full", False: "lora"}).where(table["quantization"].isna(), "qlora")
    same = ((table["client"] == setting["client"]) & (table["precision"] == setting["precision"])
            & (adapters == setting["adapters"]) & (table["liger_kernel"] == setting["liger_kernel"]))
    if setting["quantization"]:
        same &= table["quantization"] == setting["quantization"]
    packed = table["packing"].notna() if "packing" in table.columns else False
    same &= packed == setting.get("padding_free", False)
    if "layout" in table.columns:
        same &= table["layout"] == setting["layout"]
    elif setting["layout"] != SINGLE_GPU:  # a table of one GPU's points
        same &= False
    return table[same]


def _method_accuracy(rows) -> dict | None:
    """One method's summary on its held-out rows, else its tuned ones (None: no ok point in either)."""
    from pipeline.validate.peaks import error_summary

    for split in SPLIT_ORDER:
        group = rows[rows["split"] == split]
        summary = error_summary(group)
        if summary["points"]:
            return {"split": split, "points": summary["points"], "median": summary["median_abs_relative_error"],
                    "p90": summary["p90_abs_relative_error"], "worst": summary["worst_abs_relative_error"],
                    "fit_accuracy": summary["reserved_fit_accuracy"], "fit_points": summary["reserved_fit_points"],
                    "devices": sorted(group["device"].unique().tolist()),
                    "gpu_counts": sorted(int(n) for n in group["num_gpus"].unique()) if "num_gpus" in group else [1]}
    return None
