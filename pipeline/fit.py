"""Stage: refit and cross-validate the blog's heuristic `A = a * N + b`; write `results/coefficients.json`.

Fits (scikit-learn LinearRegression, one point per registry model with status ok):

- `hook_elements_vs_parameters`: hook-method activation ELEMENTS per token at (B, L) = (1, 1)
  against N, the total parameter count, ordinary least squares. This is the blog's fit in
  consistent units (the blog's published A is fp32 BYTES per token, i.e. 4 x elements).
- `hook_elements_vs_non_embedding_parameters`, `hook_elements_vs_active_parameters`: the same
  against parameters outside the embeddings, and against parameters active per token (MoE:
  routed experts counted top_k / num_experts; dense models: all).
- `hook_elements_vs_active_parameters_relative`: against active parameters, weighted 1/A^2 (least
  squares of the relative error). The heuristic estimator uses this one (the top-level a, b):
  MoE models sit far below any line through dense ones in total N, and unweighted least squares
  lets the few largest models decide the line for all the others.
- `saved_bytes_vs_parameters`: saved-for-backward BYTES per token against N, per precision,
  at a reference (B, L): the smallest L measured for that precision (smallest B there), with
  point estimates at every other L to show how the slope moves with L.

Each fit reports bootstrap 95% intervals for a and b, and R^2, MAE, MAPE and the worst error
in-sample, under shuffled k-fold and under leave-one-family-out cross-validation.

With a peak-memory table the stage also measures the empirical constants the heuristic
estimator uses (an activations multiplier per precision and the gradient-checkpointing factor);
see `peak_constants`.

The coefficient file is plain JSON that anyone can use without this code; `pipeline.coefficients`
holds its schema and reads, checks and writes it; `pipeline.formulas` the formulas it feeds.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
from pathlib import Path

from pipeline.coefficients import (BUILT_IN_RESERVED_RATIO, RESERVED_RATIO_QUANTILE, SCHEMA_VERSION, default_constants,
                                   estimator_structure, write_coefficients)
from pipeline.errors import UserError
from pipeline.formulas import (BLOG_A_BYTES_PER_ELEMENT, BLOG_INTERCEPT, BLOG_SLOPE, blog_a_bytes,
                               training_components, unit_mismatch_example)
from pipeline.paths import ACTIVATIONS, COEFFICIENTS, CONFIGS, MODELS
from pipeline.vocabulary import OPTIMIZERS, PRECISION_OF_DTYPE, PRECISIONS

SEED = 0
FORMULA_TABLE_HEADER = ("Closed-form activation formula (pipeline/features.py, fitted by pipeline/formula_fit.py) "
                        "beside A = a*N + b, the blog's published line and Korthikanti et al.; |relative error| "
                        "per model (hook) or per (model, B, L) point (saved bytes).\n\n")
# The peak rows come from the validate stage, which has every estimator's peaks.
PEAK_SECTION_POINTER = ("\n## Peak of the standard training step\n\nIn `peak_comparison.md`, written by the "
                        "validate stage (`python -m pipeline validate`).\n")
KFOLD_SPLITS = 5
BOOTSTRAP_RESAMPLES = 1000
INTERVAL_LEVEL = 0.95

WEIGHTINGS = ("none", "relative")
# The heuristic estimator's fit: against active parameters (MoE models would otherwise sit far below
# any line through the dense ones) and weighted for relative error (else the largest models decide).
HEURISTIC_FIT = "hook_elements_vs_active_parameters_relative"
X_UNITS = {
    "parameters": "parameters (tied weights counted once)",
    "non_embedding_parameters": "parameters outside the embeddings and an untied output head",
    "active_parameters": "parameters active per token (all of them for a dense model; MoE: routed experts "
                         "counted top_k / num_experts)",
}
HOOK_COLUMNS = ["model_id", "family", "parameters", "non_embedding_parameters", "elements_per_token"]


# ----------------------------------------------------------------------------- inputs


def read_table(path, label: str):
    """A parquet table; one-line UserError when it is missing or unreadable."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: {label} table not found")
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # noqa: BLE001 - any parquet failure is a bad input file
        raise UserError(f"{path}: {label} table is not readable parquet ({type(exc).__name__})") from None


def require_columns(frame, columns, label: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise UserError(f"{label}: column {missing[0]!r} missing")


def ok_models(models):
    require_columns(models, ["model_id", "family", "status", "parameters", "non_embedding_parameters"], "models table")
    columns = ["model_id", "family", "parameters", "non_embedding_parameters"]
    columns += [c for c in ("active_parameters",) if c in models.columns]  # per token, for MoE
    return models[models["status"] == "ok"][columns]


def hook_rows(models, activations):
    """One row per ok model: its hook-method elements per token at (1, 1) and its parameter counts.

    Hook elements do not depend on the dtype; when several dtypes were counted, float32 wins.
    """
    require_columns(activations, ["model_id", "method", "dtype", "batch_size", "seq_len", "status",
                                   "elements_per_token"], "activations table")
    hooks = activations[(activations["method"] == "hook") & (activations["status"] == "ok")
                        & (activations["batch_size"] == 1) & (activations["seq_len"] == 1)].copy()
    hooks["dtype_rank"] = (hooks["dtype"].map(PRECISION_OF_DTYPE) != "fp32").astype(int)
    hooks = hooks.sort_values(["model_id", "dtype_rank"]).drop_duplicates("model_id")
    rows = ok_models(models).merge(hooks[["model_id", "elements_per_token"]], on="model_id")
    columns = HOOK_COLUMNS + [c for c in ("active_parameters",) if c in rows.columns]
    return rows[columns].sort_values("model_id").reset_index(drop=True)


def saved_rows(models, activations, precision: str):
    """Saved-for-backward rows of one precision (all B, L), joined with the ok models."""
    saved = activations[(activations["method"] == "saved") & (activations["status"] == "ok")].copy()
    saved["precision"] = saved["dtype"].map(PRECISION_OF_DTYPE)
    saved = saved[saved["precision"] == precision]
    require_columns(saved, ["bytes_per_token"], "activations table")
    rows = ok_models(models).merge(
        saved[["model_id", "batch_size", "seq_len", "bytes_per_token"]], on="model_id")
    return rows.sort_values(["seq_len", "batch_size", "model_id"]).reset_index(drop=True)


def rows_sha256(frame, columns) -> str:
    """SHA-256 of the rows used: JSON lines of `columns`, rows sorted, numbers as JSON numbers."""
    records = frame[list(columns)].sort_values(list(columns)).to_dict("records")
    text = "\n".join(json.dumps(_plain(r), sort_keys=True) for r in records)
    return hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------- fitting


def error_metrics(y, predicted) -> dict:
    """R^2, MAE, MAPE and the worst errors (units of y; percentages as fractions)."""
    import numpy as np
    from sklearn.metrics import mean_absolute_error, mean_absolute_percentage_error, r2_score

    y, predicted = np.asarray(y, float), np.asarray(predicted, float)
    relative = np.abs(predicted - y) / np.abs(y)
    return {
        "n": int(len(y)),
        "r2": float(r2_score(y, predicted)) if len(y) > 1 else None,
        "mae": float(mean_absolute_error(y, predicted)),
        "mape": float(mean_absolute_percentage_error(y, predicted)),
        "max_abs_error": float(np.max(np.abs(predicted - y))),
        "max_abs_percentage_error": float(np.max(relative)),
        "worst_index": int(np.argmax(relative)),
    }


def _with_worst_model(metrics: dict, model_ids) -> dict:
    metrics = dict(metrics)
    metrics["worst_model_id"] = str(list(model_ids)[metrics.pop("worst_index")])
    return metrics


def sample_weights(y, weighting: str):
    """None (ordinary least squares) or 1/y^2: least squares of the RELATIVE error."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting {weighting!r} is not one of {WEIGHTINGS}")
    return None if weighting == "none" else 1.0 / (y * y)


def bootstrap_intervals(x, y, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = SEED,
                        level: float = INTERVAL_LEVEL, weighting: str = "none") -> dict:
    """Percentile bootstrap intervals of slope and intercept, resampling models with replacement."""
    import numpy as np

    x, y = np.asarray(x, float), np.asarray(y, float)
    weights = sample_weights(y, weighting)
    rng = np.random.default_rng(seed)
    slopes, intercepts = [], []
    for _ in range(resamples):
        pick = rng.integers(0, len(x), len(x))
        if np.unique(x[pick]).size < 2:
            continue  # a line through one x value is undefined
        # The same (weighted) least-squares line as LinearRegression, without its per-call overhead (x1000);
        # polyfit's w multiplies the residuals, hence the square root of the sample weights.
        w = None if weights is None else np.sqrt(weights[pick])
        slope, intercept = np.polyfit(x[pick], y[pick], 1, w=w)
        slopes.append(slope)
        intercepts.append(intercept)
    tail = (1 - level) / 2 * 100
    return {
        "a": [float(v) for v in np.percentile(slopes, [tail, 100 - tail])],
        "b": [float(v) for v in np.percentile(intercepts, [tail, 100 - tail])],
        "level": level,
        "method": "percentile bootstrap over models (resampled with replacement)",
        "resamples": resamples,
        "resamples_used": len(slopes),
        "seed": seed,
    }


def fit_line(frame, x_column: str, y_column: str, seed: int = SEED, resamples: int = BOOTSTRAP_RESAMPLES,
             weighting: str = "none") -> dict:
    """Least-squares `y = a * x + b` over the rows, with bootstrap intervals and cross-validation.

    weighting "none": ordinary least squares (the blog's kind of fit, dominated by the largest
    models); "relative": sample weights 1/y^2, i.e. least squares of the relative error.
    """
    from sklearn.linear_model import LinearRegression
    from sklearn.model_selection import KFold, LeaveOneGroupOut, cross_val_predict

    if len(frame) < 3 or frame[x_column].nunique() < 2:
        raise UserError(f"fit of {y_column} vs {x_column}: needs at least 3 models with distinct {x_column}, "
                        f"got {len(frame)}")
    x = frame[[x_column]].to_numpy(float)
    y = frame[y_column].to_numpy(float)
    families = frame["family"].to_numpy()
    weights = sample_weights(y, weighting)
    params = {} if weights is None else {"sample_weight": weights}  # sliced per fold by cross_val_predict
    line = LinearRegression().fit(x, y, **params)
    ids = frame["model_id"]
    metrics = {"in_sample": _with_worst_model(error_metrics(y, line.predict(x)), ids)}
    folds = min(KFOLD_SPLITS, len(frame))
    kfold = KFold(n_splits=folds, shuffle=True, random_state=seed)
    predicted = cross_val_predict(LinearRegression(), x, y, cv=kfold, params=params)
    metrics["kfold"] = _with_worst_model(error_metrics(y, predicted), ids)
    metrics["kfold"].update(splits=folds, shuffle=True, seed=seed)
    n_families = len(set(families))
    if n_families >= 2:
        predicted = cross_val_predict(LinearRegression(), x, y, cv=LeaveOneGroupOut(), groups=families, params=params)
        metrics["leave_one_family_out"] = _with_worst_model(error_metrics(y, predicted), ids)
        metrics["leave_one_family_out"].update(splits=n_families)
    else:
        metrics["leave_one_family_out"] = None
    return {
        "formula": f"{y_column} = a * {x_column} + b",
        "x": x_column,
        "y": y_column,
        "weighting": weighting,
        "a": float(line.coef_[0]),
        "b": float(line.intercept_),
        "intervals": bootstrap_intervals(x[:, 0], y, resamples, seed, weighting=weighting),
        "metrics": metrics,
        "n_models": int(len(frame)),
        "n_families": int(n_families),
        "families": sorted(set(map(str, families))),
        "rows_sha256": rows_sha256(frame, ["model_id", "family", x_column, y_column]),
    }


def fit_hook(rows, x_column: str = "parameters", **kwargs) -> dict:
    fit = fit_line(rows, x_column, "elements_per_token", **kwargs)
    fit["units"] = {"x": f"{X_UNITS[x_column]} (count)", "y": "activation elements per token (hook method, B=1, L=1)",
                    "a": "elements per token per parameter", "b": "elements per token"}
    return fit


def fit_saved(models, activations, precision: str, **kwargs) -> dict | None:
    """Saved-for-backward bytes per token vs N at the reference (B, L), plus per-L point fits."""
    from sklearn.linear_model import LinearRegression

    rows = saved_rows(models, activations, precision)
    if rows.empty:
        return None
    seq_len = int(rows["seq_len"].min())
    batch_size = int(rows[rows["seq_len"] == seq_len]["batch_size"].min())
    reference = rows[(rows["seq_len"] == seq_len) & (rows["batch_size"] == batch_size)]
    if len(reference) < 3:
        return None
    fit = fit_line(reference, "parameters", "bytes_per_token", **kwargs)
    fit.update(precision=precision, batch_size=batch_size, seq_len=seq_len)
    fit["units"] = {"x": "parameters (count)", "y": f"bytes saved for backward per token ({precision})",
                    "a": "bytes per token per parameter", "b": "bytes per token"}
    by_seq_len = []
    for (length, batch), group in rows.groupby(["seq_len", "batch_size"]):
        if len(group) >= 3 and group["parameters"].nunique() >= 2:
            line = LinearRegression().fit(group[["parameters"]].to_numpy(float), group["bytes_per_token"].to_numpy(float))
            by_seq_len.append({"seq_len": int(length), "batch_size": int(batch), "n_models": int(len(group)),
                               "a": float(line.coef_[0]), "b": float(line.intercept_)})
    fit["by_seq_len"] = by_seq_len
    return fit


# ----------------------------------------------------------------------------- the blog's numbers


def blog_evaluation(rows) -> dict:
    """The blog's coefficients on our hook counts (converted to elements), and its unit mismatch."""
    predicted_elements = blog_a_bytes(rows["parameters"].to_numpy(float)) / BLOG_A_BYTES_PER_ELEMENT
    metrics = _with_worst_model(error_metrics(rows["elements_per_token"], predicted_elements), rows["model_id"])
    return {
        "a": BLOG_SLOPE,
        "b": BLOG_INTERCEPT,
        "units": {"A": "fp32 bytes per token (4 bytes x hook elements)", "a": "fp32 bytes per token per parameter",
                  "b": "fp32 bytes per token"},
        "a_in_elements": BLOG_SLOPE / BLOG_A_BYTES_PER_ELEMENT,
        "b_in_elements": BLOG_INTERCEPT / BLOG_A_BYTES_PER_ELEMENT,
        "metrics_on_our_hook_counts": metrics,
        "unit_mismatch": unit_mismatch_example(),
    }


# ----------------------------------------------------------------------------- constants from peaks


def peak_rows(peaks, checkpointing: bool):
    """ok rows of the standard training step, with or without gradient checkpointing."""
    require_columns(peaks, ["model_id", "family", "parameters", "precision", "optimizer", "gradient_checkpointing",
                             "batch_size", "seq_len", "status", "peak_allocated_bytes"], "peak table")
    keep = (peaks["status"] == "ok") & peaks["peak_allocated_bytes"].notna()
    keep &= peaks["gradient_checkpointing"].fillna(False).astype(bool) == checkpointing
    keep &= peaks["precision"].isin(PRECISIONS) & peaks["optimizer"].isin(OPTIMIZERS)
    if "variant" in peaks.columns:
        keep &= peaks["variant"].fillna("standard") == "standard"
    return peaks[keep]


def _activation_ratios(rows, a: float, b: float, multipliers: dict | None = None, active: dict | None = None):
    """Per row: (measured peak - modelled weights, state, gradients and amp weight copies) / modelled B x L
    activations.

    Only rows where the remainder exceeds the modelled optimizer intermediates count: there the
    activations branch of the max() is the one the measurement shows.
    """
    ratios = []
    for row in rows.itertuples(index=False):
        elements = a * (active or {}).get(row.model_id, row.parameters) + b
        multiplier = (multipliers or {}).get(row.precision, 1.0)
        parts = training_components(row.parameters, elements, row.batch_size, row.seq_len, row.precision,
                                    row.optimizer, activation_multiplier=multiplier)
        # the multiplier scales the B x L term only, not amp's weight copies (the part left at multiplier 0)
        fixed = training_components(row.parameters, elements, row.batch_size, row.seq_len, row.precision,
                                    row.optimizer, activation_multiplier=0.0)["activations"]
        # the heuristic's peak: weights + state + gradients + max(intermediates, activations)
        remainder = row.peak_allocated_bytes - parts["parameters"] - parts["optimizer_state"] - parts["gradients"]
        if remainder > parts["optimizer_intermediates"]:
            ratios.append((row.precision, (remainder - fixed) / (parts["activations"] - fixed)))
    return ratios


def peak_constants(peaks, a: float, b: float, active: dict | None = None) -> dict:
    """Empirical constants of the heuristic estimator, measured from the peak table.

    - activation multiplier per precision: median over activation-dominated ok rows (no
      checkpointing) of (peak - weights - optimizer state - gradients [- amp weight copies]) /
      (A(N) * B * L * bytes per element);
      a precision without such rows takes the median over all rows; none at all -> 1.0.
    - checkpointing factor: the same ratio on gradient-checkpointing rows, divided by the
      multiplier (activation memory with checkpointing / without); None when not measured.

    `active`: parameters active per token by model id (A's x); a model not in it counts as dense.
    """
    import numpy as np

    ratios = _activation_ratios(peak_rows(peaks, checkpointing=False), a, b, active=active)
    pooled = [r for _, r in ratios]
    multipliers = {}
    for precision in PRECISIONS:
        own = [r for p, r in ratios if p == precision]
        if own:
            value, how = float(np.median(own)), "median over this precision's activation-dominated rows"
        elif pooled:
            value, how = float(np.median(pooled)), "median over all precisions' rows (none of this one)"
        else:
            value, how = 1.0, "not measured (no activation-dominated rows)"
        multipliers[precision] = {"value": value, "n_points": len(own), "how": how}
    checkpoint_ratios = [r for _, r in _activation_ratios(
        peak_rows(peaks, checkpointing=True), a, b, {p: m["value"] for p, m in multipliers.items()}, active)]
    checkpointing = {
        "value": float(np.median(checkpoint_ratios)) if checkpoint_ratios else None,
        "n_points": len(checkpoint_ratios),
        "how": "median over activation-dominated gradient-checkpointing ok rows of (peak - weights - optimizer "
               "state - gradients [- amp weight copies]) / (multiplier x A(N) x B x L x bytes per element)"
               if checkpoint_ratios else "not measured",
    }
    return {"activation_multiplier": multipliers, "checkpointing_factor": checkpointing,
            "reserved_ratio": reserved_ratio_constant(peaks)}


def reserved_ratio_constant(peaks) -> dict:
    """peak reserved / peak allocated over the ok rows (its median): the closed-form estimators'
    reserved margin."""
    if "peak_reserved_bytes" not in peaks.columns:
        return BUILT_IN_RESERVED_RATIO
    ok = peaks[(peaks["status"] == "ok") & (peaks["peak_allocated_bytes"] > 0)].dropna(
        subset=["peak_reserved_bytes", "peak_allocated_bytes"])
    if ok.empty:
        return BUILT_IN_RESERVED_RATIO
    ratios = (ok["peak_reserved_bytes"] / ok["peak_allocated_bytes"]).astype(float)
    return {"value": max(1.0, round(float(ratios.quantile(RESERVED_RATIO_QUANTILE)), 4)), "n_points": len(ratios),
            "how": f"{RESERVED_RATIO_QUANTILE:.0%} quantile (median) over the peak table's ok rows of "
                   "peak_reserved_bytes / peak_allocated_bytes"}


# ----------------------------------------------------------------------------- the coefficient file


def fit_coefficients(models, activations, peaks=None, seed: int = SEED,
                     resamples: int = BOOTSTRAP_RESAMPLES, inputs: dict | None = None, records: dict | None = None) -> dict:
    """Every fit, the blog's evaluation and the estimator's constants, as the coefficient file's dict.

    `records`: configs.json records (the closed-form formula's features); the formula's section is
    fitted from them (`pipeline.formula_fit`).
    """
    from pipeline.formula_fit import fit_formula

    from importlib import metadata

    from pipeline.provenance import PACKAGE_VERSION
    from pipeline.provenance import software

    rows = hook_rows(models, activations)
    if "active_parameters" not in rows.columns:
        rows["active_parameters"] = None
    rows["active_parameters"] = rows["active_parameters"].fillna(rows["parameters"])  # unknown: taken as dense
    run = {"seed": seed, "resamples": resamples}
    fits = {
        "hook_elements_vs_parameters": fit_hook(rows, "parameters", **run),  # the blog's fit, consistent units
        "hook_elements_vs_non_embedding_parameters": fit_hook(rows, "non_embedding_parameters", **run),
        "hook_elements_vs_active_parameters": fit_hook(rows, "active_parameters", **run),
        HEURISTIC_FIT: fit_hook(rows, "active_parameters", weighting="relative", **run),
        "saved_bytes_vs_parameters": {p: fit_saved(models, activations, p, **run) for p in PRECISIONS},
    }
    main = fits[HEURISTIC_FIT]
    active = dict(zip(rows["model_id"], rows["active_parameters"]))
    constants = default_constants() if peaks is None else peak_constants(peaks, main["a"], main["b"], active)
    data_hashes = {"hook_rows": main["rows_sha256"]}
    if peaks is not None:
        import pandas as pd

        used = pd.concat([peak_rows(peaks, False), peak_rows(peaks, True)])
        data_hashes["peak_rows"] = rows_sha256(used, ["model_id", "precision", "optimizer", "gradient_checkpointing",
                                                "batch_size", "seq_len", "peak_allocated_bytes"])
    if records is None and Path(CONFIGS).is_file():
        from pipeline.configs import read_config_records

        records = read_config_records(CONFIGS)
    formula, _ = fit_formula(models, activations, peaks, records or {}, seed=seed)
    versions = software()
    coefficients = {
        "schema_version": SCHEMA_VERSION,
        "formula": "A = a * N + b",
        "description": "Activation elements per token (hook method: outputs of every module, forward of a (1, 1) "
                       "input, eval, no_grad) as a linear function of N, the parameters active per token, fitted "
                       "by least squares of the relative error (the heuristic estimator's fit; the other fits, "
                       "including the blog's kind against all parameters, are under 'fits').",
        "fit": HEURISTIC_FIT,
        "x": "active_parameters",
        "weighting": "relative",
        "units": {
            "N": X_UNITS["active_parameters"] + " (count)",
            "A": "activation elements per token (multiply by bytes per element of the precision for bytes)",
            "a": "elements per token per parameter",
            "b": "elements per token",
        },
        "a": main["a"],
        "b": main["b"],
        "intervals": {"a": main["intervals"]["a"], "b": main["intervals"]["b"], "level": INTERVAL_LEVEL,
                      "method": main["intervals"]["method"], "resamples": resamples, "seed": seed},
        "metrics": main["metrics"],
        "n_models": main["n_models"],
        "n_families": main["n_families"],
        "fits": fits,
        "estimator": {**estimator_structure(), **constants},
        "blog": blog_evaluation(rows),
        "activation_formula": formula,
        "data": {
            "sha256": hashlib.sha256(json.dumps(data_hashes, sort_keys=True).encode()).hexdigest(),
            "sha256_of_rows": data_hashes,
            "how": "SHA-256 of JSON lines (sorted keys) of the rows used, sorted by every column; "
                   "sha256 is the hash of the JSON of the per-table hashes",
            "inputs": {k: str(v) for k, v in (inputs or {}).items()},
            "rows": _plain(rows.to_dict("records")),
        },
        "versions": {
            "torch": versions["torch_version"],
            "transformers": versions["transformers_version"],
            "scikit-learn": metadata.version("scikit-learn"),
            "package": PACKAGE_VERSION,
            "git_commit": versions["git_commit"],
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    return _plain(coefficients)


def _plain(value):
    """JSON-safe copy: numpy scalars to Python numbers, NaN to None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def run_fit(models_path, activations_path, out_path, peaks_path=None, seed: int = SEED,
            resamples: int = BOOTSTRAP_RESAMPLES, configs_path=CONFIGS, comparison_path=None) -> dict:
    from pipeline.configs import read_config_records
    from pipeline.formula_fit import comparison_markdown
    from pipeline.io import write_text

    records = read_config_records(configs_path)
    models = read_table(models_path, "models")
    activations = read_table(activations_path, "activations")
    peaks = read_table(peaks_path, "peak-memory") if peaks_path else None
    inputs = {"models": models_path, "activations": activations_path}
    if peaks_path:
        inputs["peaks"] = peaks_path
    inputs["configs"] = configs_path
    coefficients = fit_coefficients(models, activations, peaks, seed, resamples, inputs, records)
    write_coefficients(coefficients, out_path)
    comparison_path = comparison_path or Path(out_path).with_name("formula_comparison.md")
    write_text(FORMULA_TABLE_HEADER + comparison_markdown(coefficients["activation_formula"]["comparison"])
               + PEAK_SECTION_POINTER, comparison_path)
    return coefficients


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("fit", help="refit and cross-validate A = a*N + b; write coefficients.json")
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--activations", default=ACTIVATIONS)
    parser.add_argument("--peaks", default=None, help="peak_memory.parquet, for the estimator's empirical constants")
    parser.add_argument("--configs", default=CONFIGS, help="configs.json (the formula's config facts)")
    parser.add_argument("--out", default=COEFFICIENTS)
    parser.add_argument("--comparison", default=None,
                        help="markdown table formula vs baselines (default: formula_comparison.md beside --out)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--resamples", type=int, default=BOOTSTRAP_RESAMPLES)
    parser.set_defaults(handler=_fit_command)


def _fit_command(args) -> int:
    result = run_fit(args.models, args.activations, args.out, args.peaks, args.seed, args.resamples, args.configs,
                     args.comparison)
    print(summary_line(result) + f" -> {args.out}")
    return 0


def summary_line(c: dict) -> str:
    lofo = c["metrics"]["leave_one_family_out"] or {}
    lo, hi = c["intervals"]["a"]
    return (f"fit: A = {c['a']:.4e} * N + {c['b']:.4e} elements/token (a in [{lo:.3e}, {hi:.3e}]), "
            f"{c['n_models']} models, {c['n_families']} families, R^2 {c['metrics']['in_sample']['r2']:.3f}, "
            f"leave-one-family-out MAPE {lofo.get('mape', float('nan')):.1%}")
