"""The standard training step (`pipeline.training.step`) run under the live-byte tracker and CUDA's rules.

The loop is the standard step of docs/definitions.md (`pipeline.training.step`, as `pipeline.measure.point` runs it): a peak per phase (forward, backward, optimizer),
the maximum over three steps. Steps 2 and 3 are alike: they differ from step 1 by the optimizer
state that exists from step 1 on (and the previous step's loss). So one forward and backward is
run, then two optimizer steps: forward and backward peaks of step 2 are those of step 1 plus the
state; the optimizer peak is the larger of the two optimizer steps.

amp-fp16 runs the loop's gradient scaler (`scaler.scale(loss).backward(); scaler.step(opt);
scaler.update()`), the real `torch.amp.GradScaler` on the step's device (`pipeline.simulate.kernels.scaler`).

Reserved bytes (the allocator's segments) are replayed apart, with the default allocator settings and
with expandable segments; for steps 2 and 3 the first step's requests are replayed from the state
that step 1 left (`allocator.later_steps_reserved`), since the segments stay cached between steps.
"""

from __future__ import annotations

import contextlib

from pipeline.simulate.memory.allocator import allocated_bytes, later_steps_reserved
from pipeline.simulate.kernels.scaler import scaler_tensors
from pipeline.training.step import (Setting, autocast_dtype, grad_scaler, make_optimizer, set_training_mode, token_ids,
                                    trainable, training_loss, zero_grad)

PHASES = ("forward", "backward", "optimizer")


def simulate_training_step(model, batch_size: int, seq_len: int, precision: str = "fp32", optimizer: str = "adamw",
                           gradient_checkpointing: bool = False, variant: str = "standard",
                           device_type: str = "meta", cuda_rules: bool = True, blocks: bool = True,
                           reserve_limit: int | None = None, warm: bool = True, trace=None) -> dict:
    """Run the training step of `model` (on `device_type`) under the live-byte tracker (a
    `pipeline.simulate.trace.Trace` whose phases and roles this step marks itself).

    `device_type="cpu"` with real weights runs the same step for real (the tests compare both).
    `cuda_rules=False` leaves SDPA to the device's own choice. `blocks=False` counts requests
    rounded to 512 bytes instead of the caching allocator's blocks. `warm=False`: the process's first
    step, cuBLAS's workspaces made at their first use (`kernels.CublasWorkspaces`). `trace`: a Trace
    that recorded the model's build (`Trace.record`), instead of one made here (then the arguments
    above that it has are its own).
    """

    from pipeline.simulate.trace import Trace

    setting = Setting(variant, optimizer, gradient_checkpointing)
    if trace is None:
        trace = Trace(device_type, reserve_limit=reserve_limit, warm=warm, cuda_rules=cuda_rules, blocks=blocks,
                      automatic=False)
    rules, tracker, reserved = trace.rules, trace.tracker, trace.reserved
    set_training_mode(model, setting)
    if gradient_checkpointing:
        rules.wrap_checkpointing(model)
    params = list(model.parameters())
    trace.watch(model)
    opt = make_optimizer(trainable(params), setting, foreach=True)  # CUDA's default; meta tensors have none
    saved = SavedTensors(params)
    amp_dtype = autocast_dtype(precision)
    amp = rules.autocast(amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
    scaler = grad_scaler(precision, device_type)
    try:
        with trace:
            reserved.record()
            tracker.start_phase("forward", "activations")
            ids = token_ids(model, batch_size, seq_len, setting, device_type)
            with saved.hooks(), amp:
                loss = training_loss(model, ids, setting)
            saved_bytes = saved.bytes()
            tracker.observer = None  # data-dependent questions are asked in the forward only
            forward = reserved.stop()
            reserved.record()
            tracker.start_phase("backward", "activations")
            (loss if scaler is None else scaler.scale(loss)).backward()
            backward = reserved.stop()
            tracker.start_phase("optimizer", "optimizer_intermediates")
            optimizer_step(opt, scaler)
            state = optimizer_state(opt, device_type)
            for tensor in state:
                tracker.retag(tensor, "optimizer_state")
            step1 = tracker.peaks.pop("optimizer")
            tracker.start_phase("optimizer", "optimizer_intermediates")
            reserved.record()
            optimizer_step(opt, scaler)
            zero_grad(opt, setting)
            optimizer_trace = reserved.stop()
            tracker.phase = None
    finally:
        model.zero_grad(set_to_none=True)
    state_bytes = tracker.bytes_of(state)
    state_raw_bytes = sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in state
                           if tracker.bytes_of([t])}.values())  # not AdamW's step counters (host scalars)
    loss_bytes = allocated_bytes(loss.untyped_storage().nbytes()) if loss.device.type == device_type else 0
    # the previous step's loss and the scaler's tensors (made in step 1's backward) are alive in the
    # forward of steps 2 and 3; so are cuBLAS's workspaces that step 1 made after a phase's peak
    carried = loss_bytes + tracker.bytes_of(scaler_tensors(scaler))
    late = {phase: tracker.bytes_of([workspace for workspace in trace.workspace_tensors()
                                     if tracker.created(workspace) > tracker.peaks[phase].seq])
            for phase in ("forward", "backward")}
    result = summarise(tracker.peaks, step1, state_bytes, carried, saved_bytes, late)
    result["optimizer_state_bytes"] = state_raw_bytes  # as pipeline.measure.point reports it: storage bytes
    ids_at, loss_at = tracker.address_of(ids), tracker.address_of(loss)
    forward = once_made(forward, tracker, trace.workspace_tensors("forward"))
    backward = once_made(backward, tracker, scaler_tensors(scaler) + trace.workspace_tensors("backward"))
    result["peak_reserved_bytes"], result["peak_reserved_expandable_bytes"] = (
        later_steps_reserved(allocator, *traces, ids_at and ids_at[i], loss_at and loss_at[i])
        for i, (allocator, *traces) in enumerate(zip(reserved.allocators, forward, backward, optimizer_trace)))
    result["reserve_limit_exceeded"] = reserved.allocators[0].out_of_memory
    return result


def optimizer_step(opt, scaler) -> None:
    """The optimizer step, through the gradient scaler in amp-fp16 (pipeline.measure.clients.loop's)."""
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()


def once_made(traces: list, tracker, tensors: list) -> list:
    """Each allocator's trace of a phase of step 1 less the allocations of `tensors` (made in that phase
    once and kept: the scaler's, cuBLAS's workspaces of a first step)."""
    once = [at for at in (tracker.address_of(t) for t in tensors) if at]
    return [without_first_allocations(events, [at[i] for at in once]) for i, events in enumerate(traces)]


def without_first_allocations(trace: list, addresses: list) -> list:
    """`trace` less the allocations of blocks that the first step makes once and keeps (the
    scaler's scale and growth tracker, made by the first `scale()`): later steps do not repeat them."""
    drop = {max((i for i, (at, nbytes) in enumerate(trace) if at == address and nbytes is not None), default=None)
            for address in addresses}
    return [event for i, event in enumerate(trace) if i not in drop]


def summarise(peaks, optimizer_step1, state_bytes, carried_bytes, saved_bytes, late: dict | None = None) -> dict:
    """Phase peaks over the three steps, and the components at the overall peak (`carried_bytes`:
    alive in the forward of later steps besides the optimizer state; `late`: bytes by phase that step 1
    made after that phase's peak and kept, alive in that phase of later steps)."""
    late = late or {}
    later = {"forward": state_bytes + carried_bytes + late.get("forward", 0),
             "backward": state_bytes + late.get("backward", 0), "optimizer": 0}
    if optimizer_step1.total > peaks["optimizer"].total:
        peaks["optimizer"] = optimizer_step1
    phase_peaks, parts = {}, {}
    for phase in PHASES:
        snap = peaks[phase]
        phase_peaks[phase] = snap.total + later[phase]
        parts[phase] = dict(snap.parts)
        parts[phase]["optimizer_state"] += state_bytes if later[phase] else 0
        parts[phase]["activations"] += later[phase] - (state_bytes if later[phase] else 0)
    top = max(PHASES, key=lambda p: phase_peaks[p])
    return {"peak_bytes": phase_peaks[top], "components": parts[top], "peak_phase": top,
            "phase_peaks": phase_peaks, "saved_bytes": saved_bytes, "optimizer_state_bytes": state_bytes}


class SavedTensors:
    """Distinct storages that autograd saves during the forward (parameters excluded), raw bytes."""

    def __init__(self, params):
        self.params = {id(p.untyped_storage()) for p in params}
        self.storages = {}

    def pack(self, tensor):
        storage = tensor.untyped_storage()
        if id(storage) not in self.params:
            self.storages[id(storage)] = storage.nbytes()
        return tensor

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    def bytes(self) -> int:
        return sum(self.storages.values())


def optimizer_state(opt, device_type: str) -> list:
    import torch

    return [v for state in opt.state.values() for v in state.values()
            if torch.is_tensor(v) and v.device.type == device_type]
