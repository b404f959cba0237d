"""The one regression engine of the project: a linear model (a scikit-learn estimator) fitted by
weighted least squares, cross-validated by family (`LeaveOneGroupOut`) and, where asked, by shuffled
k-fold, with percentile-bootstrap intervals that resample models; and the error metrics that every
fit reports.

Its users: the heuristic's lines (`fit.lines`), the closed-form formula (`fit.formula`, `fit.peak`),
the figures' bootstrap band and the validation's refits without a family. Each refit is
`clone(estimator).fit(...)`, so a fit never depends on an earlier one.
"""

from __future__ import annotations

from dataclasses import dataclass

SEED = 0
LEVEL = 0.95


def line():
    """y = a x + b, ordinary (weighted) least squares."""
    from sklearn.linear_model import LinearRegression

    return LinearRegression()


def non_negative_sum():
    """y = sum_k c_k x_k with every c_k >= 0, no intercept (the formula's terms)."""
    from sklearn.linear_model import LinearRegression

    return LinearRegression(positive=True, fit_intercept=False)


def relative_weights(y, offset=None):
    """Sample weights 1 / (y + offset)^2: least squares of the RELATIVE error of y + offset."""
    import numpy as np

    total = np.asarray(y, float) + (0.0 if offset is None else np.asarray(offset, float))
    return 1.0 / (total * total)


@dataclass
class Regression:
    """A fitted regression: the model on all rows, its predictions, the cross-validated predictions
    (None where not run) and the bootstrap's draws of the coefficients (intercept last, if any)."""

    model: object
    predicted: object
    predicted_lofo: object
    predicted_kfold: object
    draws: object
    resamples: int
    seed: int

    @property
    def coefficients(self) -> list[float]:
        return [float(c) for c in self.model.coef_]

    @property
    def intercept(self) -> float:
        return float(self.model.intercept_)

    def intervals(self, level: float = LEVEL):
        """Percentile intervals of each drawn coefficient: (low, high) arrays (the fit's own
        coefficients where no draw was made)."""
        import numpy as np

        draws = self.draws if len(self.draws) else np.array([self.parameters()])
        tail = (1 - level) / 2 * 100
        return np.percentile(draws, tail, axis=0), np.percentile(draws, 100 - tail, axis=0)

    def parameters(self) -> list[float]:
        return self.coefficients + ([self.intercept] if self.model.fit_intercept else [])


def fit(estimator, x, y, groups, ids, weights=None, resamples: int = 0, seed: int = SEED,
        kfold: int | None = None) -> Regression:
    """`estimator` fitted on (x, y) with `weights`; predictions with each family left out (`groups`),
    with shuffled k-fold when `kfold` is given, and `resamples` bootstrap draws over models (`ids`)."""
    import numpy as np
    from sklearn.base import clone
    from sklearn.model_selection import KFold, LeaveOneGroupOut, cross_val_predict

    x, y = np.asarray(x, float), np.asarray(y, float)
    groups, ids = np.asarray(groups), np.asarray(ids)
    params = {} if weights is None else {"sample_weight": np.asarray(weights, float)}
    model = clone(estimator).fit(x, y, **params)
    lofo = None
    if len(np.unique(groups)) >= 2:
        lofo = cross_val_predict(clone(estimator), x, y, groups=groups, cv=LeaveOneGroupOut(), params=params)
    folds = None
    if kfold:
        splitter = KFold(n_splits=min(kfold, len(y)), shuffle=True, random_state=seed)
        folds = cross_val_predict(clone(estimator), x, y, cv=splitter, params=params)
    return Regression(model, model.predict(x), lofo, folds, bootstrap(estimator, x, y, ids, weights, resamples, seed),
                      resamples, seed)


def bootstrap(estimator, x, y, ids, weights=None, resamples: int = 1000, seed: int = SEED):
    """Coefficients (intercept last, if fitted) of `resamples` refits on models drawn with replacement
    (all rows of a drawn model). With an intercept, a draw in which a feature takes one value is
    skipped: its slope is undefined."""
    import numpy as np
    from sklearn.base import clone

    x, y, ids = np.asarray(x, float), np.asarray(y, float), np.asarray(ids)
    weights = None if weights is None else np.asarray(weights, float)
    rng, unique = np.random.default_rng(seed), np.unique(ids)
    rows = {model_id: np.flatnonzero(ids == model_id) for model_id in unique}
    draws = []
    for _ in range(resamples):
        pick = np.concatenate([rows[m] for m in rng.choice(unique, len(unique))])
        if estimator.fit_intercept and any(np.unique(x[pick, k]).size < 2 for k in range(x.shape[1])):
            continue
        model = clone(estimator).fit(x[pick], y[pick], **({} if weights is None else {"sample_weight": weights[pick]}))
        draws.append(list(model.coef_) + ([model.intercept_] if estimator.fit_intercept else []))
    return np.array(draws)


def metrics(y, predicted, ids) -> dict:
    """R^2, MAE, MAPE, median and worst |relative error| (fractions) and the worst model of a prediction."""
    import numpy as np
    from sklearn.metrics import mean_absolute_error, mean_absolute_percentage_error, r2_score

    y, predicted = np.asarray(y, float), np.asarray(predicted, float)
    relative = np.abs(predicted - y) / np.abs(y)
    worst = int(np.argmax(relative))
    return {
        "n": int(len(y)),
        "r2": float(r2_score(y, predicted)) if len(y) > 1 else None,
        "mae": float(mean_absolute_error(y, predicted)),
        "mape": float(mean_absolute_percentage_error(y, predicted)),
        "median_ape": float(np.median(relative)),
        "max_abs_error": float(np.max(np.abs(predicted - y))),
        "max_abs_percentage_error": float(relative[worst]),
        "worst_model_id": str(np.asarray(ids)[worst]),
    }


def fit_terms(x, y, families, ids, terms, resamples: int = 200, seed: int = SEED, offset=None) -> dict:
    """A non-negative sum of named terms fitted for the relative error of y + `offset` (known bytes
    added to y for the quantity judged): coefficients, bootstrap intervals over models, in-sample and
    leave-one-family-out metrics, and the predictions (`public` leaves those out)."""
    import numpy as np

    y = np.asarray(y, float)
    offset = np.zeros_like(y) if offset is None else np.asarray(offset, float)
    fitted = fit(non_negative_sum(), x, y, families, ids, relative_weights(y, offset), resamples, seed)
    lofo = fitted.predicted_lofo if fitted.predicted_lofo is not None else np.full_like(y, np.nan)
    low, high = fitted.intervals()
    return {
        "coefficients": dict(zip(terms, fitted.coefficients)),
        "intervals": {t: [float(a), float(b)] for t, a, b in zip(terms, low, high)},
        "interval_method": f"percentile bootstrap over models, {resamples} resamples, seed {seed}, 95%",
        "metrics": {"in_sample": metrics(y + offset, fitted.predicted + offset, ids),
                    "leave_one_family_out": metrics(y + offset, lofo + offset, ids)},
        "n_points": int(len(y)), "n_models": int(len(np.unique(ids))), "n_families": int(len(np.unique(families))),
        "predicted_lofo": lofo, "predicted": fitted.predicted,
    }


def public(fit_result: dict) -> dict:
    """A `fit_terms` result without its per-row predictions (what the coefficient file keeps)."""
    return {k: v for k, v in fit_result.items() if not k.startswith("predicted")}
