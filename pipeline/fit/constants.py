"""The heuristic estimator's empirical constants, measured from the peak table: the activations
multiplier per precision, the gradient-checkpointing factor and the reserved/allocated ratio."""

from __future__ import annotations

from pipeline.formulas.coefficients import BUILT_IN_RESERVED_RATIO, RESERVED_RATIO_QUANTILE
from pipeline.formulas.components import training_components
from pipeline.core.io import require_columns
from pipeline.core.vocabulary import OPTIMIZERS, PRECISIONS


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
