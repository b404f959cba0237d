"""The standard training step of one rank under DDP or FSDP2, run under the live-byte tracker.

The model is sharded by torch's own code (`pipeline.training.sharding.shard`) and the loop is the standard
one (`pipeline.training.step`): AdamW (foreach, CUDA's default) over the module's parameters (the sharded
DTensors under FSDP2), `loss = model(input_ids=ids, labels=ids).loss; loss.backward(); opt.step();
opt.zero_grad(set_to_none=True)`, three times. The three steps are all run (not one step and the
optimizer state added, as the single-GPU simulator does): DDP rebuilds its buckets in the second
forward, and FSDP2 keeps communication state from one step into the next.

Roles at the peak: `parameters` (this rank's shards, and buffers), `unsharded_parameters` (layers
all-gathered and not yet resharded), `all_gather` (FSDP2's all-gather outputs, before the copy-out
and kept one layer on, as FSDP2 keeps them), `reduce_scatter` (the gradient reduce-scatter inputs),
`ddp_buckets`, `gradients`, `optimizer_state`, `optimizer_intermediates`, `activations`.

The same function runs the meta simulation (fake process group, `device_type="meta"`) and the CPU
check's real multi-process run (gloo, `device_type="cpu"`), so both count the same way.
"""

from __future__ import annotations

import contextlib

from pipeline.simulate.memory.allocator import CachingAllocator, ExpandableSegments, Fanout
from pipeline.training.step import (STEPS, Setting, autocast_dtype, make_optimizer, set_training_mode, token_ids,
                                    training_loss, zero_grad)

PHASES = ("forward", "backward", "optimizer")


def simulate_sharded_step(model, run, mesh, device_type: str = "meta", cuda_rules: bool = True,
                          steps: int = STEPS) -> dict:
    """Rank 0's live bytes over `steps` standard steps of `run` (a `training.values.Run` of the loop: its batch
    and sequence per GPU, precision, optimizer, checkpointing and layout) on `model` (unsharded, on
    `device_type`), sharded over `mesh`. Returns peak_bytes, components (by role at the peak), peak_phase,
    phase_peaks, peak_reserved_bytes, peak_reserved_expandable_bytes."""
    import torch

    from pipeline.simulate.distributed.tracker import ShardedTracker, host_copy_stand_ins
    from pipeline.training.sharding import shard
    from pipeline.simulate.kernels.cuda import CUBLAS_WORKSPACES, host_outputs, workspace_rules
    from pipeline.simulate.kernels.rules import KernelRules
    from pipeline.simulate.values.stand_ins import UniformValues, scalar_stand_ins

    layout, precision, batch_size, seq_len = run.layout, run.precision, run.batch, run.seq
    setting = Setting("standard", run.optimizer, run.checkpointing)
    setting.check()
    meta = device_type == "meta"
    rules = KernelRules(device_type, sdpa=cuda_rules)
    reserved = Fanout([CachingAllocator(run.reserve_limit), ExpandableSegments(run.reserve_limit)])
    observer = UniformValues() if meta else None
    tracker = ShardedTracker(device_type, workspace_rules() if cuda_rules else None,
                             {**scalar_stand_ins(), **host_copy_stand_ins()} if meta else None, observer,
                             CachingAllocator(), host_outputs() if cuda_rules else None, reserved)
    if meta:  # FSDP2's side streams keep pools of their own (a real CPU run has one stream)
        from pipeline.simulate.distributed.world import stream_name

        tracker.stream = stream_name
    set_training_mode(model, setting)
    if run.checkpointing:
        rules.wrap_checkpointing(model)
    amp_dtype = autocast_dtype(precision)
    amp = (lambda: rules.autocast(amp_dtype)) if amp_dtype is not None else contextlib.nullcontext
    fake = _fake_group()
    if layout.sharding != "ddp":  # sharded before the peak counter starts, as the GPU run does
        module = shard(model, layout, mesh, precision=precision)
        if layout.tensor_parallel > 1:  # a tensor-parallel shard is a view of its full weight until given storage
            model.to_empty(device=device_type)
    with rules, tracker, roles(tracker):
        for tensor in list(model.parameters()) + list(model.buffers()):
            tracker.track(tensor, "parameters")
        if layout.sharding == "ddp":
            with tracker.scope("ddp_buckets"):
                module = shard(model, layout, mesh, fake=fake)
            module._pre_forward = tracker.scoped(module._pre_forward, "ddp_buckets")  # rebuilds the buckets
        workspaces = [torch.empty(size, dtype=torch.uint8, device=device_type) for size in CUBLAS_WORKSPACES]
        for workspace in workspaces if cuda_rules else ():
            tracker.track(workspace, "activations")
        params = list(module.parameters())
        opt = make_optimizer(params, setting, foreach=True)  # CUDA's default; meta tensors have none
        for step in range(steps):
            tracker.start_phase("forward", "activations")
            tracker.observer = observer
            ids = token_ids(model, batch_size, seq_len, setting, device_type)
            with amp():
                loss = training_loss(module, ids, setting)
            tracker.observer = None  # data-dependent questions are asked in the forward only
            tracker.start_phase("backward", "activations")
            loss.backward()
            for param in params:
                if param.grad is not None:
                    tracker.retag(param.grad, "gradients")
            tracker.start_phase("optimizer", "optimizer_intermediates")
            opt.step()
            for value in optimizer_state(opt):
                tracker.retag(value, "optimizer_state")
            zero_grad(opt, setting)
            tracker.phase = None
    return summarise(tracker, reserved)


@contextlib.contextmanager
def roles(tracker):
    """FSDP2's collectives, with what they allocate counted under their roles (see the module docstring)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    wrapped = {"foreach_all_gather": "all_gather", "foreach_all_gather_copy_out": "unsharded_parameters",
               "foreach_reduce": "reduce_scatter"}
    saved = {name: getattr(param_group, name) for name in wrapped}
    for name, role in wrapped.items():
        setattr(param_group, name, tracker.scoped(saved[name], role))
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(param_group, name, function)


def _fake_group() -> bool:
    import torch.distributed as dist

    return dist.get_backend() == "fake"


def optimizer_state(opt) -> list:
    import torch

    return [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]


def summarise(tracker, reserved) -> dict:
    phase_peaks = {phase: tracker.peaks[phase].total for phase in PHASES}
    top = max(PHASES, key=lambda p: phase_peaks[p])
    phase_components = {phase: dict(tracker.peaks[phase].parts) for phase in PHASES}
    return {"peak_bytes": phase_peaks[top], "components": phase_components[top], "peak_phase": top,
            "phase_peaks": phase_peaks, "phase_components": phase_components, "peak_reserved_bytes": reserved.allocators[0].peak,
            "peak_reserved_expandable_bytes": reserved.allocators[1].peak}
