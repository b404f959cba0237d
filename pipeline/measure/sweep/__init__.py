"""Stage: the peak-memory sweep: plan (config/sweep.yaml), isolated child processes, resumable parts.

Plan (`plan`): every (model, precision, attention, client) is one job (`jobs`), run in its own child
process (`child`, a fresh CUDA context); its points are the plan's settings (standard step,
checkpointing, SGD, blog loop; the Trainer's optim and gradient accumulation) times the (B, L)
grid, each L in increasing B. Points with adapters (a group's `lora:` key) are jobs of their own,
whose child builds a fresh model per point (PEFT wraps the base in place). Points beyond the context length or
over the compute budget (6*N*B*L FLOPs per step) are `skipped`; once (B, L) runs out of memory,
every point with B' >= B and L' >= L of the same setting is recorded `oom` without running. Jobs
run smallest model first, so a sweep that is cut off still covers many models.

The parent (`runner`) forks the children after importing torch and transformers, without ever
initialising CUDA. Each child appends its rows to `<parts>/<job>.jsonl` (`parts`: flushed and
fsynced per row) and writes `<job>.done` at the end; a rerun skips points that have rows. A child
that dies or stops making progress gets error rows for its remaining points. `--time-limit` stops
launching children (and children stop starting points) before the limit. The parts are merged into
results/peak_memory.parquet (deduplicated on the point key, atomic write). `cost` estimates the GPU
time (`--dry-run`); `cli` is the `sweep` command. One point in this process: `pipeline.measure.point`.
"""

from pipeline.measure.sweep.child import EXIT_DEADLINE, EXIT_FRESH_PROCESS, EXIT_SETUP_FAILED, fill_remaining, run_job
from pipeline.measure.sweep.cli import DEFAULT_PLAN, add_cli
from pipeline.measure.sweep.cost import job_estimate, plan_report, point_seconds
from pipeline.measure.sweep.jobs import Job, Point, plan_jobs, step_flops
from pipeline.measure.sweep.parts import (EVENTS_FILE, aggregate, append_row, event, oom_points, part_path, pending_points,
                                  prune_reason, read_rows, row_key, write_current)
from pipeline.measure.sweep.plan import (DEFAULT_TIME_MODEL, TimeModel, Grid, Group, Plan, load_plan, override_plan,
                                 parse_plan, plan_models)
from pipeline.measure.sweep.runner import run_sweep

__all__ = [
    "DEFAULT_TIME_MODEL", "DEFAULT_PLAN", "EVENTS_FILE", "EXIT_DEADLINE", "EXIT_FRESH_PROCESS", "EXIT_SETUP_FAILED", "TimeModel", "Grid",
    "Group", "Job", "Plan", "Point", "add_cli", "aggregate", "append_row", "event", "fill_remaining", "job_estimate",
    "load_plan", "oom_points", "override_plan", "parse_plan",
    "part_path", "pending_points", "plan_jobs", "plan_models", "plan_report", "point_seconds", "prune_reason",
    "read_rows", "row_key", "run_job", "run_sweep", "step_flops", "write_current",
]
