"""The refit of A = a*N + b on real hook counts (meta device) of the test registry, and the coefficient file."""

from __future__ import annotations

import json

import pytest

from pipeline.cli import main
from pipeline.formulas.coefficients import SCHEMA_VERSION, load_coefficients
from pipeline.core.errors import UserError
from pipeline.fit.stage import HEURISTIC_FIT, fit_coefficients, run_fit
from pipeline.formulas.components import BLOG_INTERCEPT, BLOG_SLOPE

QWEN_1_5B = "Qwen/Qwen2.5-1.5B"


@pytest.fixture(scope="session")
def coefficients_path(tables, tmp_path_factory):
    path = tmp_path_factory.mktemp("fit") / "coefficients.json"
    run_fit(*tables, path)
    return path


def test_fit_on_real_hook_counts(coefficients_path):
    c = load_coefficients(coefficients_path)
    rows = {r["model_id"]: r for r in c["data"]["rows"]}
    assert rows[QWEN_1_5B]["elements_per_token"] == 1_266_304  # the blog's 5,065,216 fp32 bytes / 4
    assert rows[QWEN_1_5B]["parameters"] == 1_543_714_304
    assert c["n_models"] == len(rows) >= 5 and c["n_families"] >= 4
    assert c["a"] > 0 and c["b"] > 0
    for name in ("hook_elements_vs_parameters", "hook_elements_vs_non_embedding_parameters",
                 "hook_elements_vs_active_parameters", HEURISTIC_FIT):
        fit = c["fits"][name]
        assert fit["a"] > 0
        for key in ("a", "b"):
            low, high = fit["intervals"][key]
            assert low <= fit[key] <= high
        for where in ("in_sample", "kfold", "leave_one_family_out"):
            metrics = fit["metrics"][where]
            assert set(metrics) >= {"r2", "mae", "mape", "max_abs_error", "max_abs_percentage_error", "worst_model_id"}
            assert metrics["n"] == c["n_models"]
    assert (c["fit"], c["x"], c["weighting"]) == (HEURISTIC_FIT, "active_parameters", "relative")
    assert c["a"] == c["fits"][HEURISTIC_FIT]["a"] and c["b"] == c["fits"][HEURISTIC_FIT]["b"]
    moe = rows["Qwen/Qwen1.5-MoE-A2.7B"]
    assert moe["active_parameters"] < moe["parameters"]  # the MoE's routed experts count top_k / num_experts
    saved = c["fits"]["saved_bytes_vs_parameters"]
    assert saved["bf16"] is None and saved["amp-bf16"] is None  # not counted here
    assert saved["fp32"]["seq_len"] == 16 and saved["fp32"]["a"] > 0
    assert [f["seq_len"] for f in saved["fp32"]["by_seq_len"]] == [16, 32]
    assert c["metrics"]["kfold"]["splits"] == 5 and c["metrics"]["leave_one_family_out"]["splits"] == c["n_families"]
    assert len(c["data"]["sha256"]) == 64 and c["versions"]["transformers"]


def test_fit_is_reproducible(tables):
    import pandas as pd

    models, activations = (pd.read_parquet(p) for p in tables)
    first, second = fit_coefficients(models, activations), fit_coefficients(models, activations)
    for key in ("a", "b", "intervals", "metrics", "data"):
        assert first[key] == second[key]


def test_blog_coefficients_on_our_counts_and_unit_mismatch(coefficients_path):
    blog = load_coefficients(coefficients_path)["blog"]
    assert blog["a_in_elements"] == BLOG_SLOPE / 4 and blog["b_in_elements"] == BLOG_INTERCEPT / 4
    example = blog["unit_mismatch"]
    a_bytes = 4.6894e-4 * 1_543_714_304 + 1.8494e6  # fp32 bytes per token, as published
    assert example["blog_A_fp32_bytes_per_token"] == pytest.approx(a_bytes)
    assert example["blog_activation_bytes_as_published"] == pytest.approx(a_bytes * 16 * 256 * 4)
    assert example["factor"] == 4
    assert blog["metrics_on_our_hook_counts"]["n"] >= 5


def test_cli_writes_a_file_that_loads_back(tables, tmp_path, capsys):
    out = tmp_path / "coefficients.json"
    assert main(["fit", "--models", str(tables[0]), "--activations", str(tables[1]), "--out", str(out),
                 "--resamples", "50"]) == 0
    assert "models" in capsys.readouterr().out
    c = load_coefficients(out)
    assert c["schema_version"] == SCHEMA_VERSION and c["intervals"]["resamples"] == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coefficients.json", "formula_comparison.md"]  # no temporary


def _one_line_error(path) -> str:
    with pytest.raises(UserError) as info:
        load_coefficients(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_other_schema_version_is_one_line_error(coefficients_path, tmp_path):
    data = json.loads(coefficients_path.read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    assert f"schema_version {SCHEMA_VERSION + 1} is not supported" in _one_line_error(path)


def test_corrupted_or_wrong_file_is_one_line_error(coefficients_path, tmp_path):
    text = coefficients_path.read_text()
    truncated = tmp_path / "truncated.json"
    truncated.write_text(text[: len(text) // 2])
    assert "not valid JSON" in _one_line_error(truncated)
    data = json.loads(text)
    del data["a"]
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps(data))
    assert "'a' is a required property" in _one_line_error(missing)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    assert "coefficient file" in _one_line_error(binary)
    assert "not found" in _one_line_error(tmp_path / "absent.json")


def test_bad_input_writes_nothing(tables, tmp_path, capsys):
    import pandas as pd

    out = tmp_path / "coefficients.json"
    broken = tmp_path / "models.parquet"
    pd.read_parquet(tables[0]).drop(columns=["parameters"]).to_parquet(broken)
    assert main(["fit", "--models", str(broken), "--activations", str(tables[1]), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == "error: models table: column 'parameters' missing"
    too_few = tmp_path / "two.parquet"
    pd.read_parquet(tables[0]).head(2).to_parquet(too_few)
    assert main(["fit", "--models", str(too_few), "--activations", str(tables[1]), "--out", str(out)]) == 2
    assert "needs at least 3 models" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models.parquet", "two.parquet"]
