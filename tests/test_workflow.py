"""The Snakemake workflow: dry runs through the Python API, a real run on the small registry,
wildcard safety, lint, and the SLURM profile's GPU resources."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SMALL_REGISTRY = "tests/data/models_small.yaml"
WORKFLOW_FILES = ("Snakefile", "rules", "config", "profiles", "report", "envs", SMALL_REGISTRY)
COMMITTED_PEAKS = REPO / "results" / "peak_memory.parquet"
COMMITTED_SIMULATED = REPO / "results" / "simulated.parquet"


def workflow_copy(root: Path, with_peaks: bool = False, with_simulated: bool = False) -> Path:
    """The workflow files (not the package: the installed one runs) in a fresh folder."""
    for name in WORKFLOW_FILES:
        source, target = REPO / name, root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copyfile(source, target)
    if with_peaks and COMMITTED_PEAKS.exists():
        (root / "results").mkdir(exist_ok=True)
        shutil.copyfile(COMMITTED_PEAKS, root / "results" / "peak_memory.parquet")
    if with_simulated:
        shutil.copyfile(COMMITTED_SIMULATED, root / "results" / "simulated.parquet")
    return root


def offline_env(**extra) -> dict:
    # the rules' `python` is this interpreter, as in an activated virtual environment
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = dict(os.environ, PATH=path, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", AVP_GIT_COMMIT="test-workflow")
    env.update(extra)
    return env


def dry_run(workdir: Path, config: dict, targets=(), profile_args=()):
    """Build the DAG through snakemake.api and dry-run it; returns the workflow (its DAG inside)."""
    from snakemake.api import SnakemakeApi
    from snakemake.cli import parse_args
    from snakemake.settings.enums import Quietness
    from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, ResourceSettings

    here = Path.cwd()
    os.chdir(workdir)  # profiles name paths relative to the working folder
    try:
        _, args = parse_args(["--dry-run", *profile_args])
    finally:
        os.chdir(here)
    with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        workflow_api = api.workflow(
            resource_settings=ResourceSettings(cores=1, resources=args.resources, overwrite_resources=args.set_resources,
                                               default_resources=args.default_resources),
            config_settings=ConfigSettings(config=config, configfiles=args.configfile or []),
            snakefile=workdir / "Snakefile",
            workdir=workdir,
        )
        dag_api = workflow_api.dag(DAGSettings(targets=set(targets)))
        dag_api.execute_workflow(executor="dryrun")
        return workflow_api._workflow


def planned_rules(workflow) -> set[str]:
    return {job.rule.name for job in workflow.dag.jobs}


def test_dry_run_reuses_committed_peaks_on_cpu(tmp_path):
    workdir = workflow_copy(tmp_path, with_peaks=True)
    workflow = dry_run(workdir, {"registry": SMALL_REGISTRY, "measure": "reuse"})
    rules = planned_rules(workflow)
    assert {"configs", "activations", "fit", "figures", "dataset", "publish", "all"} <= rules
    assert not {"sweep", "aggregate"} & rules  # nothing touches CUDA
    assert ("validate" in rules) == COMMITTED_PEAKS.exists()
    for job in workflow.dag.jobs:
        if job.rule.name != "all":
            assert job.log and str(job.log[0]).startswith("logs/"), job.rule.name
            assert job.benchmark and str(job.benchmark).startswith("logs/benchmarks/"), job.rule.name


@pytest.mark.parametrize("points", ["blog", "standard"])
def test_count_points_reach_the_activations_command(tmp_path, points):
    workdir = workflow_copy(tmp_path)
    workflow = dry_run(workdir, {"registry": SMALL_REGISTRY, "measure": "reuse", "count_points": points},
                       targets=["results/activations.parquet"])
    (job,) = [job for job in workflow.dag.jobs if job.rule.name == "activations"]
    assert job.params.points == points
    assert f"--points {points}" in job.shellcmd


@pytest.mark.parametrize("mode, committed, simulate_job, exact", [
    ("run", False, True, True),     # simulate-peaks makes the table
    ("auto", True, False, True),    # no GPU here: the committed table is reused
    ("reuse", True, False, True),
    ("auto", False, False, False),  # nothing to reuse: no exact estimator
    ("off", True, False, False),
])
def test_simulate_modes(tmp_path, mode, committed, simulate_job, exact):
    workdir = workflow_copy(tmp_path, with_peaks=True, with_simulated=committed)
    workflow = dry_run(workdir, {"registry": SMALL_REGISTRY, "measure": "reuse", "simulate": mode})
    jobs = {job.rule.name: job for job in workflow.dag.jobs}
    assert ("simulate_peaks" in jobs) == simulate_job
    assert jobs["validate"].params.exact == ("--simulated results/simulated.parquet" if exact else "")
    assert ("results/simulated.parquet" in [str(f) for f in jobs["dataset"].input]) == exact


def test_simulate_reuse_without_a_table_is_refused(tmp_path):
    from snakemake.exceptions import WorkflowError

    workdir = workflow_copy(tmp_path, with_peaks=True)
    with pytest.raises(WorkflowError, match="simulate=reuse needs"):
        dry_run(workdir, {"registry": SMALL_REGISTRY, "measure": "reuse", "simulate": "reuse"})


def test_an_unknown_count_point_set_is_refused(tmp_path):
    from snakemake.exceptions import WorkflowError

    workdir = workflow_copy(tmp_path)
    with pytest.raises(WorkflowError, match="count_points"):
        dry_run(workdir, {"registry": SMALL_REGISTRY, "count_points": "everything"})


def test_dry_run_full_workflow_with_gpu_measurements(tmp_path):
    workdir = workflow_copy(tmp_path)
    workflow = dry_run(workdir, {"registry": SMALL_REGISTRY, "measure": "gpu"})
    # sweep jobs are known once the configs checkpoint ran; until then, every other stage is planned
    assert {"configs", "activations", "aggregate", "fit", "validate", "figures", "dataset", "publish"} <= planned_rules(workflow)
    workflow = dry_run(workdir, {"registry": SMALL_REGISTRY, "measure": "gpu"},
                       targets=["results/peak_memory_parts/openai-community--gpt2.parquet"])
    (job,) = [job for job in workflow.dag.jobs if job.rule.name == "sweep"]
    assert job.params.model_id == "openai-community/gpt2"
    assert job.resources["gpu"] == 1


@pytest.mark.parametrize("target", [
    "results/peak_memory_parts/openai-community/gpt2.parquet",  # a path separator
    "results/peak_memory_parts/..--gpt2.parquet",               # '..'
    "results/peak_memory_parts/not-a-model-id.parquet",         # no owner--name
])
def test_wildcard_constraints_reject_unsafe_model_names(tmp_path, target):
    from snakemake.exceptions import MissingRuleException

    workdir = workflow_copy(tmp_path)
    with pytest.raises(MissingRuleException):
        dry_run(workdir, {"registry": SMALL_REGISTRY, "measure": "gpu"}, targets=[target])


def test_a_model_outside_the_registry_is_refused(tmp_path):
    from snakemake.exceptions import WorkflowError

    workdir = workflow_copy(tmp_path)
    with pytest.raises(WorkflowError, match="not a model of"):
        dry_run(workdir, {"registry": SMALL_REGISTRY, "measure": "gpu"},
                targets=["results/peak_memory_parts/someone--else.parquet"])


def test_lint_is_clean(tmp_path):
    workdir = workflow_copy(tmp_path)
    for measure in ("reuse", "gpu"):
        result = subprocess.run(
            [sys.executable, "-m", "snakemake", "--lint", "--config", f"registry={SMALL_REGISTRY}", f"measure={measure}"],
            cwd=workdir, capture_output=True, text=True, env=offline_env(), timeout=120)
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        assert "Lints for" not in output and "in a good condition" in output, output


def test_default_workflow_profile_keeps_going(tmp_path):
    from snakemake.cli import parse_args

    workdir = workflow_copy(tmp_path)
    here = Path.cwd()
    os.chdir(workdir)
    try:
        _, args = parse_args(["--cores", "1"])
    finally:
        os.chdir(here)
    assert args.keep_going is True
    assert args.resources["gpu"].value == 1  # one GPU job at a time on a local machine


def test_slurm_profile_gives_the_sweep_rule_one_gpu(tmp_path):
    workdir = workflow_copy(tmp_path)
    workflow = dry_run(workdir, {"registry": SMALL_REGISTRY}, profile_args=["--profile", "profiles/slurm"],
                       targets=["results/peak_memory_parts/Qwen--Qwen2.5-0.5B.parquet"])
    assert workflow.config["measure"] == "gpu"  # from the profile's config file
    (job,) = [job for job in workflow.dag.jobs if job.rule.name == "sweep"]
    assert job.resources["gpu"] == 1
    assert job.resources["mem_mb"] == 64000
    assert job.resources["runtime"] == 120
    assert job.resources["slurm_partition"] == "gpu"
    assert workflow.resource_scopes.is_local("gpu")  # the local gpu=1 limit does not throttle the cluster
    local = workflow._localrules  # a dry run executes locally, so is_local() says yes to every rule
    assert {"configs", "fit", "dataset", "publish"} <= local and "sweep" not in local
    slurm = pytest.importorskip("snakemake_executor_plugin_slurm.utils")
    assert slurm.set_gres_string(job).strip() == "--gpus=1"


@pytest.mark.slow
def test_real_run_on_a_small_registry(tmp_path):
    """configs -> activations -> fit -> (validate) -> figures -> dataset -> publish (dry run), for real,
    with one model that cannot be built (it needs remote code): it becomes a row, the rest goes on."""
    import pandas as pd
    import yaml

    from conftest import MODELS, write_tiny_registry

    workdir = workflow_copy(tmp_path, with_peaks=True)
    registry_path = write_tiny_registry(workdir / "tests" / "data" / "tiny.yaml")
    registry = yaml.safe_load(registry_path.read_text())
    remote = dict(registry["models"][0], id="example/needs-remote-code", trust_remote_code=True)
    registry["models"].append(remote)
    registry_path.write_text(yaml.safe_dump(registry, sort_keys=False))
    command = [sys.executable, "-m", "snakemake", "--cores", "2", "--config", "registry=tests/data/tiny.yaml",
               "measure=reuse"]
    result = subprocess.run(command, cwd=workdir, capture_output=True, text=True, env=offline_env(), timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "models: example/needs-remote-code: skipped: example/needs-remote-code: needs trust_remote_code" in output
    results = workdir / "results"
    models = pd.read_parquet(results / "models.parquet").set_index("model_id")
    assert models.loc[list(MODELS), "status"].eq("ok").all()
    assert models.loc["example/needs-remote-code", "status"] == "skipped"
    assert set(models["config_source"].dropna()) == {"embedded"}  # offline: the registry's facts
    assert models.loc["openai-community/gpt2", "parameters"] == 124_439_808
    for subset in ("models", "activations", "coefficients"):
        assert (results / "dataset" / "data" / f"{subset}.parquet").stat().st_size > 0
    assert (results / "dataset" / "README.md").read_text().startswith("---\n")
    assert len(list((results / "figures").glob("*.png"))) >= 3
    assert '"dry_run": true' in (results / "publish.json").read_text()
    for rule in ("configs", "activations", "fit", "figures", "dataset", "publish"):
        assert (workdir / "logs" / f"{rule}.log").exists(), rule
        assert (workdir / "logs" / "benchmarks" / f"{rule}.tsv").exists(), rule
    assert f"configs: {len(MODELS) + 1} models" in (workdir / "logs" / "configs.log").read_text()
    assert f"activations: {len(MODELS) + 1}/{len(MODELS) + 1}" in (workdir / "logs" / "activations.log").read_text()

    report = subprocess.run([*command, "--report", "report.html"], cwd=workdir, capture_output=True, text=True,
                            env=offline_env(), timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert "activations_vs_parameters.png" in (workdir / "report.html").read_text()
