"""The CPU check of the sharded simulation: a real multi-process run on the CPU.

`run_cpu_check` starts N processes (torch.multiprocessing, the gloo backend), each builds the
model with random weights on the CPU, shards it (`pipeline.training.sharding.shard`, the same call as the
simulation) and runs the standard step three times under the same live-byte tracker as the
simulator, in `device_type="cpu"` mode (`step.simulate_sharded_step`). Rank 0's
result is returned; the simulation (`predict_distributed_peak`, one process, fake process
group, meta tensors) must reproduce it byte for byte.

Gloo runs each collective on a worker thread, which drops its reference to the tensors a moment
after the caller has been told that the collective is done: FSDP2's all-gather outputs were then
at times freed by that thread, after the caller had let them go, and the peaks varied from run to
run. The check runs FSDP2's two collectives (`all_gather_single`, `reduce_scatter_single`) on
copies made outside the tracker (`detached_collectives`), so that the buffers live exactly as long
as FSDP2's code keeps them, as on rank 0 of the fake process group. Tensor parallelism's functional
collectives (DTensor's all-reduce, all-gather and reduce-scatter) are ops: a dispatch mode below the
tracker runs them on untracked copies and hands the tracker a fresh output, for the same reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from pathlib import Path


def run_cpu_check(config: dict, num_gpus: int, shardings=("ddp", "fsdp"), batch_size: int = 2, seq_len: int = 24,
                  precision: str = "fp32", attn_implementation: str = "eager",
                  gradient_checkpointing: bool = False) -> dict:
    """Rank 0's result of `simulate_sharded_step` on the CPU, per sharding (a name, or a `Layout` of `num_gpus`:
    hsdp, tensor parallelism): {str(sharding): result}.

    `config`: a config.json dict (a small model: the weights are real). One spawn of `num_gpus`
    processes runs every sharding in turn, each on a freshly built model."""
    import torch.multiprocessing as mp

    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build

    build(config_from_dict(config), precision, attn_implementation, device="meta")  # the config checked first
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "rank0.json"
        args = (num_gpus, _free_port(), config, list(shardings), batch_size, seq_len, precision,
                attn_implementation, gradient_checkpointing, str(out))
        # spawned, not forked: after a sharded simulation in this process (DTensor's or FSDP2's backward), torch
        # marks forks bad and a forked rank's autograd refuses to run
        mp.start_processes(_worker, args=args, nprocs=num_gpus, join=True, start_method="spawn")
        return json.loads(out.read_text())


@contextlib.contextmanager
def detached_collectives():
    """FSDP2's all-gather and reduce-scatter run on untracked copies (see the module docstring)."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import _disable_current_modes

    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def run(name, output, input, **kwargs):
        kwargs.pop("async_op", None)
        with _disable_current_modes():
            copy_out, copy_in = output.clone(), input.clone()
            originals[name](copy_out, copy_in, **kwargs)
            output.copy_(copy_out)

    dist.all_gather_single = lambda output_tensor, input_tensor, **kw: run(
        "all_gather_single", output_tensor, input_tensor, **kw)
    dist.reduce_scatter_single = lambda output, input, **kw: run("reduce_scatter_single", output, input, **kw)
    try:
        with detached_functional_collectives():
            yield
    finally:
        for name, function in originals.items():
            setattr(dist, name, function)


def detached_functional_collectives():
    """A dispatch mode, entered before the tracker (so below it): each functional collective runs on copies of
    its inputs and is waited for; the tracker sees a fresh copy of its output, which gloo's thread never held."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    functional = torch.ops._c10d_functional

    def copies(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return [tensor.clone() for tensor in value]
        return value

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace != "_c10d_functional" or func.overloadpacket is functional.wait_tensor:
                return func(*args, **kwargs)
            result = func(copies(args[0]), *args[1:], **kwargs)
            outputs = result if isinstance(result, (list, tuple)) else [result]
            for output in outputs:
                functional.wait_tensor(output)
            fresh = [output.clone() for output in outputs]
            return fresh if isinstance(result, (list, tuple)) else fresh[0]

    return Mode()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, config: dict, shardings: list, batch_size: int, seq_len: int,
            precision: str, attn_implementation: str, gradient_checkpointing: bool, out: str) -> None:
    import torch
    import torch.distributed as dist

    from pipeline.inputs.configs import config_from_dict
    from pipeline.inputs.modeling import build
    from pipeline.simulate.distributed.step import simulate_sharded_step
    from pipeline.training.values import Run

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results = {}
        for sharding in shardings:
            layout = layout_of(sharding, world_size)
            run = Run(batch_size, seq_len, precision, checkpointing=gradient_checkpointing, **layout.columns())
            torch.manual_seed(0)
            model = build(config_from_dict(config), precision, attn_implementation, device="cpu")
            with detached_collectives():
                results[str(sharding)] = simulate_sharded_step(model, run, layout.mesh("cpu"), device_type="cpu")
            dist.barrier()
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def layout_of(sharding, num_gpus: int):
    """A sharding's name on `num_gpus` GPUs, or a `training.layout.Layout` as it is."""
    from pipeline.training.layout import Layout

    return sharding if isinstance(sharding, Layout) else Layout(num_gpus, sharding)
