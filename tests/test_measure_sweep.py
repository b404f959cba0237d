"""CPU tests of the peak-memory sweep: planning, pruning, resuming, isolation, rows, command line.

Children are real forked processes running real (tiny) training steps on the CPU (`device="cpu"`,
where no allocator peaks exist: those columns are None). CUDA is never touched.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.inputs.records import load_model_records
from pipeline.measure import sweep
from pipeline.measure.clients.tracking import PhaseTracker
from pipeline.core.errors import UserError
from pipeline.training.points import COLUMN_DTYPES, COLUMNS, POINT_KEY
from pipeline.training.step import Setting
from pipeline.measure.cli import main

pytestmark = pytest.mark.forks  # measuring children forked from this process (tests/conftest.py)

REPO = Path(__file__).resolve().parent.parent
SMALL_REGISTRY = REPO / "tests" / "data" / "models_small.yaml"
TINY = "test/tiny-llama"  # context 64
BROKEN = "test/broken-gpt2"  # n_embd not a multiple of n_head: the config check refuses to build it


def configs_record(family: str, facts: dict) -> dict:
    return {"family": family, "model_type": facts["model_type"], "status": "ok", "reason": None,
            "config_source": "embedded", "config_revision": None, "config": facts}


@pytest.fixture(scope="module")
def configs_path(tmp_path_factory) -> Path:
    small = {m["id"]: m for m in yaml.safe_load(SMALL_REGISTRY.read_text())["models"]}
    configs = {
        TINY: configs_record("test", dict(model_type="llama", vocab_size=256, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=64)),
        BROKEN: configs_record("test", dict(model_type="gpt2", vocab_size=256, n_embd=30, n_layer=2, n_head=4,
                                            n_positions=128)),
        "EleutherAI/pythia-14m": configs_record("pythia", small["EleutherAI/pythia-14m"]["config"]),
    }
    path = tmp_path_factory.mktemp("configs") / "configs.json"
    path.write_text(json.dumps(configs))
    return path


def make_plan(**overrides) -> sweep.Plan:
    data = {"grid": {"batch_sizes": [1, 2, 4], "seq_lens": [16, 32, 128]}, "precisions": ["fp32"], "models": [TINY]}
    data.update(overrides)
    return sweep.parse_plan(data)


def make_jobs(plan: sweep.Plan, configs_path) -> list[sweep.Job]:
    records, missing = load_model_records(configs_path, plan.models)
    assert not missing
    return sweep.plan_jobs(plan, records)


def statuses(rows) -> dict:
    return {(r["precision"], r["variant"], r["optimizer"], r["gradient_checkpointing"], r["attn_implementation"],
             r["batch_size"], r["seq_len"]): (r["status"], r["reason"]) for r in rows}


# --- planning --------------------------------------------------------------------------------------

def test_plan_skips_points_beyond_context_and_over_the_compute_budget(configs_path):
    records, _ = load_model_records(configs_path, [TINY])
    n = records[TINY].parameters
    assert n == records[TINY].plan_parameters > 0
    budget = 6 * n * 2 * 32  # B*L up to 64 tokens fits
    [job] = make_jobs(make_plan(max_step_flops=budget), configs_path)
    reasons = {(p.batch_size, p.seq_len): p.skip_reason for p in job.points}
    assert reasons[(1, 16)] is None and reasons[(4, 16)] is None and reasons[(2, 32)] is None
    assert reasons[(4, 32)].startswith("over compute budget: 6*N*B*L")
    assert reasons[(1, 128)] == "seq_len 128 beyond the context length 64"
    assert [(p.seq_len, p.batch_size) for p in job.points] == sorted((p.seq_len, p.batch_size) for p in job.points)


def test_plan_orders_jobs_by_precision_pass_then_size_and_settings_checkpointing_last(configs_path):
    plan = make_plan(precisions=["bf16", "fp32"], models=["EleutherAI/pythia-14m", TINY], variants=[
        {"name": "ckpt", "gradient_checkpointing": True, "models": [TINY], "precisions": ["bf16"]},
        {"name": "sgd", "optimizer": "sgd", "models": [TINY], "grid": {"batch_sizes": [1], "seq_lens": [16]}},
        {"name": "eager", "attn_implementation": "eager", "models": [TINY], "points": [[2, 16]]},
    ])
    jobs = make_jobs(plan, configs_path)
    assert [(j.precision, j.model_id, j.attn) for j in jobs] == [
        ("bf16", TINY, "default"), ("bf16", TINY, "eager"), ("bf16", "EleutherAI/pythia-14m", "default"),
        ("fp32", TINY, "default"), ("fp32", TINY, "eager"), ("fp32", "EleutherAI/pythia-14m", "default")]
    settings = list(dict.fromkeys(p.setting for p in jobs[0].points))
    assert settings == [Setting(), Setting(optimizer="sgd"), Setting(gradient_checkpointing=True)]
    assert [(p.batch_size, p.seq_len) for p in jobs[1].points] == [(2, 16)]


def test_a_point_planned_by_two_groups_runs_if_either_runs_it(configs_path):
    records, _ = load_model_records(configs_path, [TINY])
    tight = 6 * records[TINY].parameters * 16  # only B*L <= 16
    plan = make_plan(max_step_flops=tight, variants=[
        {"name": "more budget", "points": [[2, 32]], "max_step_flops": 1e30, "models": [TINY]}])
    [job] = make_jobs(plan, configs_path)
    point = next(p for p in job.points if (p.batch_size, p.seq_len) == (2, 32))
    assert point.skip_reason is None
    assert len({job.key(p) for p in job.points}) == len(job.points)


def test_prune_reason_covers_larger_batches_and_longer_sequences():
    ooms = [(4, 256)]
    assert sweep.prune_reason(ooms, 8, 256) == "pruned after oom at B=4, L=256"
    assert sweep.prune_reason(ooms, 4, 512) == "pruned after oom at B=4, L=256"
    assert sweep.prune_reason(ooms, 2, 512) is None
    assert sweep.prune_reason(ooms, 8, 128) is None


@pytest.mark.parametrize("data, message", [
    ({"grid": {"batch_sizes": [1], "seq_lens": [16]}, "precisions": ["fp16"]}, "precision 'fp16' is not one of"),
    ({"grid": {"batch_sizes": [0, 1], "seq_lens": [16]}}, "grid.batch_sizes: 0 is not a positive integer"),
    ({"grid": {"batch_sizes": [1], "seq_lens": [-8]}}, "grid.seq_lens: -8 is not a positive integer"),
    ({"grid": {"batch_sizes": [1], "seq_lens": [16]}, "max_step_flops": "lots"}, "max_step_flops: 'lots'"),
    ({"grid": {"batch_sizes": [1], "seq_lens": [16]}, "variants": [{"optimizer": "adam8bit"}]}, "optimizer 'adam8bit'"),
    ({"grid": {"batch_sizes": [1], "seq_lens": [16]}, "modles": []}, "unknown key 'modles'"),
])
def test_bad_plans_are_one_line_user_errors(data, message):
    with pytest.raises(UserError, match=message) as info:
        sweep.parse_plan(data, "plan.yaml")
    assert "\n" not in str(info.value)


# --- one CPU sweep, shared by the tests below ------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_sweep(configs_path, tmp_path_factory):
    """A real sweep on the CPU: tiny-llama in fp32 and bf16 with every variant, plus a model that
    cannot be built. Returns (jobs, parts folder, aggregated frame, outcomes, progress lines)."""
    import torch

    torch.ones(512, 512) @ torch.ones(512, 512)  # the parent's OpenMP pool is live, as after other tests
    records, _ = load_model_records(configs_path, [TINY])
    plan = make_plan(
        precisions=["fp32", "bf16"], models=[TINY, BROKEN],
        grid={"batch_sizes": [1, 2], "seq_lens": [16, 32, 128]},
        max_step_flops=6 * records[TINY].parameters * 32,  # (2, 32) is over budget
        variants=[{"name": "ckpt", "gradient_checkpointing": True, "models": [TINY], "precisions": ["fp32"],
                   "points": [[2, 16]]},
                  {"name": "sgd", "optimizer": "sgd", "models": [TINY], "points": [[2, 16]]},
                  {"name": "blog", "variant": "blog", "models": [TINY], "points": [[2, 16]],
                   "precisions": ["fp32"]}])
    jobs = make_jobs(plan, configs_path)
    parts = tmp_path_factory.mktemp("sweep") / "parts"
    progress = []
    outcomes = sweep.run_sweep(jobs, parts, device="cpu", child_timeout=120, log=progress.append)
    frame = sweep.aggregate(parts, parts.parent / "peak_memory.parquet")
    return jobs, parts, frame, outcomes, progress


def test_cpu_sweep_rows_have_every_column_typed(cpu_sweep):
    import pandas as pd

    jobs, parts, frame, outcomes, progress = cpu_sweep
    assert outcomes == {"finished": 4, "error": 0, "stopped": 0, "restarted": 0, "not started": 0}
    total = sum(len(job.points) for job in jobs)
    assert progress[-1].startswith(f"sweep: {total}/{total} grid points, 4/4 processes"), progress
    stored = pd.read_parquet(parts.parent / "peak_memory.parquet")
    assert tuple(stored.columns) == COLUMNS
    assert {c: str(t) for c, t in stored.dtypes.items()} == COLUMN_DTYPES
    assert not stored.duplicated(list(POINT_KEY)).any()
    assert set(stored["status"]) == {"ok", "skipped", "error"}
    ok = stored[stored["status"] == "ok"]
    assert (ok["measure_device"] == "cpu").all() and ok["peak_allocated_bytes"].isna().all()
    assert (ok["steps"] == 3).all() and (ok["step_seconds"] > 0).all() and (ok["tokens_per_second"] > 0).all()
    assert ok["torch_version"].notna().all() and ok["git_commit"].notna().all()
    assert (ok["config_source"] == "embedded").all() and ok["device"].str.startswith("cpu").all()


def test_cpu_sweep_weights_and_optimizer_state_are_real_sizes(cpu_sweep):
    _, _, frame, *_ = cpu_sweep
    ok = frame[(frame["status"] == "ok") & (frame["model_id"] == TINY)]
    n = int(ok["parameters"].iloc[0])
    for precision, size in (("fp32", 4), ("bf16", 2)):
        rows = ok[ok["precision"] == precision]
        adamw = rows[rows["optimizer"] == "adamw"]["optimizer_state_bytes"]
        sgd = rows[rows["optimizer"] == "sgd"]["optimizer_state_bytes"]
        # exp_avg + exp_avg_sq in the parameters' dtype, plus AdamW's 4-byte step counters, which
        # live on the CPU (so on CUDA they are not counted)
        assert len(set(adamw)) == 1 and 2 * n * size < adamw.iloc[0] <= 2 * n * size + 4 * 64
        assert set(sgd) == {n * size}  # momentum buffer
        assert (rows["weights_bytes"] >= n * size).all()  # parameters + buffers (rotary inv_freq)
    blog = ok[ok["variant"] == "blog"].iloc[0]
    assert not blog["train_mode"] and blog["use_cache"]
    standard = ok[ok["variant"] == "standard"]
    assert standard["train_mode"].all() and not standard["use_cache"].any()


def test_cpu_sweep_records_skips_and_a_model_that_cannot_be_built(cpu_sweep):
    _, _, frame, *_ = cpu_sweep
    tiny = statuses(frame[frame["model_id"] == TINY].to_dict("records"))
    assert tiny[("fp32", "standard", "adamw", False, "default", 1, 128)] == (
        "skipped", "seq_len 128 beyond the context length 64")
    assert tiny[("fp32", "standard", "adamw", False, "default", 2, 32)][1].startswith("over compute budget")
    assert tiny[("fp32", "standard", "adamw", True, "default", 2, 16)][0] == "ok"
    broken = frame[frame["model_id"] == BROKEN]
    runnable = broken[~broken["reason"].str.startswith(("seq_len", "over compute"))]
    assert len(runnable) > 0 and (runnable["status"] == "error").all()
    assert runnable["reason"].str.startswith("model build failed: UserError: test/broken-gpt2: hidden size 30 is "
                                             "not a multiple of 4 attention heads").all()


def test_dry_run_prints_the_plan_and_its_estimate(configs_path, tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text(yaml.safe_dump({"grid": {"batch_sizes": [1, 2], "seq_lens": [16, 32]},
                                    "models": [TINY, "not/there"],
                                    "precisions": ["bf16", "fp32"]}))
    code = main(["sweep", "--dry-run", "--plan", str(plan), "--configs", str(configs_path),
                        "--parts", str(tmp_path / "parts")])
    out = capsys.readouterr().out
    assert code == 0
    assert "not/there has no usable config" in out
    assert "pass bf16: 1 processes, 4 pending points (4 to run" in out
    assert "estimated GPU time of the pending plan" in out
    assert not (tmp_path / "parts").exists()


def test_estimate_grows_with_the_work(configs_path):
    [job] = make_jobs(make_plan(), configs_path)
    estimate = sweep.DEFAULT_TIME_MODEL
    full = sweep.job_estimate(job, [], estimate, 80 * 2**30)
    half = sweep.job_estimate(job, [{**_key_row(job, p), "status": "ok"} for p in job.points[:3]], estimate, 80 * 2**30)
    assert full["measured"] == 6 and half["measured"] == 3  # L=128 is beyond the context
    assert full["seconds"] > half["seconds"] > estimate.process_overhead_seconds
    tiny_gpu = sweep.job_estimate(job, [], estimate, 1)  # everything foreseen oom: one point runs, the rest pruned
    assert tiny_gpu["measured"] == 1 and tiny_gpu["foreseen_oom"] == 1


def _key_row(job, point) -> dict:
    return dict(zip(POINT_KEY, job.key(point), strict=True))


# --- resuming --------------------------------------------------------------------------------------

def test_rerun_measures_only_missing_points_and_aggregate_keeps_one_row_per_key(configs_path, tmp_path):
    [job] = make_jobs(make_plan(grid={"batch_sizes": [1, 2], "seq_lens": [16, 32]}), configs_path)
    parts = tmp_path / "parts"
    sweep.run_sweep([job], parts, device="cpu")
    part = sweep.part_path(parts, job)
    rows = sweep.read_rows(part)
    assert len(rows) == 4 and sweep.pending_points(job, rows) == []
    # Cut the part as a killed child would: two rows kept, then a torn line.
    part.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + '{"model_id": "test/tiny')
    pending = sweep.pending_points(job, sweep.read_rows(part))
    assert [(p.batch_size, p.seq_len) for p in pending] == [(1, 32), (2, 32)]
    sweep.run_sweep([job], parts, device="cpu")
    rows = sweep.read_rows(part)
    assert len(rows) == 4 and len({sweep.row_key(r) for r in rows}) == 4
    # A stale skipped row for a measured key, and an exact duplicate: one row per key survives.
    sweep.append_row(part, {**rows[0], "status": "skipped", "finished_at": time.time() + 100})
    sweep.append_row(part, rows[1])
    frame = sweep.aggregate(parts, tmp_path / "out.parquet")
    assert len(frame) == 4 and set(frame["status"]) == {"ok"}
    assert sweep.run_sweep([job], parts, device="cpu")["finished"] == 0  # nothing left to run


def test_pruning_after_an_oom_row_from_an_earlier_run(configs_path, tmp_path):
    [job] = make_jobs(make_plan(grid={"batch_sizes": [1, 2, 4], "seq_lens": [16, 32]}), configs_path)
    parts = tmp_path / "parts"
    oom_point = next(p for p in job.points if (p.batch_size, p.seq_len) == (2, 16))
    parts.mkdir()
    sweep.append_row(sweep.part_path(parts, job), {**_key_row(job, oom_point), "status": "oom",
                                                   "reason": "out of memory in forward: OutOfMemoryError: ..."})
    sweep.run_sweep([job], parts, device="cpu")
    rows = sweep.read_rows(sweep.part_path(parts, job))
    got = {(r["batch_size"], r["seq_len"]): (r["status"], r["reason"]) for r in rows}
    assert got[(1, 16)][0] == got[(1, 32)][0] == "ok"
    for point in ((4, 16), (2, 32), (4, 32)):
        assert got[point] == ("oom", "pruned after oom at B=2, L=16")


def test_retry_errors_measures_error_points_again(configs_path, tmp_path):
    [job] = make_jobs(make_plan(grid={"batch_sizes": [1], "seq_lens": [16]}), configs_path)
    error = {**_key_row(job, job.points[0]), "status": "error", "reason": "earlier failure", "finished_at": 1.0}
    assert sweep.pending_points(job, [error]) == []
    assert sweep.pending_points(job, [error], retry_errors=True) == job.points
    parts = tmp_path / "parts"
    parts.mkdir()
    sweep.append_row(sweep.part_path(parts, job), error)
    sweep.run_sweep([job], parts, device="cpu", retry_errors=True)
    frame = sweep.aggregate(parts, tmp_path / "out.parquet")
    assert list(frame["status"]) == ["ok"]


# --- isolation -------------------------------------------------------------------------------------

def dies_in_its_first_point(job, parts_dir, *args):
    """A child that dies like a segfaulting kernel: in the middle of a point."""
    import faulthandler

    faulthandler.disable()  # pytest's handler would print the dying child's stack
    part = sweep.part_path(parts_dir, job)
    sweep.write_current(part, json.dumps({"batch_size": 1, "seq_len": 16}))
    os.kill(os.getpid(), signal.SIGSEGV)


def hangs(job, parts_dir, *args):
    time.sleep(600)


def test_a_dying_child_gets_error_rows_and_the_sweep_goes_on(configs_path, tmp_path):
    jobs = make_jobs(make_plan(precisions=["fp32", "bf16"], grid={"batch_sizes": [1, 2], "seq_lens": [16]}),
                     configs_path)
    fp32, bf16 = jobs

    def target(job, *args):
        (dies_in_its_first_point if job.precision == "fp32" else sweep.run_job)(job, *args)

    outcomes = sweep.run_sweep(jobs, tmp_path, device="cpu", target=target)
    assert outcomes["error"] == 1 and outcomes["finished"] == 1
    died = statuses(sweep.read_rows(sweep.part_path(tmp_path, fp32)))
    assert died[("fp32", "standard", "adamw", False, "default", 1, 16)] == (
        "error", "the child process died during this point (killed by SIGSEGV)")
    assert died[("fp32", "standard", "adamw", False, "default", 2, 16)] == (
        "error", "not measured: the child process died (killed by SIGSEGV)")
    assert {s for s, _ in statuses(sweep.read_rows(sweep.part_path(tmp_path, bf16))).values()} == {"ok"}


def test_a_child_without_progress_is_killed_after_the_timeout(configs_path, tmp_path):
    [job] = make_jobs(make_plan(grid={"batch_sizes": [1], "seq_lens": [16]}), configs_path)
    start = time.time()
    outcomes = sweep.run_sweep([job], tmp_path, device="cpu", child_timeout=1, target=hangs)
    assert outcomes["error"] == 1 and time.time() - start < 30
    [row] = sweep.read_rows(sweep.part_path(tmp_path, job))
    assert row["status"] == "error"
    assert row["reason"] == "not measured: the child process died (no progress for 1 s (killed))"


def stops_after_an_oom_once(job, parts_dir, *args):
    """The first child of the job ends as a client that needs a fresh process after an oom does;
    the next one measures the points."""
    marker = Path(parts_dir) / "stopped-once"
    if not marker.exists():
        marker.write_text("1")
        sys.exit(sweep.EXIT_FRESH_PROCESS)
    sweep.run_job(job, parts_dir, *args)


def test_a_child_that_asks_for_a_fresh_process_is_started_again(configs_path, tmp_path):
    [job] = make_jobs(make_plan(grid={"batch_sizes": [1, 2], "seq_lens": [16]}), configs_path)
    outcomes = sweep.run_sweep([job], tmp_path, device="cpu", target=stops_after_an_oom_once, log=lambda *a: None)
    assert outcomes["restarted"] == 1 and outcomes["finished"] == 1 and outcomes["not started"] == 0
    starts = [e for e in sweep.read_rows(tmp_path / sweep.EVENTS_FILE) if e["event"] == "child_start"]
    assert len(starts) == 2
    assert [row["status"] for row in sweep.read_rows(sweep.part_path(tmp_path, job))] == ["ok", "ok"]


def cannot_set_up_the_device(job, parts_dir, *args):
    message = "device setup failed: RuntimeError: CUDA error: initialization error"
    sweep.write_current(sweep.part_path(parts_dir, job), message)
    sys.exit(sweep.EXIT_SETUP_FAILED)


def test_a_child_that_cannot_set_up_the_device_stops_the_sweep_without_rows(configs_path, tmp_path):
    jobs = make_jobs(make_plan(precisions=["fp32", "bf16"], grid={"batch_sizes": [1], "seq_lens": [16]}), configs_path)
    with pytest.raises(UserError, match="rerun with --start-method spawn") as info:
        sweep.run_sweep(jobs, tmp_path, device="cpu", target=cannot_set_up_the_device, log=lambda *a: None)
    assert "CUDA error: initialization error" in str(info.value)
    starts = [e for e in sweep.read_rows(tmp_path / sweep.EVENTS_FILE) if e["event"] == "child_start"]
    assert len(starts) == 1 and all(sweep.read_rows(sweep.part_path(tmp_path, job)) == [] for job in jobs)


def test_two_gpu_slots_run_two_children_at_once(configs_path, tmp_path):
    jobs = make_jobs(make_plan(precisions=["fp32", "bf16"], grid={"batch_sizes": [1], "seq_lens": [16]}), configs_path)
    outcomes = sweep.run_sweep(jobs, tmp_path, device="cpu", gpus=2)
    assert outcomes["finished"] == 2
    starts = [e for e in sweep.read_rows(tmp_path / sweep.EVENTS_FILE) if e["event"] == "child_start"]
    assert sorted(e["gpu"] for e in starts) == ["0", "1"]
    assert all(sweep.read_rows(sweep.part_path(tmp_path, job))[0]["status"] == "ok" for job in jobs)


def test_time_limit_launches_nothing_when_too_close_and_leaves_the_work_pending(configs_path, tmp_path):
    [job] = make_jobs(make_plan(grid={"batch_sizes": [1], "seq_lens": [16]}), configs_path)
    outcomes = sweep.run_sweep([job], tmp_path, device="cpu", time_limit=1)
    assert outcomes == {"finished": 0, "error": 0, "stopped": 0, "restarted": 0, "not started": 1}
    assert sweep.read_rows(sweep.part_path(tmp_path, job)) == []


def test_a_child_stops_before_a_point_that_would_pass_the_deadline(configs_path, tmp_path):
    [job] = make_jobs(make_plan(grid={"batch_sizes": [1, 2], "seq_lens": [16]}), configs_path)
    process = multiprocessing.get_context("fork").Process(
        target=sweep.run_job, args=(job, str(tmp_path), "cpu", time.time() + 1.0))
    process.start()
    process.join(60)
    assert process.exitcode == sweep.EXIT_DEADLINE
    assert sweep.read_rows(sweep.part_path(tmp_path, job)) == []


# --- the phase tracker -----------------------------------------------------------------------------

def test_phase_tracker_names_the_failing_phase_and_tracks_nothing_on_the_cpu():
    tracker = PhaseTracker("cpu")
    with tracker.phase("forward"):
        assert tracker.current == "forward"
    assert tracker.current is None
    with pytest.raises(RuntimeError), tracker.phase("backward"):
        raise RuntimeError("out of memory")
    assert tracker.current == "backward"  # measure_point's reason says where it failed
    assert set(tracker.columns().values()) == {None}


# --- measure and the command line ------------------------------------------------------------------

def test_measure_one_point_on_the_cpu(configs_path, capsys):
    code = main(["measure", "--model", TINY, "--configs", str(configs_path), "--batch", "2", "--seq", "16",
                        "--precision", "bf16", "--optimizer", "sgd", "--device", "cpu", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert code == 0 and row["status"] == "ok" and row["precision"] == "bf16"
    assert row["optimizer_state_bytes"] == row["parameters"] * 2
    assert row["peak_allocated_bytes"] is None and row["measure_device"] == "cpu"


@pytest.mark.parametrize("argv, message", [
    (["measure", "--model", TINY, "--batch", "0", "--seq", "16"], "argument --batch: '0' must be positive"),
    (["measure", "--model", TINY, "--batch", "1", "--seq", "-4"], "argument --seq: '-4' must be positive"),
    (["measure", "--model", TINY, "--batch", "1", "--seq", "4", "--precision", "fp16"], "invalid choice: 'fp16'"),
    (["sweep", "--batch-sizes", "0"], "argument --batch-sizes: '0' must be positive"),
])
def test_bad_arguments_get_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and err.count("\n") == 1


def test_bad_plan_and_unknown_precision_on_the_command_line(configs_path, tmp_path, capsys):
    plan = tmp_path / "plan.yaml"
    plan.write_text("grid: {batch_sizes: [1], seq_lens: [16]}\nprecisions: [fp8]\nmodels: []\n")
    assert main(["sweep", "--dry-run", "--plan", str(plan), "--configs", str(configs_path)]) == 2
    assert capsys.readouterr().err == f"error: {plan}: precisions: precision 'fp8' is not one of fp32, bf16, amp-bf16, amp-fp16, bf16-autocast, mp-bf16\n"
    plan.write_text("grid: {batch_sizes: [1], seq_lens: [16]}\nmodels: [test/tiny-llama]\n")
    assert main(["sweep", "--dry-run", "--plan", str(plan), "--configs", str(configs_path),
                        "--precisions", "fp16"]) == 2
    assert "precision 'fp16' is not one of" in capsys.readouterr().err


def test_sweep_on_a_cpu_machine_reuses_the_committed_table(cpu_sweep, tmp_path, capsys):
    import torch

    _, parts, frame, *_ = cpu_sweep
    table = parts.parent / "peak_memory.parquet"
    assert main(["sweep", "--out", str(table)]) == 0
    out = capsys.readouterr().out
    assert out == f"sweep: no CUDA device here; reusing the committed {table} ({len(frame)} rows)\n"
    assert main(["sweep", "--out", str(tmp_path / "absent.parquet")]) == 0
    assert "no CUDA device here and no" in capsys.readouterr().out
    assert not torch.cuda.is_initialized()


def test_aggregate_command_merges_parts(cpu_sweep, tmp_path, capsys):
    _, parts, frame, *_ = cpu_sweep
    assert main(["sweep", "--aggregate", "--parts", str(parts), "--out", str(tmp_path / "t.parquet")]) == 0
    assert f"sweep: {len(frame)} rows (" in capsys.readouterr().out
    empty = ["sweep", "--aggregate", "--parts", str(tmp_path / "none"), "--out", str(tmp_path / "u.parquet")]
    assert main(empty) == 0
    assert "nothing aggregated" in capsys.readouterr().out and not (tmp_path / "u.parquet").exists()


def test_the_gpu_machine_needs_no_jsonschema_snakemake_or_datasets():
    code = ("import sys\n"
            "for name in ('jsonschema', 'snakemake', 'datasets'): sys.modules[name] = None\n"
            "import pipeline.inputs.registry, pipeline.inputs.configs, pipeline.measure.point, pipeline.measure.sweep\n"
            "from pipeline.measure.cli import main\n"
            "sys.exit(main(['sweep', '--help']))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--time-limit" in result.stdout


def test_efficiency_benchmark_reads_the_parts(cpu_sweep):
    _, parts, *_ = cpu_sweep
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sweep_efficiency.py"), "--parts", str(parts)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "| run | started (unix) | GPUs | wall s |" in result.stdout
    assert "Share of GPU wall time inside measured training steps:" in result.stdout
    assert "| inside measured steps |" in result.stdout


def test_a_fresh_machine_resumes_from_the_committed_table(tmp_path, capsys):
    """--resume-from seeds the parts from a peak table: the committed SFT plan (96 rows, all measured on an H100)
    leaves nothing to run. A dry run says so and writes nothing; seeding skips a job whose part file exists."""
    from pipeline.core.paths import CONFIGS
    from pipeline.measure.sweep.parts import seed_parts

    parts = tmp_path / "parts"
    args = ["sweep", "--plan", "config/sweep_sft.yaml", "--configs", str(CONFIGS), "--parts", str(parts),
            "--resume-from", "results/sft/h100/peak_memory.parquet", "--dry-run"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "96 rows of results/sft/h100/peak_memory.parquet would be seeded" in out
    assert "estimated GPU time of the pending plan: 0.0 min" in out
    assert not parts.exists()
    plan = sweep.load_plan("config/sweep_sft.yaml")
    records, _ = load_model_records(CONFIGS, plan.models)
    jobs = sweep.plan_jobs(plan, records)
    assert seed_parts(jobs, parts, ["results/sft/h100/peak_memory.parquet"]) == 96
    assert len(list(parts.glob("*.jsonl"))) == 30
    assert seed_parts(jobs, parts, ["results/sft/h100/peak_memory.parquet"]) == 0
    assert main(args[:-3] + ["--resume-from", str(tmp_path / "none.parquet"), "--dry-run"]) == 2
