"""The subsets: which stage output each one comes from, read as DataFrames (coefficients.json flattened)."""

from __future__ import annotations

from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.core.io import read_json_object, read_table

# subset -> (file under results/, what one row is). Order is the card's order.
SUBSETS = {
    "models": ("models.parquet", "one row per registry model: parameter counts and architecture facts"),
    "activations": ("activations.parquet",
                    "one row per model x method x dtype x (batch, sequence length): activation counts"),
    "peak_memory": ("peak_memory.parquet",
                    "one row per measured point: CUDA peak memory of the standard training step"),
    "validation": ("validation.parquet",
                   "one row per measured point x estimator: predicted against measured peak"),
    "coefficients": ("coefficients.json", "the refit heuristic, flattened: one row per coefficient set"),
    "simulated": ("simulated.parquet", "one row per model x point: peak predicted by the exact simulator"),
    "features": ("configs.json", "one row per model: the closed-form formula's config features and N"),
    "training_settings": ("trainer/h100/peak_memory.parquet",
                          "one row per measured point of the settings beyond the standard step (transformers.Trainer "
                          "and its optimizers, amp-fp16, LoRA, QLoRA, TRL's SFTTrainer and DPOTrainer, bf16-autocast, Liger, "
                          "the 2025-26 architectures; on several GPUs under DDP, FSDP2, HSDP and tensor parallelism, "
                          "one row per rank, with num_gpus, sharding, shard_group, tensor_parallel), each GPU's and "
                          "plan's tables joined, with their split (tuned / held-out)"),
    "settings_validation": ("settings_validation.parquet",
                            "one row per training-settings point x estimator: predicted against measured peak "
                            "allocated and reserved, and the fit verdict"),
    "layouts": ("layouts/formula_vs_exact.parquet",
                "one row per model x layout beyond one node (8 to 1,024 GPUs: FSDP2, HSDP, tensor parallelism): "
                "the per-GPU peak by the exact simulator and by the formula (simulated, not measured), with its split"),
}


def load_tables(results_dir) -> dict:
    """The subsets present under `results_dir`, as DataFrames (absent files are left out)."""
    import pandas as pd

    results_dir = Path(results_dir)
    tables = {}
    for subset, (name, _) in SUBSETS.items():
        path = results_dir / name
        if not path.exists():
            continue
        if subset == "coefficients":
            tables[subset] = coefficients_table(read_json_object(path, "not found", "not a readable coefficient file",
                                                                "not a coefficient file"))
        elif subset == "features":
            tables[subset] = pd.DataFrame(features_table(path))
        elif subset == "training_settings":
            tables[subset] = settings_table(results_dir)
        else:
            tables[subset] = read_table(path, subset)
    if "models" not in tables:
        raise UserError(f"{results_dir}: models.parquet not found (run the activations stage first)")
    return tables


def settings_table(results_dir: Path):
    """The measured training-settings tables present under `results_dir`, joined, with their split."""
    import pandas as pd

    from pipeline.core.paths import SETTINGS_TABLES

    frames = [read_table(results_dir / Path(path).relative_to("results"), "training-settings").assign(split=split)
              for path, split in SETTINGS_TABLES.items() if (results_dir / Path(path).relative_to("results")).exists()]
    return pd.concat(frames, ignore_index=True)


def features_table(configs_path) -> list[dict]:
    """One row per ok config: the formula's features and N (pipeline.formulas.features), plus the hook count's
    own features (pipeline.formulas.hook_features: expert outputs as modules return them, a convolution's outputs)."""
    from pipeline.inputs.configs import read_config_records
    from pipeline.formulas.features import feature_rows, read_facts
    from pipeline.formulas.hook_features import HOOK_ONLY_TERMS, hook_feature_values

    records = read_config_records(configs_path)
    rows = feature_rows(records)
    for row in rows:
        config = records[row["model_id"]]["config"]
        hook = hook_feature_values(read_facts(config))
        row.update({f"feature_{term}": hook[term] for term in HOOK_ONLY_TERMS})
    return rows


def coefficients_table(coefficients: dict):
    """coefficients.json as a table: one row per fit (and per length for the saved-bytes fits),
    plus one row for the blog's own coefficients. The JSON file keeps everything else."""
    import pandas as pd

    fits = coefficients.get("fits", {})
    main_name = coefficients.get("fit") or next(iter(fits), None)
    rows = []
    for name, fit in fits.items():
        if name == "saved_bytes_vs_parameters":
            for precision, saved in (fit or {}).items():
                if saved:
                    rows.append(_fit_row(name, "reference length", saved, precision))
                    rows.extend(_per_length_row(name, precision, point, saved) for point in saved.get("by_seq_len", []))
        elif fit:
            rows.append(_fit_row(name, "heuristic" if name == main_name else "alternative", fit))
    blog = coefficients.get("blog", {})
    if blog:
        rows.append({"fit": "blog", "role": "published", "formula": "A = a * N + b", "x": "parameters",
                     "y": "fp32 bytes per token (hook method)", "a": blog.get("a"), "b": blog.get("b"),
                     "unit_a": blog.get("units", {}).get("a"), "unit_b": blog.get("units", {}).get("b")})
    versions = coefficients.get("versions", {})
    for row in rows:
        row.update(torch_version=versions.get("torch"), transformers_version=versions.get("transformers"),
                   git_commit=versions.get("git_commit"), fitted_at=coefficients.get("date"))
    return pd.DataFrame(rows)


def _fit_row(name: str, role: str, fit: dict, precision: str | None = None) -> dict:
    intervals, metrics, units = fit.get("intervals", {}), fit.get("metrics", {}), fit.get("units", {})
    row = {"fit": name, "role": role, "precision": precision, "formula": fit.get("formula"), "x": fit.get("x"),
           "y": fit.get("y"), "weighting": fit.get("weighting"), "batch_size": fit.get("batch_size"),
           "seq_len": fit.get("seq_len"),
           "a": fit.get("a"), "a_low": _end(intervals.get("a"), 0), "a_high": _end(intervals.get("a"), 1),
           "b": fit.get("b"), "b_low": _end(intervals.get("b"), 0), "b_high": _end(intervals.get("b"), 1),
           "interval_level": intervals.get("level"), "unit_a": units.get("a"), "unit_b": units.get("b"),
           "n_models": fit.get("n_models"), "n_families": fit.get("n_families")}
    for split in ("in_sample", "kfold", "leave_one_family_out"):
        values = metrics.get(split) or {}
        for metric in ("r2", "mape", "max_abs_percentage_error", "worst_model_id"):
            row[f"{split}_{metric}"] = values.get(metric)
    return row


def _per_length_row(name: str, precision: str, point: dict, reference: dict) -> dict:
    units = reference.get("units", {})
    return {"fit": name, "role": "point estimate at this length", "precision": precision,
            "formula": reference.get("formula"), "x": reference.get("x"), "y": reference.get("y"),
            "batch_size": point.get("batch_size"), "seq_len": point.get("seq_len"), "a": point.get("a"),
            "b": point.get("b"), "unit_a": units.get("a"), "unit_b": units.get("b"), "n_models": point.get("n_models")}


def _end(interval, index: int):
    return interval[index] if isinstance(interval, list) and len(interval) == 2 else None
