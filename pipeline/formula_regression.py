"""The formula's regressions: non-negative least squares of the relative error, leave-one-family-out
cross-validation and a bootstrap over models (scikit-learn, numpy; imported by the fit only)."""

from __future__ import annotations

RESAMPLES = 200
SEED = 0


def _fit(x, y, weights):
    from sklearn.linear_model import LinearRegression

    return LinearRegression(positive=True, fit_intercept=False).fit(x, y, sample_weight=weights)


def _metrics(y, predicted, ids) -> dict:
    import numpy as np
    from sklearn.metrics import r2_score

    relative = np.abs(predicted - y) / np.abs(y)
    worst = int(np.argmax(relative))
    return {"n": int(len(y)), "r2": float(r2_score(y, predicted)), "mape": float(relative.mean()),
            "median_ape": float(np.median(relative)), "max_abs_percentage_error": float(relative[worst]),
            "worst_model_id": str(ids[worst])}


def fit_terms(x, y, families, ids, terms, resamples: int = RESAMPLES, seed: int = SEED, offset=None) -> dict:
    """Coefficients, bootstrap intervals (resampling models), in-sample and leave-one-family-out metrics.

    `offset`: known bytes added to y for the quantity judged (the peak): weights and metrics are
    then relative to y + offset.
    """
    import numpy as np

    x, y = np.asarray(x, float), np.asarray(y, float)
    families, ids = np.asarray(families), np.asarray(ids)
    offset = np.zeros_like(y) if offset is None else np.asarray(offset, float)
    weights = 1.0 / ((y + offset) ** 2)
    model = _fit(x, y, weights)
    lofo = np.empty_like(y)
    for family in np.unique(families):
        out = families == family
        lofo[out] = _fit(x[~out], y[~out], weights[~out]).predict(x[out]) if (~out).any() else np.nan
    rng, unique_ids, draws = np.random.default_rng(seed), np.unique(ids), []
    for _ in range(resamples):
        pick = np.concatenate([np.flatnonzero(ids == i) for i in rng.choice(unique_ids, len(unique_ids))])
        draws.append(_fit(x[pick], y[pick], weights[pick]).coef_)
    if not draws:  # no intervals asked for (a cross-validation refit)
        draws = [model.coef_]
    low, high = np.percentile(np.array(draws), [2.5, 97.5], axis=0)
    return {
        "coefficients": dict(zip(terms, map(float, model.coef_))),
        "intervals": {t: [float(a), float(b)] for t, a, b in zip(terms, low, high)},
        "interval_method": f"percentile bootstrap over models, {resamples} resamples, seed {seed}, 95%",
        "metrics": {"in_sample": _metrics(y + offset, model.predict(x) + offset, ids),
                    "leave_one_family_out": _metrics(y + offset, lofo + offset, ids)},
        "n_points": int(len(y)), "n_models": int(len(unique_ids)), "n_families": int(len(np.unique(families))),
        "predicted_lofo": lofo, "predicted": model.predict(x),
    }


def _public(fit: dict) -> dict:
    return {k: v for k, v in fit.items() if not k.startswith("predicted")}
