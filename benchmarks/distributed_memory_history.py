"""Where the bytes of a several-GPU step are, per rank: CUDA's memory history of the standard step under
DDP or FSDP2, read at each rank's peak (what is live there, by the Python frame that made it) and the
allocator's segments by stream at the end. Run under torchrun on the GPU machine:

    torchrun --nproc-per-node 2 benchmarks/distributed_memory_history.py --model Qwen/Qwen2.5-1.5B \
        --sharding ddp --batch 4 --seq 2048 --out OUT_DIR

Each rank writes OUT_DIR/history-<sharding>-rank<r>.json: the step's peak allocated bytes (the counter's and
the history's), the live bytes at the history's peak grouped by allocation site (the innermost frames in
torch, transformers or the project), the reserved bytes by stream, and NVML's view of the process before and
after the first collective (the memory NCCL takes outside PyTorch).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path


def site(frames: list) -> str:
    """The allocation's place: the innermost three frames outside the allocator and this script."""
    kept = [f for f in frames if f.get("filename", "").endswith(".py") and "memory_history" not in f["filename"]
            and "/torch/cuda/memory.py" not in f["filename"]]
    return " <- ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in kept[:3]) or "(no python frame)"


def live_at_peak(trace: list) -> tuple[int, dict]:
    """(peak live bytes, {site: bytes live at that peak}) from one device's allocation trace."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for event in trace:
        action, address, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[address] = (size, site(event.get("frames", [])))
            total += size
            if total > peak:
                peak = total
                at_peak = dict(live)
        elif action in ("free_requested",) and address in live:
            total -= live.pop(address)[0]
    grouped = defaultdict(int)
    for size, where in at_peak.values():
        grouped[where] += size
    return peak, dict(sorted(grouped.items(), key=lambda item: -item[1])[:25])


def main() -> None:
    import torch
    import torch.distributed as dist

    from pipeline.inputs.records import model_record
    from pipeline.measure.clients.loop import run_steps
    from pipeline.measure.clients.tracking import PhaseTracker, reserved_by_stream
    from pipeline.measure.distributed.rank import build_sharded
    from pipeline.measure.nvml import nvml_columns
    from pipeline.training.step import Setting

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--sharding", default="ddp")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    torch.set_float32_matmul_precision("high")
    torch.manual_seed(0)
    before = nvml_columns("cuda")["nvml_used_bytes"]
    dist.init_process_group("nccl", device_id=local_rank)
    dist.barrier()
    after_init = nvml_columns("cuda")["nvml_used_bytes"]
    record = model_record(args.model, None, "results/configs.json")
    model, module = build_sharded(record, args.precision, args.sharding, "cuda", local_rank)
    after_build = nvml_columns("cuda")["nvml_used_bytes"]
    reserved_after_build = torch.cuda.memory_reserved()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    tracker = PhaseTracker("cuda")
    run_steps(model, Setting(), args.precision, args.batch, args.seq, "cuda", tracker, use_cache=False,
              module=module, steps=1)
    first = tracker.columns()["peak_allocated_bytes"]
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    history_peak, sites = live_at_peak(trace)
    tracker = PhaseTracker("cuda")
    run_steps(model, Setting(), args.precision, args.batch, args.seq, "cuda", tracker, use_cache=False,
              module=module, steps=2)
    rank = dist.get_rank()
    result = {"rank": rank, "world": dist.get_world_size(), "model": args.model, "sharding": args.sharding,
              "batch": args.batch, "seq": args.seq, "first_step_peak_bytes": first,
              "later_steps_peak_bytes": tracker.columns()["peak_allocated_bytes"],
              "history_peak_live_bytes": history_peak, "live_at_peak_by_site": sites,
              "reserved_by_stream": reserved_by_stream(), "max_reserved_bytes": torch.cuda.max_memory_reserved(),
              "nvml_before_init": before, "nvml_after_init": after_init, "nvml_after_build": after_build,
              "reserved_after_build": reserved_after_build, "nvml_end": nvml_columns("cuda")["nvml_used_bytes"],
              "reserved_end": torch.cuda.memory_reserved(), "trace_events": len(trace)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"history-{args.sharding}-n{dist.get_world_size()}-rank{rank}.json"
    path.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
