"""The registry's validation and the configs stage, including the real Hub download code path (offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main

REGISTRY = Path(__file__).parent / "data" / "models_small.yaml"
GOOD_ENTRY = {
    "id": "test/tiny-llama",
    "family": "test",
    "source": "written for this test",
    "config": {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 256},
}


def entry(**changes) -> dict:
    item = json.loads(json.dumps(GOOD_ENTRY))
    for key, value in changes.items():
        if key == "config":
            item["config"].update(value)
        elif value is None:
            del item[key]
        else:
            item[key] = value
    return item


def run_configs(tmp_path, models: list, capsys) -> tuple[int, str, Path]:
    registry = tmp_path / "models.yaml"
    registry.write_text(yaml.safe_dump({"models": models}))
    out = tmp_path / "configs.json"
    code = main(["configs", "--registry", str(registry), "--out", str(out), "--source", "embedded"])
    return code, capsys.readouterr().err, out


@pytest.mark.parametrize("models, words", [
    ([entry(), entry()], ["entry 1 (test/tiny-llama)", "field 'id'", "duplicate of entry 0"]),
    ([entry(config={"model_type": "no-such-arch"})], ["entry 0 (test/tiny-llama)", "field 'config.model_type'",
                                                      "unknown model_type"]),
    ([entry(family=None)], ["entry 0 (test/tiny-llama)", "field 'family'", "missing"]),
    ([entry(config={"hidden_size": "32"})], ["entry 0 (test/tiny-llama)", "field 'config.hidden_size'",
                                             "not of type 'integer'"]),
    ([entry(config={"num_hidden_layers": None})], ["entry 0 (test/tiny-llama)", "field 'config.num_hidden_layers'"]),
])
def test_registry_errors_are_one_line_naming_entry_and_field(tmp_path, capsys, models, words):
    code, err, out = run_configs(tmp_path, models, capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    for word in words:
        assert word in err
    assert not out.exists()
    assert not list(tmp_path.glob(".tmp-*"))  # nothing half-written


def test_a_good_registry_gives_embedded_configs(tmp_path, capsys):
    code, _, out = run_configs(tmp_path, [entry()], capsys)
    assert code == 0
    record = json.loads(out.read_text())["test/tiny-llama"]
    assert (record["status"], record["config_source"], record["config_revision"]) == ("ok", "embedded", None)
    assert record["config"]["num_key_value_heads"] == 2


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache holding one snapshot of openai-community/gpt2's config.json, and the Hub offline.

    huggingface_hub reads its cache folder and offline switch when it is imported, so both the
    environment (for a fresh process) and its constants (for this one) are set.
    """
    import huggingface_hub.constants as hub_constants

    sha = "607a30d783dfa663caf39e06633721c8d4cfcd7e"
    repo = tmp_path / "hub" / "models--openai-community--gpt2"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    snapshot = repo / "snapshots" / sha
    snapshot.mkdir(parents=True)
    facts = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
             "n_positions": 1024, "n_ctx": 1024}
    (snapshot / "config.json").write_text(json.dumps(facts))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    return sha, facts


def test_download_config_reads_the_hub_cache(offline_hub_cache):
    from pipeline.inputs.configs import download_config

    sha, facts = offline_hub_cache
    assert download_config("openai-community/gpt2") == (facts, sha)


def test_hub_source_and_revision_are_recorded(offline_hub_cache, tmp_path):
    from pipeline.inputs.configs import resolve_config, write_configs
    from pipeline.inputs.registry import load_registry

    sha, _ = offline_hub_cache
    gpt2 = next(e for e in load_registry(REGISTRY) if e.id == "openai-community/gpt2")
    resolved = resolve_config(gpt2, mode="hub")
    assert (resolved.source, resolved.revision, resolved.config.n_embd) == ("hub", sha, 768)

    registry = tmp_path / "one.yaml"
    registry.write_text(yaml.safe_dump({"models": [{"id": gpt2.id, "family": gpt2.family, "source": gpt2.source,
                                                    "config": gpt2.config}]}))
    records = write_configs(registry, tmp_path / "configs.json", mode="hub")
    assert (records[gpt2.id]["config_source"], records[gpt2.id]["config_revision"]) == ("hub", sha)
    assert json.loads((tmp_path / "configs.json").read_text())[gpt2.id]["config_revision"] == sha


def test_hub_mode_without_the_file_is_one_clear_error(offline_hub_cache):
    from pipeline.inputs.configs import resolve_config
    from pipeline.core.errors import UserError
    from pipeline.inputs.registry import load_registry

    qwen = next(e for e in load_registry(REGISTRY) if e.id == "Qwen/Qwen2.5-0.5B")
    with pytest.raises(UserError, match="could not be downloaded"):
        resolve_config(qwen, mode="hub")


def test_auto_mode_offline_falls_back_to_embedded_facts(offline_hub_cache):
    from pipeline.inputs.configs import resolve_config
    from pipeline.inputs.registry import load_registry

    qwen = next(e for e in load_registry(REGISTRY) if e.id == "Qwen/Qwen2.5-0.5B")
    resolved = resolve_config(qwen, mode="auto")
    assert (resolved.source, resolved.config.hidden_size) == ("embedded", 896)
