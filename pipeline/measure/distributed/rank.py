"""One rank of one several-GPU point, under `torchrun --nproc-per-node N`: every rank measures itself and
writes its own row (`rank{r}.json` in the point's folder), so that a rank that differs is seen as itself.

The loop client (the standard step): the model built on the meta device and sharded by
`pipeline.training.sharding.shard` (FSDP2), then given storage on the GPU, or built on the GPU and wrapped in
DDP; the peak counter reset before the first step. The Trainer clients (trainer, sft, dpo): what a
`torchrun` of their script runs, DDP by default and FSDP2 through `sharding_arguments`: the model is built
with random weights on the GPU and moved to the CPU (as `from_pretrained` leaves it, in its dtype), the
Trainer wraps or shards it, and the peak counter is reset when training begins (`on_train_begin`).

Beside the peaks each row holds the host's resident memory before training and its peak (`host_before_bytes`,
`host_peak_bytes`: what ZeRO-Offload keeps on the host shows there), and what the reserved bytes do not: `nvml_context_bytes` (the process's NVML
figure before the first collective minus the reserved bytes then: the CUDA context without NCCL), and at the
end of training, before anything is let go, `nvml_train_end_bytes` and `reserved_train_end_bytes` (their
difference is the memory outside PyTorch, NCCL's included) and `reserved_by_stream` (the caching allocator's
segments by CUDA stream, JSON: FSDP2's all-gather and reduce-scatter streams keep pools of their own).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from pipeline.measure.point import base_columns, build_point_model, finish_row, measure_point

EXTRA_COLUMNS = ("num_gpus", "sharding", "shard_group", "tensor_parallel", "deepspeed", "deepspeed_version",
                 "hyperparameters", "alloc_conf", "memory_history",
                 "host_before_bytes", "host_peak_bytes", "rank", "split", "first_in_process", "nvml_context_bytes",
                 "nvml_train_end_bytes", "reserved_train_end_bytes", "reserved_by_stream")


def measure_rank(args) -> dict:
    """This rank's row of the point `args` names (status ok, oom or error)."""
    import torch

    from pipeline.inputs.records import model_record
    from pipeline.measure.device import setup_device
    from pipeline.measure.distributed.plan import plan_adapter
    from pipeline.training import memory_history
    from pipeline.training.hyperparameters import Hyperparameters
    from pipeline.training.layout import Layout
    from pipeline.training.packing import Packing
    from pipeline.training.rollout import Rollout
    from pipeline.training.step import Setting

    local_rank, rank = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    history = args.memory_history if rank == 0 and device == "cuda" else None
    if history:
        memory_history.start()
    record = model_record(None if args.config else args.model, args.config, args.configs)
    adapter = plan_adapter(args.adapter, args.sharding)
    setting = Setting(client=args.client, gradient_checkpointing=args.checkpointing, adapter=adapter,
                      sharding=None if args.client == "loop" else args.sharding, deepspeed=args.deepspeed,
                      hyperparameters=Hyperparameters.from_text(args.hyperparameters),
                      rollout=Rollout.from_text(args.rollout), packing=Packing.from_text(args.packing))
    row = base_columns(record, args.precision, "default", setting, args.batch, args.seq)
    row.update(setup_device(device, allow_tf32=True))
    layout = Layout(world, args.sharding, args.shard_group, args.tensor_parallel)
    row.update(layout.columns(), deepspeed=args.deepspeed, rank=rank, split=args.split, first_in_process=True,
               deepspeed_version=deepspeed_version(args.deepspeed),
               alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    if args.client == "loop":
        row.update(loop_point(record, args.precision, layout, args.batch, args.seq, device, local_rank,
                              args.checkpointing))
    else:
        model, built = model_on_host(record, setting, args.precision, device, args.batch, rank)
        row.update(built, step_flops=6.0 * built["parameters"] * args.batch * args.seq)
        row.update(context_columns(device))
        host_before = resident_bytes()
        row.update(measure_point(model, setting, args.precision, args.batch, args.seq, device))
        row.update(host_before_bytes=host_before, host_peak_bytes=peak_resident_bytes())
    if history:
        memory_history.save(history, {key: row.get(key) for key in (
            "status", "peak_reserved_bytes", "peak_allocated_bytes", "nvml_train_end_bytes",
            "reserved_train_end_bytes", "alloc_conf")})
    if isinstance(row.get("reserved_by_stream"), dict):
        row["reserved_by_stream"] = json.dumps(row["reserved_by_stream"])
    extra = {column: row.get(column) for column in EXTRA_COLUMNS}
    return {**finish_row(row), **extra}


def model_on_host(record, setting, precision: str, device: str, batch: int, rank: int = 0):
    """The point's model (with its adapters where the client does not wrap them) built with random weights on
    the GPU, then moved to the CPU; the allocator emptied and its peaks reset, as in a fresh process. Under
    zero3 it is built as a script builds it after its training arguments (`training.zero.zero3_init`): each
    parameter partitioned on the GPU as it is made, where it stays. A 4-bit base is loaded on each rank's GPU as
    `from_pretrained` loads it there (bitsandbytes' loader), where it stays; only the peaks are reset."""
    import torch

    if setting.adapter is not None and setting.adapter.quantization:
        shared_saved_base(record, rank)
        model, built = build_point_model(record, setting, precision, "default", device)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return model, built

    if setting.sharding == "zero3":
        from pipeline.training.zero import zero3_init

        with zero3_init(setting.deepspeed, batch, setting.gradient_accumulation, precision):
            model, built = build_point_model(record, setting, precision, "default", device)
        built["parameters"] = record.parameters  # a partitioned parameter holds none of its elements here
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return model, built
    model, built = build_point_model(record, setting, precision, "default", device)
    if device == "cuda":
        model.to("cpu")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return model, built


def shared_saved_base(record, rank: int, poll_seconds: float = 2.0) -> None:
    """The random init a 4-bit base is loaded from (`training.adapters.saved_base`), saved once by rank 0 while
    the other ranks wait for it to be complete."""
    import time

    from pipeline.training.adapters import saved_base, saved_base_folder

    config = record.transformers_config()
    if rank == 0:
        saved_base(config, record.model_id)
        return
    while not (saved_base_folder(config, record.model_id) / "complete").exists():
        time.sleep(poll_seconds)


def resident_bytes() -> int | None:
    """The process's resident host memory now (Linux: /proc/self/statm)."""
    import os

    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_resident_bytes() -> int:
    """The process's peak resident host memory so far (getrusage's maxrss: KiB on Linux). With
    `host_before_bytes` (resident before training) it bounds what ZeRO-Offload keeps on the host."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def deepspeed_version(config: str | None) -> str | None:
    """The version of DeepSpeed that ran the point (None without a DeepSpeed config)."""
    if config is None:
        return None
    from importlib.metadata import version

    return version("deepspeed")


def context_columns(device: str) -> dict:
    """The process's memory on its GPU outside the allocator before any collective (CUDA context, kernels)."""
    import torch

    from pipeline.measure.nvml import nvml_columns

    used = nvml_columns(device)["nvml_used_bytes"]
    if used is None:
        return {"nvml_context_bytes": None}
    return {"nvml_context_bytes": used - torch.cuda.memory_reserved()}


def loop_point(record, precision: str, layout, batch: int, seq: int, device: str, local_rank: int,
               checkpointing: bool = False) -> dict:
    """The standard step on the sharded model, three times (the loop client's steps); never raises."""
    import gc

    import torch
    import torch.distributed as dist

    from pipeline.core.text import first_line
    from pipeline.measure.clients.loop import run_steps
    from pipeline.measure.clients.tracking import PhaseTracker, reserved_by_stream
    from pipeline.measure.nvml import nvml_columns
    from pipeline.measure.point import is_out_of_memory
    from pipeline.training.step import Setting

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo", device_id=local_rank if device == "cuda" else None)
    tracker = PhaseTracker(device)
    columns = {"status": "ok", "reason": None, "started_at": time.time(),
               "allocated_before_bytes": torch.cuda.memory_allocated() if device == "cuda" else None}
    model = module = None
    try:
        model, module = build_sharded(record, precision, layout, device, local_rank)
        columns["weights_bytes"] = torch.cuda.memory_allocated() if device == "cuda" else None
        columns.update(context_columns(device) if device == "cuda" else {})
        seconds, state = run_steps(model, Setting(gradient_checkpointing=checkpointing), precision, batch, seq, device,
                                   tracker, use_cache=False, module=module)
        median = sorted(seconds)[len(seconds) // 2]
        columns.update(tracker.columns(), step_seconds=median, steps=len(seconds), optimizer_state_bytes=state,
                       tokens_per_second=batch * seq / median if median > 0 else None, **nvml_columns(device))
        if device == "cuda":
            columns.update(nvml_train_end_bytes=columns["nvml_used_bytes"],
                           reserved_train_end_bytes=torch.cuda.memory_reserved(), reserved_by_stream=reserved_by_stream())
    except Exception as exc:  # noqa: BLE001 - a failing point is a row
        oom = is_out_of_memory(exc)
        where = f" in {tracker.current}" if tracker.current else ""
        columns.update(status="oom" if oom else "error",
                       reason=f"{'out of memory' if oom else 'failed'}{where}: {first_line(exc)}")
    del model, module
    gc.collect()
    columns["finished_at"] = time.time()
    return columns


def build_sharded(record, precision: str, layout, device: str, local_rank: int):
    """(model, the module to call): DDP on the GPU; FSDP2, HSDP and tensor parallelism from the meta device (given
    storage on the GPU once sharded); peaks reset after."""
    import torch

    from pipeline.inputs.modeling import build
    from pipeline.training.sharding import shard

    config = record.transformers_config()
    target = torch.device(device, local_rank) if device == "cuda" else torch.device("cpu")
    if layout.sharding == "ddp":
        model = build(config, precision, "default", device=str(target))
        module = shard(model, layout, device_ids=[local_rank] if device == "cuda" else None)
    else:
        model = build(config, precision, "default", device="meta")
        module = shard(model, layout, layout.mesh(device), precision=precision)
        model.to_empty(device=target)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    return model, module


def write_row(row: dict, folder) -> None:
    path = Path(folder) / f"rank{row['rank']}.json"
    path.write_text(json.dumps(row, default=str))
