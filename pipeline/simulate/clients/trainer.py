"""`trainer_peak`: the peak memory of `client = trainer` (docs/definitions.md, "Training
settings beyond the standard step"; the GPU run is `pipeline.measure.clients.trainer`) on meta tensors.

The real transformers.Trainer and accelerate code runs under the live-byte tracker and CUDA's
kernel rules, as `pipeline.simulate.step` runs the standard step: `Trainer.create_optimizer`
(the `optim` name resolved by transformers), accelerate's `prepare_model` (its autocast wrapper of
the forward and `convert_outputs_to_fp32`) and `prepare_optimizer` (`AcceleratedOptimizer`, which
steps through the GradScaler in amp-fp16), `Trainer.training_step` (`compute_loss` with
`num_items_in_batch`, `accelerator.backward`: `scaler.scale(loss).backward()` in amp-fp16),
`Trainer._clip_grad_norm` (accelerate's `clip_grad_norm_`: the scaler's unscale, torch's foreach
norms), `optimizer.step`, the scheduler and `model.zero_grad`, in the order `Trainer._run_epoch`
calls them, for three optimizer steps of K micro-batches. The loop itself (`_inner_training_loop` /
`_run_epoch`: callbacks, logging, the dataloader) is re-stated here, not run: it holds nothing on
the device but the K micro-batches and the running loss, which are made here the same way.

What differs from a CUDA run, and is stood in for (`MetaRules`):
- the model stays on the meta device (`place_model_on_device` off, the accelerator built with
  `use_cpu=True` so that it never asks for a GPU), the micro-batches are moved to it;
- accelerate's autocast context is CUDA's (`KernelRules.autocast`, bf16 or fp16), not the CPU's
  that it picks; amp-fp16's scaler is the one accelerate makes on a GPU (`GradScaler("cuda")`,
  defaults) made on the simulated device (on a CPU accelerate makes none), and its `found_inf`
  reads "no inf" (`pipeline.simulate.kernels.scaler`);
- fused AdamW (`adamw_torch_fused`) refuses meta parameters in `_device_dtype_check_for_fused`:
  meta is added to the devices that check accepts, and the step runs torch's real `_fused_adam`
  path; `torch._fused_adamw_` is in place and allocates nothing (its meta kernel likewise), so the
  state (exp_avg, exp_avg_sq, and a 0-dim fp32 `step` on the device per parameter) is all.
- autograd's sum of two gradients for one tensor is in place where CUDA's engine steals the first
  (`pipeline.simulate.kernels.accumulation`; the dispatch mode alone made it out of place): a tied
  embedding under amp holds one V x H fp32 matrix less at the end of the backward;
- adamw_bnb_8bit: nothing. bitsandbytes' real `AdamW8bit` runs: its state is made with
  `torch.zeros_like`/`torch.zeros` on the parameter's device (uint8 moments, fp32 absmax per block
  of 256; fp32 moments for parameters under 4096 elements and for embeddings, which transformers'
  `create_optimizer` registers with optim_bits=32), its quantile maps are copied there, and
  its update `torch.ops.bitsandbytes.optimizer_update_{8bit_blockwise,32bit}` is in place, with
  fake kernels registered by bitsandbytes (`_ops.py`) that allocate nothing, as the CUDA kernels do.
- Liger's kernels (`run.liger_kernel`): `Trainer.train()` applies them first (`apply_liger_kernel`),
  here too, and everything they rebind is put back after the run (`pipeline.training.liger`); their
  Python wrappers run for real, their Triton launches are no-ops (`pipeline.simulate.kernels.paths`).
- data-dependent values of the micro-batches (label counts, Liger's `.item()` of them): every
  micro-batch tensor carries its host values (`pipeline.simulate.values.shadows`).
Data collation's pinned CPU memory is host memory: not counted.
"""

from __future__ import annotations

import contextlib
import time

from pipeline.core.vocabulary import OPTIMS, check_choice
from pipeline.simulate.predict import as_config, check_loop, estimate_of, run_model
from pipeline.training.step import STEPS, Setting, set_training_mode
from pipeline.training.values import Estimate, Run

PHASES = ("setup", "forward", "backward", "optimizer")


def trainer_peak(config, run: Run) -> Estimate:
    """`Trainer.train()` for three optimizer steps of `run.gradient_accumulation` micro-batches
    (client = trainer; `run.optim` by its transformers name; `run.liger_kernel`) of `config` on meta
    tensors, as `loop_peak` answers: the peak allocated and reserved (cuBLAS's workspaces made in the
    step, or by an earlier point of the process: `run.fresh_process`), components, and phase_peaks,
    peak_phase, optimizer_state_bytes, seconds in details.

    `run.adapter` (LoRA / QLoRA): the Trainer trains the PeftModel that the loop simulator builds
    (`predict.run_model`), built anew for each call, with its own PEFT handling;
    `trainable_parameters` is then in details too."""
    start = time.perf_counter()
    check_choice("optim", run.optim, OPTIMS)
    check_loop(run)
    check_installed(run.optim, run.liger_kernel)
    config = as_config(config)
    trace = trainer_trace("meta", run.reserve_limit, warm=not run.fresh_process)
    model = run_model(config, run, trace, anew=True)
    result = simulate_trainer(model, run.batch, run.seq, run.precision, run.optim, run.gradient_accumulation,
                              run.checkpointing, liger_kernel=run.liger_kernel, trace=trace, setting=run.setting)
    if run.adapter is not None:
        from pipeline.training.adapters import trainable_parameters

        result["trainable_parameters"] = trainable_parameters(model)
    return estimate_of(result, start)


def check_installed(optim: str, liger_kernel: bool = False) -> None:
    """The simulator runs the optimizer's and Liger's own code: their packages must be importable here."""
    import importlib.util

    from pipeline.core.errors import UserError

    if optim == "adamw_bnb_8bit" and importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("optim adamw_bnb_8bit needs bitsandbytes, which is not installed here (pip install bitsandbytes)")
    if liger_kernel:
        from pipeline.training.liger import liger_unavailable

        reason = liger_unavailable()
        if reason:
            raise UserError(f"{reason} (pip install liger-kernel)")


def simulate_trainer(model, batch_size: int, seq_len: int, precision: str, optim: str, gradient_accumulation: int,
                     gradient_checkpointing: bool, device_type: str = "meta", steps: int = STEPS,
                     prepared_before: bool = False, reserve_limit: int | None = None,
                     liger_kernel: bool = False, warm: bool = True, trace=None, setting=None) -> dict:
    """Run the Trainer's steps on `model` (on `device_type`) under the tracker; `device_type="cpu"`
    with real weights runs the same code for real (the tests compare both). `prepared_before`: the
    model was prepared by an earlier Trainer that left accelerate's mark on it (the GPU client did,
    before commit 57dc319, from the second point of a process on): no autocast wrapper."""
    from pipeline.simulate.clients.parts import meta_trainer
    from pipeline.simulate.crashes import refusals_are_crashes

    with refusals_are_crashes():
        trainer = meta_trainer(model, batch_size, precision, optim, gradient_accumulation, gradient_checkpointing,
                               device_type, liger_kernel, setting)
    run = TrainerRun(trainer, seq_len, precision, gradient_checkpointing, device_type)
    run.prepared_before = prepared_before
    return simulate_run(run, steps, reserve_limit, warm, trace)


def simulate_run(run: TrainerRun, steps: int | None = None, reserve_limit: int | None = None, warm: bool = True,
                 trace=None) -> dict:
    """A Trainer client's run (`TrainerRun` or a subclass) for `steps` optimizer steps (default the run's own,
    `TrainerRun.steps`) in a
    `pipeline.simulate.trace.Trace` (the live-byte tracker, CUDA's kernel rules, the allocator replay;
    `warm=False`: the process's first step, cuBLAS's workspaces made at first use) with the Triton
    wrappers' CUDA paths: the peak, its components, phase peaks, the optimizer state's bytes and the
    reserved bytes. `trace`: one made with `trainer_trace` that recorded the model's build."""
    from pipeline.simulate.crashes import refusals_are_crashes
    from pipeline.simulate.kernels.paths import cuda_paths

    device_type, model = run.device_type, run.model
    trace = trace if trace is not None else trainer_trace(device_type, reserve_limit, warm)
    rules, tracker, reserved, shadows = trace.rules, trace.tracker, trace.reserved, trace.observer
    set_training_mode(model, Setting())  # as the GPU client: checkpointing off, the Trainer switches it on
    for counted in run.models() if run.world is None else ():  # on several GPUs: once they are on the GPU
        trace.watch(counted)
    run.attach(rules, tracker)
    if run.liger:  # outside the tracker: its imports are no part of the step (pipeline.training.liger)
        from pipeline.training.liger import import_liger

        import_liger()
    try:
        with cuda_paths(rules, trl=run.fused_head, liger=run.liger), trace, fused_on(device_type), run.context():
            with refusals_are_crashes():
                run.setup()
            step_peaks = []
            for _ in range(run.steps if steps is None else steps):
                run.step()
                step_peaks.append(tracker.peaks["total"].total)
            tracker.phase = None
        state = run.optimizer_state()
    finally:
        run.close()
    peaks = tracker.peaks
    phase_peaks = {phase: peaks[phase].total for phase in run.phases if phase in peaks}
    top = max(phase_peaks, key=phase_peaks.get)
    components = dict(peaks[top].parts)
    result = {"peak_bytes": peaks["total"].total, "components": components, "peak_phase": top,
              "phase_peaks": phase_peaks, "step_peaks": step_peaks, "optimizer_state_bytes": state,
              "peak_reserved_bytes": reserved.allocators[0].peak,
              "reserve_limit_exceeded": reserved.allocators[0].out_of_memory,
              "peak_reserved_expandable_bytes": reserved.allocators[1].peak}
    if getattr(shadows, "unknown", None):
        result["values_answered_without_data"] = len(shadows.unknown)
    return result


def trainer_trace(device_type: str = "meta", reserve_limit: int | None = None, warm: bool = True, tracker_class=None,
                  more_stand_ins: dict | None = None, host_values: bool = False):
    """The Trace a Trainer client runs in: host shadows as its observer (on meta), the engine's in-place
    gradient accumulation, the CPU's `addmm(out_dtype=...)`; phases and roles marked by the run. On several
    GPUs the several-GPU wing's tracker (`tracker_class`) and stand-ins (`more_stand_ins`); `host_values`: small
    tensors made from host values carry them (`Shadows`)."""
    from pipeline.simulate.kernels.accumulation import accumulation_stand_ins
    from pipeline.simulate.kernels.paths import out_dtype_addmm_stand_ins
    from pipeline.simulate.values.shadows import Shadows, shadow_stand_ins
    from pipeline.simulate.trace import Trace

    shadows = Shadows(host_values) if device_type == "meta" else None
    stand_ins = shadow_stand_ins(shadows) if shadows is not None else {}
    stand_ins.update(accumulation_stand_ins())  # on a real CPU run too: it is the engine's rule, not the device's
    stand_ins.update(out_dtype_addmm_stand_ins())
    stand_ins.update(more_stand_ins or {})
    extra = {} if tracker_class is None else {"tracker_class": tracker_class}
    return Trace(device_type, reserve_limit=reserve_limit, warm=warm, automatic=False, stand_ins=stand_ins,
                 observer=shadows, **extra)


@contextlib.contextmanager
def fused_on(device_type: str):
    """torch's fused optimizers accept parameters of `device_type` (the check reads this list)."""
    from torch.optim import optimizer as optimizer_module

    original = optimizer_module._get_fused_kernels_supported_devices
    optimizer_module._get_fused_kernels_supported_devices = lambda: [*original(), device_type]
    try:
        yield
    finally:
        optimizer_module._get_fused_kernels_supported_devices = original


class TrainerRun:
    """One Trainer (made with `pipeline.simulate.clients.parts.meta_trainer`) on its model and the state of
    its loop (`Trainer._run_epoch`), step by step. A subclass changes where the micro-batches come from."""

    fused_head = False  # TRL's fused LM head (SFTTrainer)
    phases = PHASES
    steps = STEPS  # the optimizer steps a point runs

    def __init__(self, trainer, seq_len: int, precision: str, gradient_checkpointing: bool, device_type: str):
        self.trainer, self.model = trainer, trainer.model
        self.device_type, self.seq_len = device_type, seq_len
        self.batch_size = trainer.args.per_device_train_batch_size
        self.accumulation = trainer.args.gradient_accumulation_steps
        self.precision, self.checkpointing = precision, gradient_checkpointing
        self.liger = bool(trainer.args.use_liger_kernel)
        self.rules = self.tracker = None
        self.hooks = []
        self.batches = None
        self.tr_loss = None
        self.prepared_before = False
        self.liger_patches = None
        self.wrapped = None  # the model the steps call: DDP's wrapper, else the model
        self.world = None  # several GPUs: `pipeline.simulate.distributed.clients.World`

    def models(self) -> list:
        """The models on the device whose weights are parameters (the trained one; DPO's reference too)."""
        return [self.model]

    def attach(self, rules, tracker) -> None:
        """The phases of `tracker` follow the model's forward (the trace that `tracker` belongs to tags the
        gradients as they accumulate)."""
        model = self.model
        self.rules, self.tracker = rules, tracker
        self.hooks = [model.register_forward_pre_hook(lambda *_: tracker.start_phase("forward", "activations")),
                      model.register_forward_hook(lambda *_: tracker.start_phase("backward", "activations"))]

    def context(self):
        """What the run's steps run in besides the trace (a subclass's stand-ins)."""
        return contextlib.nullcontext()

    def setup(self) -> None:
        """The start of `Trainer.train()` (Liger's kernels), `_prepare_for_training` and the start of
        `_inner_training_loop` (on several GPUs in the world of `self.world`, which counts the models once they are
        on the GPU and resets the peak counters where training begins)."""
        import torch

        from pipeline.simulate.clients.parts import prepare_for_training

        self.tracker.start_phase("setup", "activations")
        # `_inner_training_loop` starts with `accelerator.free_memory()`: gc and torch.cuda.empty_cache(), which
        # gives back the segments of a process's first point that its build left free (a tied head's weight)
        self.tracker.empty_cache()
        trainer = self.trainer
        if self.liger:
            from transformers.integrations.liger import apply_liger_kernel

            from pipeline.training.liger import LigerPatches

            self.liger_patches = LigerPatches(self.model).__enter__()
            apply_liger_kernel(self.model, trainer.args.liger_kernel_config)
        if self.checkpointing:
            from pipeline.simulate.clients.parts import enable_checkpointing

            enable_checkpointing(trainer, self.model)
            self.rules.wrap_checkpointing(self.model)
        with self.world.preparing(self) if self.world is not None else contextlib.nullcontext():
            self.wrapped = prepare_for_training(trainer, self.rules, self.precision, self.prepared_before)
        self.model = trainer.model
        self.tr_loss = torch.tensor(0.0, device=self.device_type)
        self.wrapped.zero_grad()
        if self.world is not None:  # on_train_begin
            self.world.training_begins(self)

    def step(self) -> None:
        """One optimizer step: K micro-batches, clipping, the optimizer, the scheduler, zero_grad."""
        trainer, model = self.trainer, self.wrapped
        self.tracker.start_phase("setup", "activations")
        self.batches = [self.micro_batch() for _ in range(self.accumulation)]  # get_batch_samples
        num_items = trainer._get_num_items_in_batch(self.batches, self.device_type)
        trainer.current_gradient_accumulation_steps = len(self.batches)
        for index, inputs in enumerate(self.batches):
            last = index == len(self.batches) - 1
            trainer.accelerator.gradient_state._set_sync_gradients(last)
            # DDP holds its gradient all-reduce until the last micro-batch (a no-op on one GPU)
            with contextlib.nullcontext() if last else trainer.accelerator.no_sync(model):
                loss = trainer.training_step(model, inputs, num_items)
            self.tr_loss += loss
            del loss
        grad_norm = trainer._clip_grad_norm(model) if trainer.args.max_grad_norm > 0 else None
        trainer._get_grad_norm(model, grad_norm=grad_norm)
        del grad_norm
        self.tracker.start_phase("optimizer", "optimizer_intermediates")
        trainer.optimizer.step()
        for tensor in self.state_tensors():
            self.tracker.retag(tensor, "optimizer_state")
        trainer.lr_scheduler.step()
        model.zero_grad()

    def micro_batch(self) -> dict:
        """A collated batch (host memory) moved to the device, as accelerate's dataloader does (on meta
        each tensor carries its host values)."""
        import torch

        from pipeline.inputs.modeling import vocabulary_size
        from pipeline.simulate.values.shadows import shadowed

        ids = torch.randint(0, vocabulary_size(self.model), (self.batch_size, self.seq_len))
        items = [{"input_ids": row, "labels": row} for row in ids]
        batch = self.trainer.data_collator(items)
        return {key: shadowed(value, self.device_type) if self.device_type == "meta" else value.to(self.device_type)
                for key, value in batch.items()}

    def state_tensors(self) -> list:
        import torch

        return [v for state in self.trainer.optimizer.state.values() for v in state.values()
                if torch.is_tensor(v) and v.device.type == self.device_type]

    def optimizer_state(self) -> int:
        """Storage bytes of the optimizer state on the device, as the GPU client reports them."""
        seen = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in self.state_tensors()}
        return sum(seen.values())

    def close(self) -> None:
        from pipeline.simulate.clients.parts import restore

        for hook in self.hooks:
            hook.remove()
        self.batches = self.tr_loss = None
        try:
            restore(self.model, self.trainer)
        finally:
            if self.liger_patches is not None:
                self.liger_patches.restore()
                self.liger_patches = None
        self.trainer = None
