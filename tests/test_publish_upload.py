"""The publish step on a real dataset folder: the dry run's listing, the manifest, a missing token,
a Hub that cannot be reached (huggingface_hub's real client against a closed local port), and a
token that never leaks."""

from __future__ import annotations

import json

import pytest

from conftest import offline_env, pipeline

FAKE_TOKEN = "hf_ThisIsAFakeTokenThatMustNeverBePrinted42"
pytestmark = pytest.mark.slow


def test_publish_dry_run_lists_files_and_sizes(built):
    dataset = built / "results" / "dataset"
    manifest = built / "publish.json"
    result = pipeline("publish", "--dataset", dataset, "--coefficients", built / "results" / "coefficients.json",
                      "--repo", "someone/avp-test", "--dry-run", "--manifest", manifest, cwd=built)
    listed = json.loads(manifest.read_text())
    paths = {item["path_in_repo"]: item["bytes"] for item in listed["files"]}
    assert paths["README.md"] == (dataset / "README.md").stat().st_size
    assert paths["data/activations.parquet"] == (dataset / "data" / "activations.parquet").stat().st_size
    assert "coefficients.json" in paths and listed["dry_run"] is True
    assert "would upload" in result.stdout and "data/models.parquet" in result.stdout


def test_publish_needs_a_token(built, tmp_path):
    env = offline_env(HF_HOME=str(tmp_path / "hf"))  # no stored login either
    result = pipeline("publish", "--dataset", built / "results" / "dataset", "--repo", "someone/avp-test",
                      cwd=built, env=env, check=False)
    assert result.returncode == 2 and "token" in result.stderr


def test_token_never_leaks(built, tmp_path):
    """Dry run and a real attempt that cannot connect: the token is in no output, log or file."""
    env = offline_env(HF_TOKEN=FAKE_TOKEN, HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT="http://127.0.0.1:9")
    env.pop("HF_HUB_OFFLINE")  # really try to connect (to a closed local port)
    args = ["--dataset", built / "results" / "dataset", "--coefficients", built / "results" / "coefficients.json",
            "--repo", "someone/avp-test"]
    dry = pipeline("publish", *args, "--dry-run", "--manifest", tmp_path / "dry.json", cwd=tmp_path, env=env)
    failed = pipeline("publish", *args, "--manifest", tmp_path / "real.json", cwd=tmp_path, env=env, check=False)
    assert failed.returncode == 1
    (line,) = failed.stderr.strip().splitlines()
    assert line.startswith("error: upload to someone/avp-test failed (") and line.endswith("nothing was published")
    assert not (tmp_path / "real.json").exists()
    # huggingface_hub's own debug log (requests, retries, tracebacks) does not show it either
    debug = pipeline("publish", *args, cwd=tmp_path, env=dict(env, HF_HUB_VERBOSITY="debug"), check=False)
    assert debug.returncode == 1 and "authenticated: True" in debug.stderr
    for result in (dry, failed, debug):
        assert FAKE_TOKEN not in result.stdout + result.stderr
    for path in [*tmp_path.rglob("*"), *(built / "results").rglob("*")]:
        if path.is_file():
            assert FAKE_TOKEN.encode() not in path.read_bytes(), path
