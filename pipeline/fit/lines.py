"""The line fits of the fit stage: `y = a * x + b` by least squares over the registry models, with
bootstrap intervals and cross-validation (the engine of `fit.regression`), and the blog's line on our counts.

- `fit_hook_line`: hook-method activation ELEMENTS per token at (B, L) = (1, 1) against a parameter
  count (all, outside the embeddings, or active per token), optionally weighted 1/A^2 (least
  squares of the relative error).
- `fit_saved_line`: saved-for-backward BYTES per token against N, per precision, at a reference (B, L):
  the smallest L measured for that precision (smallest B there), with point estimates at every
  other L to show how the slope moves with L.

Each fit reports bootstrap 95% intervals for a and b, and R^2, MAE, MAPE and the worst error
in-sample, under shuffled k-fold and under leave-one-family-out cross-validation.
"""

from __future__ import annotations

import hashlib
import json
import math

from pipeline.core.errors import UserError
from pipeline.core.io import require_columns
from pipeline.fit.regression import SEED, line, metrics, relative_weights
from pipeline.fit.regression import fit as regression_fit
from pipeline.formulas.components import BLOG_A_BYTES_PER_ELEMENT, BLOG_INTERCEPT, BLOG_SLOPE, blog_a_bytes, unit_mismatch_example
from pipeline.core.vocabulary import PRECISION_OF_DTYPE

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


def fit_line(frame, x_column: str, y_column: str, seed: int = SEED, resamples: int = BOOTSTRAP_RESAMPLES,
             weighting: str = "none") -> dict:
    """Least-squares `y = a * x + b` over the rows, with bootstrap intervals and cross-validation.

    weighting "none": ordinary least squares (the blog's kind of fit, dominated by the largest
    models); "relative": sample weights 1/y^2, i.e. least squares of the relative error.
    """
    if weighting not in WEIGHTINGS:
        raise UserError(f"weighting {weighting!r} is not one of {', '.join(WEIGHTINGS)}")
    if len(frame) < 3 or frame[x_column].nunique() < 2:
        raise UserError(f"fit of {y_column} vs {x_column}: needs at least 3 models with distinct {x_column}, "
                        f"got {len(frame)}")
    x = frame[[x_column]].to_numpy(float)
    y = frame[y_column].to_numpy(float)
    families, ids = frame["family"].to_numpy(), frame["model_id"].to_numpy()
    weights = relative_weights(y) if weighting == "relative" else None
    fitted = regression_fit(line(), x, y, families, ids, weights, resamples, seed, kfold=KFOLD_SPLITS)
    n_families = len(set(families))
    lofo = fitted.predicted_lofo
    low, high = fitted.intervals(INTERVAL_LEVEL)
    return {
        "formula": f"{y_column} = a * {x_column} + b",
        "x": x_column,
        "y": y_column,
        "weighting": weighting,
        "a": fitted.coefficients[0],
        "b": fitted.intercept,
        "intervals": {"a": [float(low[0]), float(high[0])], "b": [float(low[1]), float(high[1])],
                      "level": INTERVAL_LEVEL, "method": "percentile bootstrap over models (resampled with replacement)",
                      "resamples": resamples, "resamples_used": len(fitted.draws), "seed": seed},
        "metrics": {
            "in_sample": metrics(y, fitted.predicted, ids),
            "kfold": {**metrics(y, fitted.predicted_kfold, ids), "splits": min(KFOLD_SPLITS, len(y)), "shuffle": True,
                      "seed": seed},
            "leave_one_family_out": None if lofo is None else {**metrics(y, lofo, ids), "splits": n_families},
        },
        "n_models": int(len(frame)),
        "n_families": int(n_families),
        "families": sorted(set(map(str, families))),
        "rows_sha256": rows_sha256(frame, ["model_id", "family", x_column, y_column]),
    }


def fit_hook_line(rows, x_column: str = "parameters", **kwargs) -> dict:
    fit = fit_line(rows, x_column, "elements_per_token", **kwargs)
    fit["units"] = {"x": f"{X_UNITS[x_column]} (count)", "y": "activation elements per token (hook method, B=1, L=1)",
                    "a": "elements per token per parameter", "b": "elements per token"}
    return fit


def fit_saved_line(models, activations, precision: str, **kwargs) -> dict | None:
    """Saved-for-backward bytes per token vs N at the reference (B, L), plus per-L point fits."""
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
            fitted = line().fit(group[["parameters"]].to_numpy(float), group["bytes_per_token"].to_numpy(float))
            by_seq_len.append({"seq_len": int(length), "batch_size": int(batch), "n_models": int(len(group)),
                               "a": float(fitted.coef_[0]), "b": float(fitted.intercept_)})
    fit["by_seq_len"] = by_seq_len
    return fit


# ----------------------------------------------------------------------------- the blog's numbers


def blog_evaluation(rows) -> dict:
    """The blog's coefficients on our hook counts (converted to elements), and its unit mismatch."""
    predicted_elements = blog_a_bytes(rows["parameters"].to_numpy(float)) / BLOG_A_BYTES_PER_ELEMENT
    return {
        "a": BLOG_SLOPE,
        "b": BLOG_INTERCEPT,
        "units": {"A": "fp32 bytes per token (4 bytes x hook elements)", "a": "fp32 bytes per token per parameter",
                  "b": "fp32 bytes per token"},
        "a_in_elements": BLOG_SLOPE / BLOG_A_BYTES_PER_ELEMENT,
        "b_in_elements": BLOG_INTERCEPT / BLOG_A_BYTES_PER_ELEMENT,
        "metrics_on_our_hook_counts": metrics(rows["elements_per_token"], predicted_elements, rows["model_id"]),
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
