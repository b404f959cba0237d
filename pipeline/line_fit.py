"""The line fits of the fit stage: `y = a * x + b` by least squares over the registry models, with
bootstrap intervals and cross-validation (scikit-learn, numpy), and the blog's line on our counts.

- `fit_hook`: hook-method activation ELEMENTS per token at (B, L) = (1, 1) against a parameter
  count (all, outside the embeddings, or active per token), optionally weighted 1/A^2 (least
  squares of the relative error).
- `fit_saved`: saved-for-backward BYTES per token against N, per precision, at a reference (B, L):
  the smallest L measured for that precision (smallest B there), with point estimates at every
  other L to show how the slope moves with L.

Each fit reports bootstrap 95% intervals for a and b, and R^2, MAE, MAPE and the worst error
in-sample, under shuffled k-fold and under leave-one-family-out cross-validation.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from pipeline.errors import UserError
from pipeline.formulas import BLOG_A_BYTES_PER_ELEMENT, BLOG_INTERCEPT, BLOG_SLOPE, blog_a_bytes, unit_mismatch_example
from pipeline.vocabulary import PRECISION_OF_DTYPE

SEED = 0
KFOLD_SPLITS = 5
BOOTSTRAP_RESAMPLES = 1000
INTERVAL_LEVEL = 0.95

WEIGHTINGS = ("none", "relative")
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
    text = "\n".join(json.dumps(plain(r), sort_keys=True) for r in records)
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


def plain(value):
    """JSON-safe copy: numpy scalars to Python numbers, NaN to None."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
