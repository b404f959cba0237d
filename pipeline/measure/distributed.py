"""The standard step on N GPUs under DDP or FSDP2, measured: rank 0's peaks (issue 14).

One torchrun job per point group (model, precision, N, sharding): every rank builds the model,
shards it (`pipeline.training.sharding.shard`, the call the simulation makes), resets
the CUDA peak counters and runs the standard step three times per grid point (smallest first);
rank 0 writes one peak-table row per point with `num_gpus` and `sharding` columns. A point that
runs out of memory marks every larger point of its group oom without running it. NVLink
multicast stays off (NCCL_NVLS_ENABLE=0: it reserves memory outside PyTorch's allocator that the
single-GPU rows do not have).

FSDP2 models are built on the meta device, sharded, then given storage with `to_empty` on the GPU
(the weights' values change no memory), so models that do not fit one GPU can be measured; DDP
needs the whole model on every GPU and builds it there.

    python3 -m pipeline.measure.distributed --plan config/sweep_distributed.yaml --out results/distributed/peak_memory.parquet
    python3 -m pipeline.measure.distributed --plan config/sweep_distributed.yaml --dry-run

The plan's keys: models, precisions, num_gpus, shardings, grid {batch_sizes, seq_lens}, and
optionally configs (configs.json), timeout_seconds per group.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.core.paths import CONFIGS, REPO_ROOT, RESULTS
from pipeline.training.step import Setting
from pipeline.core.vocabulary import PRECISIONS, SHARDINGS, check_choice

DISTRIBUTED_COLUMNS = ("num_gpus", "sharding")
PLAN_KEYS = {"models", "precisions", "num_gpus", "shardings", "grid", "configs", "timeout_seconds"}


# --- one rank (under torchrun) -------------------------------------------------------------------

def run_group(model_id: str, precision: str, sharding: str, points: list, configs_path, out: str,
              config_path: str | None = None) -> None:
    """Every point of one group on this rank; rank 0 appends a JSON row per point to `out`."""
    import torch
    import torch.distributed as dist

    from pipeline.inputs.records import model_record
    from pipeline.measure.device import setup_device
    from pipeline.measure.point import base_columns, finish_row

    device = "cuda" if torch.cuda.is_available() else "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = model_record(None if config_path else model_id, config_path, configs_path)
    setting = Setting()
    device_columns = setup_device(device, allow_tf32=True)
    out_of_memory_at = None
    try:
        for batch, seq in points:
            row = base_columns(record, precision, "default", setting, batch, seq)
            row.update(device_columns)
            if out_of_memory_at and batch >= out_of_memory_at[0] and seq >= out_of_memory_at[1]:
                row.update(status="oom", reason=f"out of memory at B={out_of_memory_at[0]} L={out_of_memory_at[1]}")
            else:
                row.update(measure_sharded_point(record, precision, sharding, batch, seq, device, local_rank))
                if row["status"] == "oom":
                    out_of_memory_at = (batch, seq)
            row = finish_row(row)
            row.update(num_gpus=world, sharding=sharding)
            if rank == 0:
                with open(out, "a") as handle:
                    handle.write(json.dumps(row, default=str) + "\n")
    finally:
        dist.destroy_process_group()


def measure_sharded_point(record, precision: str, sharding: str, batch: int, seq: int, device: str,
                          local_rank: int) -> dict:
    """The columns of one point on this rank (status ok, oom or error); never raises."""
    import gc

    import torch

    from pipeline.measure.clients.tracking import PhaseTracker
    from pipeline.measure.nvml import nvml_columns
    from pipeline.core.text import first_line
    from pipeline.measure.point import is_out_of_memory

    tracker = PhaseTracker(device)
    columns = {"status": "ok", "reason": None, "started_at": time.time()}
    model = module = None
    try:
        model, module = build_sharded(record, precision, sharding, device, local_rank)
        columns["weights_bytes"] = torch.cuda.memory_allocated() if device == "cuda" else None
        seconds = run_sharded_steps(model, module, precision, batch, seq, device, tracker)
        median = sorted(seconds)[len(seconds) // 2]
        columns.update(tracker.columns(), step_seconds=median, steps=len(seconds),
                       tokens_per_second=batch * seq / median if median > 0 else None, **nvml_columns(device))
    except Exception as exc:  # noqa: BLE001 - a failing point is recorded, the group goes on
        oom = is_out_of_memory(exc)
        where = f" in {tracker.current}" if tracker.current else ""
        columns.update(status="oom" if oom else "error",
                       reason=f"{'out of memory' if oom else 'failed'}{where}: {first_line(exc)}")
    del model, module
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    columns["finished_at"] = time.time()
    return columns


def build_sharded(record, precision: str, sharding: str, device: str, local_rank: int):
    """(model, the module to call): FSDP2 from the meta device, DDP on the GPU; peaks reset after."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from pipeline.inputs.modeling import build
    from pipeline.training.sharding import shard

    config = record.transformers_config()
    target = torch.device(device, local_rank) if device == "cuda" else torch.device("cpu")
    if sharding == "ddp":
        model = build(config, precision, "default", device=str(target))
        module = shard(model, sharding, device_ids=[local_rank] if device == "cuda" else None)
    else:
        import torch.distributed as dist

        model = build(config, precision, "default", device="meta")
        module = shard(model, sharding, init_device_mesh(device, (dist.get_world_size(),)))
        model.to_empty(device=target)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    return model, module


def run_sharded_steps(model, module, precision: str, batch: int, seq: int, device: str, tracker) -> list:
    """The standard step three times (the loop client's, calling the sharded module); seconds per step."""
    from pipeline.measure.clients.loop import run_steps

    seconds, _ = run_steps(model, Setting(), precision, batch, seq, device, tracker, use_cache=False, module=module)
    return seconds


# --- the driver: one torchrun per group ------------------------------------------------------------

def read_plan(path) -> dict:
    import yaml

    try:
        plan = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: cannot read the plan ({type(exc).__name__})") from None
    if not isinstance(plan, dict) or set(plan) - PLAN_KEYS or not {"models", "grid"} <= set(plan):
        raise UserError(f"{path}: a plan is a mapping with models and grid (keys: {', '.join(sorted(PLAN_KEYS))})")
    for precision in plan.setdefault("precisions", ["bf16"]):
        check_choice("precision", precision, PRECISIONS)
    for sharding in plan.setdefault("shardings", ["ddp", "fsdp"]):
        check_choice("sharding", sharding, SHARDINGS)
    return plan


def groups(plan: dict, gpus: int | None = None) -> list[dict]:
    """(model, precision, N, sharding) groups, N within the GPUs there are (all when `gpus` is None)."""
    points = sorted((b, l) for b in plan["grid"]["batch_sizes"] for l in plan["grid"]["seq_lens"])
    return [dict(model_id=m, precision=p, num_gpus=n, sharding=s, points=points)
            for n in sorted(plan.get("num_gpus", [2, 4, 8])) if gpus is None or n <= gpus
            for m in plan["models"] for p in plan["precisions"] for s in plan["shardings"]]


def run_plan(plan_path, out_path, dry_run: bool = False, config_path: str | None = None,
             devices: int | None = None) -> list[dict]:
    """Every group not yet in `out_path` (resume), each in one torchrun; rows appended to
    `out_path`.jsonl and written to `out_path` (parquet) at the end. `devices`: how many ranks a
    group may have (default: the GPUs there are; without GPUs the ranks run on the CPU with gloo)."""
    plan = read_plan(plan_path)
    gpus = None if dry_run else devices or _gpu_count()
    out_path = Path(out_path)
    rows_path = out_path.with_suffix(".jsonl")
    done = {_group_key(r) for r in _read_rows(rows_path)}
    todo = [g for g in groups(plan, gpus) if _group_key(g) not in done]
    for group in todo:
        command = _torchrun(group, plan, rows_path, config_path)
        if dry_run:
            print(" ".join(command))
            continue
        env = dict(os.environ, NCCL_NVLS_ENABLE="0")
        rows_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(command, env=env, timeout=plan.get("timeout_seconds", 1800), check=False)
        except subprocess.TimeoutExpired:
            print(f"measure-distributed: {_group_key(group)} timed out", file=sys.stderr)
    rows = _read_rows(rows_path)
    if rows and not dry_run:
        import pandas as pd

        from pipeline.core.io import write_parquet

        write_parquet(pd.DataFrame(rows), out_path)
    return rows


def _torchrun(group: dict, plan: dict, rows_path: Path, config_path: str | None) -> list[str]:
    points = ",".join(f"{b}:{l}" for b, l in group["points"])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={group['num_gpus']}",
               "-m", "pipeline.measure.distributed", "rank", "--model", group["model_id"],
               "--precision", group["precision"], "--sharding", group["sharding"], "--points", points,
               "--configs", str(plan.get("configs", CONFIGS)), "--out", str(rows_path)]
    return command + (["--config", config_path] if config_path else [])


def _group_key(row: dict) -> tuple:
    return row["model_id"], row["precision"], int(row["num_gpus"]), row["sharding"]


def _read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def add_cli(subparsers) -> None:
    """`python -m pipeline measure-distributed`: the several-GPU plan, one torchrun job per group."""
    from pipeline.core.arguments import positive_int

    parser = subparsers.add_parser("measure-distributed",
                                   help="measure the standard step on several GPUs under DDP / FSDP2 (torchrun)")
    parser.add_argument("--plan", default=REPO_ROOT / "config" / "sweep_distributed.yaml")
    parser.add_argument("--out", default=RESULTS / "distributed" / "peak_memory.parquet")
    parser.add_argument("--config", help="a config.json instead of the plan's model ids (tests)")
    parser.add_argument("--devices", type=positive_int, help="ranks a group may have (default: the GPUs there are)")
    parser.add_argument("--dry-run", action="store_true")
    parser.set_defaults(handler=_measure_command)


def _measure_command(args) -> int:
    rows = run_plan(args.plan, args.out, args.dry_run, args.config, args.devices)
    if not args.dry_run:
        print(f"measure-distributed: {len(rows)} rows -> {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rank"]:
        parser = argparse.ArgumentParser(prog="python -m pipeline.measure.distributed rank")
        parser.add_argument("--model", required=True)
        parser.add_argument("--config")
        parser.add_argument("--precision", choices=PRECISIONS, required=True)
        parser.add_argument("--sharding", choices=SHARDINGS, required=True)
        parser.add_argument("--points", required=True, help="B:L,B:L,... smallest first")
        parser.add_argument("--configs", default=CONFIGS)
        parser.add_argument("--out", required=True)
        args = parser.parse_args(argv[1:])
        points = [tuple(int(v) for v in p.split(":")) for p in args.points.split(",")]
        run_group(args.model, args.precision, args.sharding, points, args.configs, args.out, args.config)
        return 0
    # the driver: `python -m pipeline measure-distributed`'s own arguments and handler
    parser = argparse.ArgumentParser(prog="python -m pipeline.measure.distributed")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["measure-distributed", *argv])
    try:
        return args.handler(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
