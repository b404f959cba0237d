"""The one regression engine (pipeline.fit.regression) on the committed hook counts: the heuristic's
line, its leave-one-family-out predictions against refits by hand, the bootstrap's draws over
models, the non-negative sum of the formula's terms, and the metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.fit.regression import bootstrap, fit, line, metrics, non_negative_sum, relative_weights

COEFFICIENTS = Path(__file__).resolve().parent.parent / "results" / "coefficients.json"


@pytest.fixture(scope="module")
def hook_rows():
    data = json.loads(COEFFICIENTS.read_text())
    rows = data["data"]["rows"]
    x = np.array([[r["active_parameters"] or r["parameters"]] for r in rows], float)
    y = np.array([r["elements_per_token"] for r in rows], float)
    families = np.array([r["family"] for r in rows])
    ids = np.array([r["model_id"] for r in rows])
    return data, x, y, families, ids


def test_the_heuristics_line_is_the_committed_one(hook_rows):
    data, x, y, families, ids = hook_rows
    fitted = fit(line(), x, y, families, ids, relative_weights(y), resamples=50, seed=0)
    assert fitted.coefficients[0] == pytest.approx(data["a"], rel=1e-9)
    assert fitted.intercept == pytest.approx(data["b"], rel=1e-9)
    lofo = metrics(y, fitted.predicted_lofo, ids)
    assert lofo["mape"] == pytest.approx(data["metrics"]["leave_one_family_out"]["mape"], rel=1e-9)
    assert lofo["worst_model_id"] == data["metrics"]["leave_one_family_out"]["worst_model_id"]


def test_leave_one_family_out_is_a_refit_without_the_family(hook_rows):
    _, x, y, families, ids = hook_rows
    weights = relative_weights(y)
    fitted = fit(line(), x, y, families, ids, weights)
    for family in ("pythia", "qwen2.5", "llama-3"):
        out = families == family
        refit = line().fit(x[~out], y[~out], sample_weight=weights[~out])
        assert np.allclose(fitted.predicted_lofo[out], refit.predict(x[out]), rtol=1e-12)


def test_bootstrap_resamples_models_and_is_reproducible(hook_rows):
    data, x, y, families, ids = hook_rows
    draws = bootstrap(line(), x, y, ids, relative_weights(y), resamples=200, seed=0)
    again = bootstrap(line(), x, y, ids, relative_weights(y), resamples=200, seed=0)
    assert draws.shape == (200, 2) and np.array_equal(draws, again)
    low, high = np.percentile(draws[:, 0], [2.5, 97.5])
    assert low < data["a"] < high
    # a model's several rows are drawn together: duplicating every row changes no draw
    doubled = bootstrap(line(), np.repeat(x, 2, axis=0), np.repeat(y, 2), np.repeat(ids, 2),
                        np.repeat(relative_weights(y), 2), resamples=20, seed=0)
    assert np.allclose(doubled, draws[:20], rtol=1e-9)


def test_non_negative_sum_keeps_every_coefficient_at_or_above_zero(hook_rows):
    _, x, y, families, ids = hook_rows
    features = np.column_stack([x[:, 0], -x[:, 0], np.ones_like(y)])  # the second term can only hurt
    fitted = fit(non_negative_sum(), features, y, families, ids, relative_weights(y), resamples=10)
    assert min(fitted.coefficients) >= 0 and fitted.coefficients[1] == 0
    low, high = fitted.intervals()
    assert (low <= np.array(fitted.coefficients) + 1e-9).all() and (high >= 0).all()


def test_metrics_of_a_known_prediction():
    result = metrics([100.0, 200.0, 400.0], [110.0, 200.0, 300.0], ["a", "b", "c"])
    assert result["mae"] == pytest.approx(110 / 3)
    assert result["mape"] == pytest.approx((0.1 + 0 + 0.25) / 3)
    assert result["median_ape"] == pytest.approx(0.1)
    assert result["max_abs_percentage_error"] == pytest.approx(0.25) and result["worst_model_id"] == "c"
    assert result["n"] == 3 and result["max_abs_error"] == 100
