"""N ranks in one process, and the model sharded the way the GPUs shard it.

`fake_world(N)`: torch's fake process group (`torch.testing._internal.distributed.fake_pg`,
backend "fake"), rank 0 of N: every collective returns at once without touching data, so one
process runs rank 0's side of the real DDP / FSDP2 code. This is how
torch.distributed._tools.fsdp2_mem_tracker and torchtitan's memory estimation run a sharded step
without the other ranks.

`meta_fsdp()`: FSDP2 on meta parameters. FSDP2 takes its device from the mesh and its streams and
events from that device's module (`torch.cuda`, `torch.cpu`); a "meta" device has no such module,
and FSDP2 refuses to train meta parameters. The mesh stays a CPU mesh (the fake process group
serves it); while the model is sharded and trained, FSDP2 is told that its device is "meta" (so
its buffers are meta tensors, made by its own code and its registered meta kernels) and given
`torch.cpu`'s stream stubs, and its check for meta parameters is skipped. Nothing else of FSDP2
changes: which buffers exist, their sizes and when they are freed are torch's. The alternative,
FakeTensorMode over a CPU mesh, would leave the simulator's meta-device machinery (answered
`.item()`, the output cache, CUDA's kernel rules) behind.

The model is sharded by `pipeline.training.sharding.shard`, the call the GPU measurement makes.
"""

from __future__ import annotations

import contextlib

from pipeline.core.errors import UserError
from pipeline.core.patches import attributes_set


@contextlib.contextmanager
def fake_world(num_gpus: int):
    """The default process group: rank 0 of `num_gpus` on the fake backend; yields a CPU mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError("the sharded simulation needs a process without a process group of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=num_gpus)
    try:
        yield init_device_mesh("cpu", (num_gpus,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def meta_fsdp():
    """FSDP2 with its device "meta" (see the module docstring); undone on exit."""
    import torch
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    import torch.distributed.fsdp._fully_shard._fsdp_state as state
    import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard_module

    original_handle = param_group._get_device_handle

    def device_handle(device_type: str):
        return torch.cpu if device_type == "meta" else original_handle(device_type)

    patches = [(module, "_get_device_handle", device_handle) for module in (collectives, param_group, state)]
    patches.append((fully_shard_module, "_get_device_from_mesh", lambda mesh: torch.device("meta")))
    patches.append((param_group.FSDPParamGroup, "_validate_no_meta_params", lambda self: None))
    with attributes_set(patches):
        yield
