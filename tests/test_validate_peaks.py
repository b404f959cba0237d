"""Estimators against the measured peaks (results/peak_memory.parquet, measured on an H200)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.formulas.coefficients import load_coefficients
from pipeline.estimate import estimate
from pipeline.fit.stage import run_fit
from pipeline.validate.peaks import measured_rows, refit_without_family, run_validate

PEAKS = Path(__file__).resolve().parent.parent / "results" / "peak_memory.parquet"
needs_peaks = pytest.mark.skipif(
    not PEAKS.is_file(), reason="results/peak_memory.parquet is not committed yet (it is measured on the GPU machine)")


@pytest.fixture(scope="module")
def coefficients(tables, tmp_path_factory):
    path = tmp_path_factory.mktemp("validate") / "coefficients.json"
    run_fit(*tables, path, peaks_path=PEAKS if PEAKS.is_file() else None, resamples=100)
    return path


@pytest.fixture(scope="module")
def validated(coefficients, tmp_path_factory):
    import pandas as pd

    out = tmp_path_factory.mktemp("validated") / "validation.parquet"
    summary = run_validate(PEAKS, coefficients, None, out)
    return pd.read_parquet(out), summary, out


@needs_peaks
def test_every_measured_point_gets_every_estimator(validated):
    import pandas as pd

    table, summary, out = validated
    measured = measured_rows(pd.read_parquet(PEAKS))
    assert len(table) == 3 * len(measured)
    assert set(table["estimator"]) == {"blog", "heuristic", "heuristic-lofo"}
    ok = table[table["status"] == "ok"]
    assert (ok["relative_error"] - (ok["predicted_peak_bytes"] - ok["measured_peak_bytes"])
            / ok["measured_peak_bytes"]).abs().max() < 1e-12
    assert (table["fits_measured"] == (table["status"] == "ok")).all()
    markdown = out.with_name("validation_summary.md").read_text()
    for estimator in ("blog", "heuristic", "heuristic-lofo"):
        assert f"| {estimator} | all |" in markdown
        assert summary["overall"][estimator]["points"] == int((ok["estimator"] == estimator).sum())
    assert json.loads(out.with_name("validation_summary.json").read_text())["overall"] == summary["overall"]


@needs_peaks
def test_blog_rows_are_the_blog_formula(validated):
    table, _, _ = validated
    row = table[(table["estimator"] == "blog") & (table["status"] == "ok")].iloc[0]
    expected = estimate(params=int(row["parameters"]), batch=int(row["batch_size"]), seq=int(row["seq_len"]),
                        precision=row["precision"], optimizer=row["optimizer"],
                        checkpointing=bool(row["gradient_checkpointing"]), method="blog")["peak_bytes"]
    assert row["predicted_peak_bytes"] == pytest.approx(expected)


@needs_peaks
def test_leave_one_family_out_refit_drops_the_family(coefficients):
    import numpy as np
    import pandas as pd

    c = load_coefficients(coefficients)
    family = c["data"]["rows"][0]["family"]
    refit = refit_without_family(c, pd.read_parquet(PEAKS), family)
    kept = [r for r in c["data"]["rows"] if r["family"] != family]
    y = np.array([r["elements_per_token"] for r in kept])
    # least squares of the relative error against active parameters, as the coefficient file says
    assert (c["x"], c["weighting"]) == ("active_parameters", "relative")
    slope, intercept = np.polyfit([r["active_parameters"] for r in kept], y, 1, w=1 / y)
    assert refit["a"] == pytest.approx(slope) and refit["b"] == pytest.approx(intercept)
    assert (refit["a"], refit["b"]) != (c["a"], c["b"])


def test_missing_or_bad_inputs_are_one_line_and_write_nothing(coefficients, tmp_path, capsys):
    out = tmp_path / "validation.parquet"
    code = main(["validate", "--peaks", str(tmp_path / "absent.parquet"), "--coefficients", str(coefficients),
                 "--out", str(out)])
    assert code == 2 and capsys.readouterr().err.strip().endswith("peak-memory table not found")
    not_parquet = tmp_path / "peaks.parquet"
    not_parquet.write_text("model_id,status\n")
    assert main(["validate", "--peaks", str(not_parquet), "--coefficients", str(coefficients),
                 "--out", str(out)]) == 2
    assert "not readable parquet" in capsys.readouterr().err
    bad = tmp_path / "coefficients.json"
    bad.write_text("{")
    assert main(["validate", "--peaks", str(not_parquet), "--coefficients", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not valid JSON" in err and "\n" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coefficients.json", "peaks.parquet"]


@needs_peaks
def test_refit_heuristic_beats_the_blog_out_of_family(validated):
    _, summary, _ = validated
    blog, lofo = summary["overall"]["blog"], summary["overall"]["heuristic-lofo"]
    assert lofo["median_abs_relative_error"] < blog["median_abs_relative_error"]
    assert lofo["worst_abs_relative_error"] < blog["worst_abs_relative_error"]


SIMULATED = PEAKS.with_name("simulated.parquet")


@needs_peaks
@pytest.mark.skipif(not SIMULATED.is_file(), reason="results/simulated.parquet is not committed")
def test_exact_estimator_from_the_simulate_stage_meets_its_goals(coefficients, tmp_path):
    """The committed simulator table (simulate-peaks) as the exact estimator: the accuracy goals of
    the exact method (median |error| <= 3%, 90th percentile <= 10%, fit/no-fit >= 97%), and a
    point the simulator did not cover gets a reason, not a number."""
    import pandas as pd

    simulated = pd.read_parquet(SIMULATED)
    dropped = simulated.iloc[0]
    partial = tmp_path / "simulated.parquet"
    simulated.iloc[1:].to_parquet(partial)
    out = tmp_path / "validation.parquet"
    summary = run_validate(PEAKS, coefficients, None, out, simulated_path=partial)
    exact = summary["overall"]["exact"]
    assert exact["median_abs_relative_error"] <= 0.03
    assert exact["p90_abs_relative_error"] <= 0.10
    assert exact["fit_accuracy"] >= 0.97
    table = pd.read_parquet(out)
    row = table[(table["estimator"] == "exact") & (table["model_id"] == dropped["model_id"])
                & (table["precision"] == dropped["precision"]) & (table["batch_size"] == dropped["batch_size"])
                & (table["seq_len"] == dropped["seq_len"]) & (table["optimizer"] == dropped["optimizer"])
                & (table["gradient_checkpointing"] == dropped["gradient_checkpointing"])
                & (table["attn_implementation"] == dropped["attn_implementation"])]
    assert len(row) == 1 and row["predicted_peak_bytes"].isna().all()
    assert row["reason"].iloc[0] == "point not in the simulated table"
