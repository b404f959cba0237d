"""The dataset folder (parquet subsets + card) from real stage outputs, and loading it offline with
`datasets`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import COMMITTED_PEAKS, MODELS, offline_env, pipeline

# The real stages (configs, activations, fit, validate, figures) run once for the session: ~1-2 min.
pytestmark = pytest.mark.slow


def card_header(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_every_subset_and_column_is_in_the_card(built):
    dataset = built / "results" / "dataset"
    card = (dataset / "README.md").read_text()
    header = card_header(card)
    assert header["license"] == "apache-2.0"
    assert header["pretty_name"] and header["tags"] and header["size_categories"]
    subsets = {c["config_name"]: c["data_files"][0]["path"] for c in header["configs"]}
    expected = {"models", "activations", "coefficients"} | ({"peak_memory", "validation"} if COMMITTED_PEAKS.exists() else set())
    assert expected <= set(subsets)
    for subset, path in subsets.items():
        frame = pd.read_parquet(dataset / path)
        assert len(frame) > 0, subset
        assert f"### `{subset}` ({len(frame)} rows)" in card
        for column in frame.columns:
            assert f"| `{column}` |" in card, (subset, column)
    assert "huggingface.co/blog/train_memory" in card
    assert 'load_dataset("someone/avp-test", "activations"' in card
    assert "figures/activations_vs_parameters.png" in card
    assert (dataset / "figures" / "activations_vs_parameters.png").is_file()


def test_dataset_holds_the_real_counts(built):
    dataset = built / "results" / "dataset" / "data"
    models = pd.read_parquet(dataset / "models.parquet").set_index("model_id")
    assert models.loc["openai-community/gpt2", "parameters"] == 124_439_808
    assert set(models["config_source"]) == {"embedded"}
    coefficients = pd.read_parquet(dataset / "coefficients.parquet")
    main = coefficients[coefficients["role"] == "heuristic"].iloc[0]
    fit = json.loads((built / "results" / "coefficients.json").read_text())
    assert main["fit"] == fit.get("fit", main["fit"])
    assert main["a"] == fit["a"] and main["b"] == fit["b"] and main["n_models"] == len(MODELS)
    assert main["a_low"] <= main["a"] <= main["a_high"]
    blog = coefficients[coefficients["fit"] == "blog"].iloc[0]
    assert blog["a"] == 4.6894e-4 and blog["b"] == 1.8494e6


def test_load_dataset_offline_for_every_subset(built, tmp_path):
    import datasets

    dataset = built / "results" / "dataset"
    header = card_header((dataset / "README.md").read_text())
    for config in header["configs"]:
        subset = config["config_name"]
        loaded = datasets.load_dataset(str(dataset), subset, split="train", cache_dir=str(tmp_path / "cache"))
        frame = pd.read_parquet(dataset / "data" / f"{subset}.parquet")
        assert loaded.num_rows == len(frame), subset
        assert loaded.column_names == list(frame.columns), subset


def test_a_column_without_description_fails_the_build(built, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(built / "results", results, ignore=shutil.ignore_patterns("dataset"))
    models = pd.read_parquet(results / "models.parquet").assign(mystery_column=1)
    models.to_parquet(results / "models.parquet")
    result = pipeline("dataset", "--results", results, "--out", results / "dataset", cwd=tmp_path, check=False)
    assert result.returncode == 2
    assert "models.mystery_column" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (results / "dataset").exists()


def test_error_rows_are_reported(built, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(built / "results", results, ignore=shutil.ignore_patterns("dataset"))
    models = pd.read_parquet(results / "models.parquet")
    models.loc[0, ["status", "reason"]] = ["error", "RuntimeError: broken on purpose"]
    models.to_parquet(results / "models.parquet")
    result = pipeline("dataset", "--results", results, "--out", results / "dataset", cwd=tmp_path)
    assert f"failed: models: {models.loc[0, 'model_id']}: error: RuntimeError: broken on purpose" in result.stdout
    assert "broken on purpose" in (results / "dataset" / "README.md").read_text()


REPO = Path(__file__).resolve().parent.parent


def test_training_settings_subset_joins_every_measured_table():
    """The Trainer, LoRA and QLoRA tables of every GPU and plan become one subset, with their split."""
    import pandas as pd

    from pipeline.publish.dataset.subsets import load_tables
    from pipeline.core.paths import SETTINGS_TABLES

    tables = load_tables(REPO / "results")
    settings = tables["training_settings"]
    expected = sum(len(pd.read_parquet(REPO / path)) for path in SETTINGS_TABLES if (REPO / path).is_file())
    assert len(settings) == expected and set(settings["split"]) == {"tuned", "held-out"}
    assert {"trainer", "loop"} <= set(settings["client"]) and settings["quantization"].eq("nf4").any()
    validated = tables["settings_validation"]
    assert set(validated["estimator"]) == {"blog", "heuristic", "formula", "exact"}
