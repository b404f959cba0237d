"""`python -m pipeline sweep`: plan, run (or dry-run) and merge the peak-memory sweep.

`python -m pipeline.measure.sweep` runs only the measurement's commands (`measure` and `sweep`), so that
the GPU machine does not depend on the other stages' imports.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path

from pipeline.core.paths import CONFIGS, PEAKS, PEAK_PARTS, REPO_ROOT

DEFAULT_PLAN = REPO_ROOT / "config" / "sweep.yaml"


def add_cli(subparsers) -> None:
    from pipeline.core.arguments import positive_int, positive_number

    parser = subparsers.add_parser("sweep", help="peak-memory sweep on the GPU (a CPU machine reuses the table)")
    parser.add_argument("--plan", default=DEFAULT_PLAN)
    parser.add_argument("--configs", default=CONFIGS, help="output of `pipeline configs`")
    parser.add_argument("--parts", default=PEAK_PARTS, help="folder of per-process row files (resumable)")
    parser.add_argument("--out", default=PEAKS)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and its estimated GPU time")
    parser.add_argument("--gpu-memory-gib", type=positive_number, metavar="GIB",
                        help="the device memory the dry run's estimate assumes (default: the plan's gpu_memory_gib)")
    parser.add_argument("--aggregate", action="store_true", help="only merge the parts into --out")
    parser.add_argument("--include", nargs="+", default=[], metavar="TABLE",
                        help="peak tables whose rows the merge takes too (e.g. the committed one)")
    parser.add_argument("--resume-from", nargs="+", default=[], metavar="TABLE",
                        help="peak tables whose rows settle their points (a fresh machine resuming a committed "
                             "table: seeded into --parts where a job has no part file yet)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cpu: a real but peak-less debug run")
    parser.add_argument("--time-limit", type=positive_int, metavar="SECONDS",
                        help="stop starting work this long after this process started; rerun to continue")
    parser.add_argument("--gpus", type=positive_int, default=1, help="children at once, one GPU each")
    parser.add_argument("--start-method", choices=("fork", "spawn"), default="fork")
    parser.add_argument("--child-timeout", type=positive_int, metavar="SECONDS",
                        help="kill a child that writes no row for this long (default: the plan's)")
    parser.add_argument("--retry-errors", action="store_true", help="measure points with error rows again")
    parser.add_argument("--models", nargs="+", metavar="ID")
    parser.add_argument("--precisions", nargs="+", metavar="P")
    parser.add_argument("--batch-sizes", nargs="+", type=positive_int, metavar="B")
    parser.add_argument("--seq-lens", nargs="+", type=positive_int, metavar="L")
    parser.add_argument("--max-step-flops", type=positive_number, metavar="FLOPS")
    parser.add_argument("--standard-only", action="store_true", help="leave out the plan's variants")
    parser.set_defaults(handler=_sweep_command)


def _sweep_command(args) -> int:
    from pipeline.inputs.records import load_model_records
    from pipeline.measure.device import cuda_device
    from pipeline.measure.sweep.cost import plan_report
    from pipeline.measure.sweep.jobs import plan_jobs
    from pipeline.measure.sweep.parts import aggregate, event, seed_parts
    from pipeline.measure.sweep.plan import GIB, load_plan, number, override_plan
    from pipeline.measure.sweep.runner import run_sweep

    if args.aggregate:
        return _aggregate_command(args)
    device = None if args.dry_run else cuda_device(args.device)
    if not args.dry_run and device is None:
        return _reuse_message(args.out)
    plan = override_plan(load_plan(args.plan), args.models, args.precisions, args.batch_sizes, args.seq_lens,
                         args.max_step_flops, args.standard_only)
    records, missing = load_model_records(args.configs, plan.models)
    for model_id in missing:
        print(f"sweep: warning: {model_id} has no usable config in {args.configs}; left out")
    jobs = plan_jobs(plan, records)
    if args.dry_run:
        if args.gpu_memory_gib:
            plan = replace(plan, gpu_memory_bytes=number(args.gpu_memory_gib, "--gpu-memory-gib") * GIB)
        with _seeded_copy(jobs, args.parts, args.resume_from) as parts:  # a dry run writes nothing
            lines, _ = plan_report(jobs, parts, plan, args.retry_errors)
        print("\n".join(lines))
        return 0
    if args.resume_from:
        print(f"sweep: {seed_parts(jobs, args.parts, args.resume_from)} rows of {', '.join(args.resume_from)} "
              f"seeded into {args.parts}")
    outcomes = run_sweep(jobs, args.parts, device, args.time_limit, args.child_timeout or plan.child_timeout_seconds,
                         args.gpus, args.start_method, plan.allow_tf32, args.retry_errors, plan.estimate)
    frame = aggregate(args.parts, args.out, args.include)
    event(args.parts, "aggregated", rows=0 if frame is None else len(frame))
    left = outcomes["not started"] + outcomes["stopped"]
    print(f"sweep: {outcomes['finished']} processes finished, {outcomes['error']} failed, "
          f"{outcomes['stopped']} stopped at the time limit, {outcomes['restarted']} restarted for their next point; {0 if frame is None else len(frame)} rows -> {args.out}"
          + (f"; {left} processes left: rerun the same command to continue" if left else "; plan complete"))
    return 0


@contextlib.contextmanager
def _seeded_copy(jobs, parts_dir, tables):
    """`parts_dir`, or without touching it a temporary copy of it with the rows of `tables` seeded."""
    import shutil
    import tempfile

    from pipeline.measure.sweep.parts import seed_parts

    if not tables:
        yield parts_dir
        return
    with tempfile.TemporaryDirectory(prefix="avp-dry-run-") as scratch:
        copy = Path(scratch) / "parts"
        if Path(parts_dir).is_dir():
            shutil.copytree(parts_dir, copy)
        seeded = seed_parts(jobs, copy, tables)
        print(f"sweep: {seeded} rows of {', '.join(map(str, tables))} would be seeded into {parts_dir}")
        yield copy


def _aggregate_command(args) -> int:
    from pipeline.measure.sweep.parts import aggregate

    frame = aggregate(args.parts, args.out, args.include)
    if frame is None:
        print(f"sweep: no part files in {args.parts}; nothing aggregated")
    else:
        counts = frame["status"].value_counts().to_dict()
        print(f"sweep: {len(frame)} rows ({', '.join(f'{k}: {v}' for k, v in sorted(counts.items()))}) -> {args.out}")
    return 0


def _reuse_message(out) -> int:
    path = Path(out)
    if path.exists():
        import pyarrow.parquet as pq

        print(f"sweep: no CUDA device here; reusing the committed {path} ({pq.read_metadata(path).num_rows} rows)")
    else:
        print(f"sweep: no CUDA device here and no {path}: peak memory is measured on a GPU machine "
              f"(python -m pipeline sweep); later stages go on without it")
    return 0
