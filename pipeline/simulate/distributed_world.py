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

`shard(model, sharding, mesh)`: `fully_shard` on each decoder layer (transformers'
`_no_split_modules` classes) and on the root, `reshard_after_forward` true (`fsdp`) or false
(`fsdp-no-reshard`); or `DistributedDataParallel` with its defaults (`ddp`). The same function
shards the CPU check's real multi-process run.
"""

from __future__ import annotations

import contextlib

from pipeline.errors import UserError



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
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def decoder_layers(model) -> list:
    """The model's decoder layers: instances of its `_no_split_modules` classes (the modules that
    transformers keeps whole on one device), outermost only."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers, inside = [], set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if type(module).__name__ in names:
            layers.append(module)
            inside.update(id(m) for m in module.modules())
    return layers


def shard(model, sharding: str, mesh=None, device_ids=None, fake: bool = False):
    """`model` under `sharding` (see the module docstring); returns the module to call. `fake`:
    the process group is the fake one (DDP then gets `fake_allreduce_hook`)."""
    if sharding == "ddp":
        import torch.nn.parallel.distributed as ddp

        # DDP's check that all ranks hold the same shapes reads an all-gathered tensor's values,
        # which meta tensors have not; it is skipped in both runs (the real CPU check's too), so
        # that they allocate alike. It allocates a few int64 per parameter and frees them at once.
        verify = ddp._verify_param_shape_across_processes
        ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
        try:
            module = ddp.DistributedDataParallel(model, device_ids=device_ids)
        finally:
            ddp._verify_param_shape_across_processes = verify
        if fake:
            module.register_comm_hook(None, fake_allreduce_hook)
        return module
    from torch.distributed.fsdp import fully_shard

    reshard = sharding == "fsdp"
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules)")
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def fake_allreduce_hook(state, bucket):
    """DDP's default bucket all-reduce for the fake process group, whose futures hold no value: the
    same in-place all-reduce of the bucket, answered with the bucket. The default divides the
    gradients by N while copying them into the bucket (`mul_out`), this hook copies them: neither
    allocates."""
    import torch
    import torch.distributed as dist

    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future
