"""What several test modules share: the repository's paths, the offline environment of a
subprocess, the `python -m pipeline` runner, a tiny registry of the quickest models, and the
real stage outputs (configs, activations, fit, validate, figures) made once per session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
REGISTRY = REPO / "models.yaml"
SMALL_REGISTRY = REPO / "tests" / "data" / "models_small.yaml"
COMMITTED_PEAKS = REPO / "results" / "peak_memory.parquet"
# Tiny real architectures that the simulator's tests run on the meta device and for real on the CPU.
TINY_LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
# gpt2 has dropout everywhere (embeddings, attention, residuals) and a tied lm_head
TINY_GPT2 = dict(model_type="gpt2", vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256)
# The quickest models to count, of two families: enough for a fit with leave-one-family-out.
MODELS = ("EleutherAI/pythia-14m", "EleutherAI/pythia-70m", "distilbert/distilgpt2", "openai-community/gpt2")

def checkout_state() -> dict:
    """Size and modification time of every file of the checkout's results/ and registry: what no test
    may change (commands given no path read and write the checkout's own files)."""
    files = [REGISTRY, *sorted((REPO / "results").rglob("*"))]
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.is_file()}


def pytest_collection_modifyitems(session, config, items):
    """Tests marked `forks` run first. A process that ran DTensor's or FSDP2's backward (every sharded simulation
    does, on the fake process group) has torch mark its forks bad: a forked child's autograd then refuses to run
    ("Unable to handle autograd's threading in combination with fork-based multiprocessing"). The measuring
    children of the sweep are forked from a parent that never simulates; in one test session they are forked
    from pytest itself, so they go before any test that simulates several GPUs."""
    items.sort(key=lambda item: item.get_closest_marker("forks") is None)


def pytest_sessionstart(session):
    session.config.checkout_state = checkout_state()


def pytest_sessionfinish(session, exitstatus):
    before = getattr(session.config, "checkout_state", None)
    if before is None:
        return
    after = checkout_state()
    changed = sorted(path for path in set(before) | set(after) if before.get(path) != after.get(path))
    if changed:
        print(f"\nthe tests changed the checkout's own files: {', '.join(changed[:5])}", file=sys.stderr)
        session.exitstatus = 1


def flat(estimate) -> dict:
    """A simulation's Estimate in the form of the step runs that real CPU checks return (peak_bytes,
    components, the reserved bytes and the details), so that the two compare key by key."""
    return {"peak_bytes": estimate.peak_bytes, "components": estimate.components,
            "peak_reserved_bytes": estimate.reserved_bytes,
            "peak_reserved_expandable_bytes": estimate.reserved_expandable_bytes, **estimate.details}


def pipeline(*args, cwd, env=None, check=True):
    result = subprocess.run([sys.executable, "-m", "pipeline", *map(str, args)], cwd=cwd, capture_output=True,
                            text=True, env=env or offline_env(), timeout=600)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def offline_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", AVP_GIT_COMMIT="test-dataset")
    env.update(extra)
    return env


def write_tiny_registry(path: Path) -> Path:
    """The entries of MODELS, copied from the project's registry."""
    registry = yaml.safe_load(REGISTRY.read_text())
    registry["models"] = [m for m in registry["models"] if m["id"] in MODELS]
    assert len(registry["models"]) == len(MODELS)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(registry, sort_keys=False))
    return path


def stage_results(root: Path) -> Path:
    """results/ made by the real stages: configs, activations, fit (and validate on the committed
    peaks), figures. Made once per test session (test_figures uses it too)."""
    results = root / "results"
    write_tiny_registry(root / "models.yaml")
    pipeline("configs", "--registry", "models.yaml", "--out", "results/configs.json", "--source", "embedded", cwd=root)
    pipeline("activations", "--registry", "models.yaml", "--configs", "results/configs.json",
             "--models-out", "results/models.parquet", "--activations-out", "results/activations.parquet", cwd=root)
    pipeline("fit", "--models", "results/models.parquet", "--activations", "results/activations.parquet",
             "--out", "results/coefficients.json", "--resamples", "200", cwd=root)
    if COMMITTED_PEAKS.exists():
        shutil.copyfile(COMMITTED_PEAKS, results / "peak_memory.parquet")
        pipeline("validate", "--peaks", "results/peak_memory.parquet", "--coefficients", "results/coefficients.json",
                 "--configs", "results/configs.json", "--out", "results/validation.parquet", cwd=root)
    pipeline("figures", "--results", "results", "--out", "results/figures", cwd=root)
    return results


@pytest.fixture(scope="session")
def staged_results(tmp_path_factory) -> Path:
    """results/ of the real stages on the tiny registry (about 1-2 minutes, once per session)."""
    return stage_results(tmp_path_factory.getbasetemp() / "stage-results")


@pytest.fixture(scope="session")
def built(staged_results):
    """The staged results with the dataset folder the dataset stage makes of them."""
    root = staged_results.parent
    pipeline("dataset", "--results", "results", "--out", "results/dataset", "--repo", "someone/avp-test", cwd=root)
    return root


def real_tables(directory: Path) -> tuple[Path, Path]:
    """models.parquet and activations.parquet of the test registry, counted by the activations stage's code.

    Hook counts at (1, 1) and fp32 saved-for-backward bytes at L = 16 and 32 only, to keep tests quick.
    """
    import pandas as pd

    from pipeline.activations import ACTIVATION_COLUMNS, MODEL_COLUMNS, PointSet, count_model, read_jobs
    from pipeline.inputs.configs import write_configs

    configs = directory / "configs.json"
    write_configs(SMALL_REGISTRY, configs, mode="embedded")
    points = PointSet(hook=((1, 1),), saved=((1, 16), (1, 32)), precisions=("float32",))
    results = [count_model(job, points) for job in read_jobs(SMALL_REGISTRY, configs)]
    paths = directory / "models.parquet", directory / "activations.parquet"
    pd.DataFrame([row for row, _ in results], columns=MODEL_COLUMNS).to_parquet(paths[0])
    pd.DataFrame([row for _, rows in results for row in rows], columns=ACTIVATION_COLUMNS).to_parquet(paths[1])
    return paths


@pytest.fixture(scope="session")
def tables(tmp_path_factory):
    return real_tables(tmp_path_factory.mktemp("tables"))


def run_cpu_sweep(tmp_path_factory, configs_path, plan: dict, name: str, processes: int):
    """A sweep plan (`sweep.parse_plan`'s dict) run in real forked processes on the CPU, each of its `processes`
    finished. Returns (jobs, the aggregated frame)."""
    from pipeline.inputs.records import load_model_records
    from pipeline.measure import sweep

    plan = sweep.parse_plan(plan)
    records, missing = load_model_records(configs_path, plan.models)
    assert not missing
    jobs = sweep.plan_jobs(plan, records)
    parts = tmp_path_factory.mktemp(name) / "parts"
    outcomes = sweep.run_sweep(jobs, parts, device="cpu", child_timeout=300, log=lambda line: None)
    assert outcomes == {"finished": processes, "error": 0, "stopped": 0, "restarted": 0, "not started": 0}
    return jobs, sweep.aggregate(parts, parts.parent / "peak_memory.parquet")


def pick(frame, **where) -> dict:
    """The one row of `frame` with these column values (None: a missing value)."""
    rows = frame
    for column, value in where.items():
        rows = rows[rows[column].isna()] if value is None else rows[rows[column] == value]
    assert len(rows) == 1, where
    return rows.iloc[0].to_dict()
