"""A model sharded the way several GPUs shard it, the one call that the GPU measurement
(`pipeline.measure.distributed`) and the simulator (`pipeline.simulate.distributed.step`) make.

`shard(model, layout, mesh)` (`training.layout.Layout`): tensor parallelism first (transformers' own DTensor
plan for the model, `apply_tensor_parallelism` over the mesh's "tp" dimension: what `from_pretrained(...,
tp_plan="auto")` applies), then the data-parallel sharding: `fully_shard` on each decoder layer
(`inputs.modeling.decoder_layers`: transformers' `_no_split_modules` classes) and on the root over the
data-parallel mesh, `reshard_after_forward` true (`fsdp`, `hsdp`: a 2-D mesh of replicas x shards) or false
(`fsdp-no-reshard`); or `DistributedDataParallel` with its defaults (`ddp`).

`sharding_arguments(sharding, model)`: the keys of TrainingArguments (SFTConfig, DPOConfig) with which the
Trainer clients run that sharding under `torchrun --nproc_per_node N`: none for DDP (what the Trainer does with
several processes), FSDP2 through accelerate's plugin for fsdp and fsdp-no-reshard, DeepSpeed's ZeRO through
the `deepspeed` key for zero1-3 (`training.zero`).
"""

from __future__ import annotations

import contextlib

from pipeline.core.errors import UserError
from pipeline.inputs.modeling import decoder_layers


def shard(model, layout, mesh=None, device_ids=None, fake: bool = False, precision: str | None = None):
    """`model` under `layout` over `mesh` (see the module docstring); returns the module to call. `fake`: the
    process group is the fake one (DDP then gets `fake_allreduce_hook`). `precision` mp-bf16: FSDP2's
    MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)."""
    if layout.tensor_parallel > 1:
        tensor_parallel(model, mesh["tp"])
    if layout.sharding == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        with shapes_unverified():
            module = DistributedDataParallel(model, device_ids=device_ids)
        if fake:
            module.register_comm_hook(None, fake_allreduce_hook)
        return module
    if layout.sharding is None:
        return model
    from torch.distributed.fsdp import fully_shard

    data_mesh = layout.data_mesh(mesh) if mesh is not None else None
    options = {"mesh": data_mesh, "reshard_after_forward": layout.sharding != "fsdp-no-reshard",
               **mixed_precision(precision)}
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules)")
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def mixed_precision(precision: str | None) -> dict:
    """fully_shard's mp_policy of a precision that names one (mp-bf16), else nothing."""
    from pipeline.core.vocabulary import precision_mode

    if precision is None or not precision_mode(precision).gathered:
        return {}
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def tensor_parallel(model, tp_mesh) -> None:
    """transformers' tensor parallelism of `model` over `tp_mesh`: its plan's weights as DTensor shards, its
    modules' input and output hooks."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    if not getattr(model, "tp_plan", None):
        raise UserError(f"{type(model).__name__} declares no tensor-parallel plan (base_model_tp_plan): "
                        "tensor_parallel needs one")
    size = tp_mesh.size()
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, name, None)
        if isinstance(heads, int) and heads % size:
            raise UserError(f"tensor_parallel {size} does not divide the model's {heads} {name.replace('_', ' ')[4:]} "
                            "(each rank computes whole heads)")
    apply_tensor_parallelism(model, tp_mesh)


@contextlib.contextmanager
def shapes_unverified():
    """DDP's check that all ranks hold the same shapes reads an all-gathered tensor's values, which meta tensors
    have not; it is skipped in the simulation and in the CPU check's real run alike, so that they allocate alike
    (it allocates a few int64 per parameter and frees them at once)."""
    import torch.nn.parallel.distributed as ddp

    verify = ddp._verify_param_shape_across_processes
    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ddp._verify_param_shape_across_processes = verify


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


def sharding_arguments(setting, model) -> dict:
    """TrainingArguments' keys for the sharding of `setting` (a `training.step.Setting`; see the module docstring):
    `fsdp=True` and an `fsdp_config` of FSDP2 (`version` 2) wrapping the model's decoder layer classes, resharded
    after forward (fsdp) or not (fsdp-no-reshard); `deepspeed` (its config, a fresh dict: the Trainer fills its
    "auto" values in place) for zero1-3; nothing for one GPU or DDP."""
    sharding = setting.sharding
    if sharding in (None, "ddp"):
        return {}
    if setting.deepspeed is not None:
        import json

        return {"deepspeed": json.loads(setting.deepspeed)}
    classes = sorted({type(layer).__name__ for layer in decoder_layers(model)})
    if not classes:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules)")
    return {"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": sharding == "fsdp",
                                          "transformer_layer_cls_to_wrap": classes}}
