"""Any training code, traced: the user's own steps run on meta tensors under the simulator.

    import pipeline, torch

    with pipeline.trace(gpu="H100 80GB") as t:
        model = t.build(config)                     # a config.json dict or path, or a transformers config
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(3):
            loss = my_loss(model, t.batch(4, 2048))
            loss.backward(); opt.step(); opt.zero_grad()
    t.peak_bytes, t.reserved_bytes, t.components, t.fits, t.estimate

For the block, a trace installs what the simulator's own steps run under (`pipeline.simulate.step`):

- the live-byte tracker (`tracker.LiveBytesTracker`): every storage made on the traced device counted
  from its creation to its last reference, in the CUDA caching allocator's blocks, by role:
  `parameters` (the weights and buffers of a model built or watched by the trace), `gradients` (their
  .grad, as autograd accumulates it), `optimizer_state` (what an optimizer keeps in its `state` after
  a step), `optimizer_intermediates` (made inside `optimizer.step()`) and `activations` (the rest);
  and per phase: `setup` (until the first forward), `forward` (from a batch made by the trace or a
  module's forward), `backward` (from autograd's backward), `optimizer` (from an optimizer's step to
  the next forward); `torch.cuda.empty_cache()` in the traced code gives cached segments back,
  `torch.cuda.reset_peak_memory_stats()` starts the peaks again from what is live (after a setup);
- CUDA's kernel rules (`rules.KernelRules`): the SDPA kernel CUDA picks and what it saves, fused
  dropout, kernels' scratch memory and outputs kept on the host; `torch.autocast("cuda", ...)` in the
  traced code switches on the emulation of CUDA's autocast (torch's own does nothing on meta tensors),
  checkpointed layers recompute under it; `torch.amp.GradScaler("cuda")` is made on the traced
  device; torch's optimizers take CUDA's default implementation (foreach) and accept `fused=True`;
- the allocator replay (`allocator`): the reserved bytes with the default settings and with
  `expandable_segments:True`, given back at the GPU's edge as the allocator does when a GPU is named;
- the cuBLAS workspaces of a process's first step, made at the first matmul of the forward and of
  the backward (`kernels.CublasWorkspaces`);
- stand-ins for data-dependent values (`stand_ins`): `.item()` of masks whose values are known;
  `.item()` of any other floating-point meta tensor (a loss printed for logging) answers 0.0 and is
  counted in `notes`; an integer or boolean one that nothing knows is a UserError.

A model built with `t.build` is built inside the trace, so its weights are allocated in the order and
sizes its construction makes them (a fresh process building from a config). `t.watch(model)` counts
one built elsewhere on the traced device (its weights allocated at that moment, in `parameters()`
order). `device="cpu"` runs the same code for real on the CPU with real weights under the same
tracker and rules: the meta trace and the CPU run count the same bytes (tests/test_simulate_trace.py).

The named clients run on the same installation: `predict.loop_peak` (the standard step),
`trainer.trainer_peak`, `sft.sft_peak` and `dpo.dpo_peak` (transformers.Trainer, TRL's SFTTrainer and
DPOTrainer) make a `Trace` without the automatic phases and roles (`automatic=False`) and mark them
themselves; for a process's first point they build their model in it first (`Trace.record`).
"""

from __future__ import annotations

import contextlib
import time

import torch

from pipeline.core.errors import UserError
from pipeline.simulate.memory.allocator import CachingAllocator, ExpandableSegments, Fanout
from pipeline.simulate.kernels.cuda import CublasWorkspaces, host_outputs, workspace_rules
from pipeline.simulate.kernels.rules import KernelRules
from pipeline.simulate.kernels.scaler import scaler_stand_ins
from pipeline.simulate.values.stand_ins import UniformValues, scalar_stand_ins
from pipeline.simulate.memory.tracker import LiveBytesTracker
from pipeline.training.values import Estimate

DEVICES = ("meta", "cpu")
PHASES = ("setup", "forward", "backward", "optimizer")


def trace(gpu: str | None = None, *, gpu_memory_gib: float | None = None, device: str = "meta",
          fresh_process: bool = True) -> Trace:
    """A context manager that runs the training code in its block under the simulator (see the module
    docstring): `gpu` a name of the catalogue (`pipeline.formulas.gpus.DEVICES`) or `gpu_memory_gib`
    (nvidia-smi's total in GiB) for the fit verdict and the allocator's edge; `device` "meta" (no
    weights, no GPU) or "cpu" (the same code run for real, to check a trace); `fresh_process=False`:
    an earlier step of the same process made cuBLAS's workspaces before this code runs."""
    from pipeline.core.vocabulary import check_bool, check_choice
    from pipeline.formulas.gpus import custom_device, device as catalogue_device

    check_choice("device", device, DEVICES)
    check_bool("fresh_process", fresh_process)
    if gpu is not None and gpu_memory_gib is not None:
        raise UserError("give one of gpu and gpu_memory_gib, not both")
    if gpu is not None and not isinstance(gpu, str):
        raise UserError(f"gpu must be a name of the catalogue, not {type(gpu).__name__}")
    dev = catalogue_device(gpu) if gpu is not None else (
        custom_device(gpu_memory_gib) if gpu_memory_gib is not None else None)
    return Trace(device, gpu=dev, warm=not fresh_process)


class Trace:
    """The simulator's installation around a block of training code, and what it counted (see the
    module docstring). Results are read once the block has ended."""

    def __init__(self, device_type: str = "meta", *, gpu=None, reserve_limit: int | None = None,
                 warm: bool = False, cuda_rules: bool = True, blocks: bool = True, automatic: bool = True,
                 stand_ins: dict | None = None, observer=None, tracker_class=LiveBytesTracker):
        from pipeline.formulas.gpus import outside_bytes

        self.device_type, self.gpu, self.warm, self.automatic = device_type, gpu, warm, automatic
        self.cuda_rules = cuda_rules
        if reserve_limit is None and gpu is not None:  # the larger context of the two regimes: the safe edge
            reserve_limit = gpu.total_bytes - outside_bytes(gpu, "bf16")
        meta = device_type == "meta"
        self.rules = KernelRules(device_type, sdpa=cuda_rules)
        self.reserved = Fanout([CachingAllocator(reserve_limit), ExpandableSegments(reserve_limit)])
        self.observer = observer if observer is not None else (UniformValues() if meta else None)
        replaced = {**scalar_stand_ins(), **scaler_stand_ins()} if meta else {}
        if automatic and meta:
            replaced.update(self._item_stand_ins(replaced))
        replaced.update(stand_ins or {})
        self.tracker = tracker_class(device_type, workspace_rules() if cuda_rules else None, replaced or None,
                                     self.observer, CachingAllocator() if blocks else None,
                                     host_outputs() if cuda_rules else None, self.reserved)
        self.workspaces = None
        self.models = []  # watched models
        self.tracked = set()  # ids of parameters with their gradient hook
        self.hooks = []
        self.notes = []
        self.answered_items = 0
        self.entered = self.finished = self.active = False
        self.exits = None
        self.start = None
        self.seconds = None
        self.communicators = 0  # NCCL communicators of the traced process (several GPUs)

    # -- what the traced code calls ---------------------------------------------------------------
    def build(self, config, dtype=None, attn_implementation: str | None = None):
        """The causal LM of `config` (a model id of the registry or the Hub, a config.json path or dict,
        or a transformers config), built in the trace on its device (no weights on meta) for training:
        use_cache off, train mode, `dtype` (a torch dtype; default float32), `attn_implementation`
        (default: the library's). Watched."""
        from pathlib import Path

        from pipeline.inputs.configs import as_config, resolve_model
        from pipeline.inputs.modeling import build_model, training_config, transformers_quiet

        self._check_inside("build a model")
        if isinstance(config, str) and not Path(config).exists():  # a model id
            config = resolve_model(model_id=config).config
        dtype = torch.float32 if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise UserError(f"dtype must be a floating-point torch dtype, not {dtype!r}")
        config = as_config(config)
        try:
            with transformers_quiet():
                model = build_model(training_config(config), device=self.device_type, dtype=dtype,
                                    attn_implementation=None if attn_implementation in (None, "default")
                                    else attn_implementation)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - transformers rejects some configs / attention choices
            from pipeline.core.text import first_line

            raise UserError(f"the model cannot be built from this config: {first_line(exc)}") from None
        model.train()
        return self.watch(model)

    def watch(self, model):
        """Count `model` (on the traced device): its weights, buffers and a quantized base's state as
        parameters (those not counted yet are allocated now, in that order), its gradients as
        gradients, its forward as the start of the forward phase. Returns the model."""
        from pipeline.simulate.adapters import quantization_state

        if not isinstance(model, torch.nn.Module):
            raise UserError(f"watch takes a torch.nn.Module, not {type(model).__name__}")
        if any(model is known for known in self.models):
            return model
        for tensor in list(model.parameters()) + list(model.buffers()) + quantization_state(model):
            self.tracker.track(tensor, "parameters")  # counted from now on, unless it is already
            self.tracker.retag(tensor, "parameters")
        self._hook_gradients(model)
        self.models.append(model)
        return model

    def batch(self, batch: int, seq: int, model=None):
        """Token ids of shape (batch, seq), uniform over the vocabulary of `model` (default: the last
        model built or watched), on the traced device: `model(input_ids=ids, labels=ids)` is the
        standard step's forward."""
        from pipeline.core.vocabulary import MAX_BATCH, MAX_SEQ, check_positive_int
        from pipeline.inputs.modeling import vocabulary_size

        self._check_inside("make a batch")
        batch, seq = check_positive_int("batch", batch, MAX_BATCH), check_positive_int("seq", seq, MAX_SEQ)
        model = model if model is not None else (self.models[-1] if self.models else None)
        if model is None:
            raise UserError("batch needs a model for its vocabulary: build or watch one first")
        self._forward_starts()  # a step's forward starts with its batch, as the standard step's does
        return torch.randint(0, vocabulary_size(model), (batch, seq), device=self.device_type)

    @property
    def device(self):
        """The traced device: make the tensors of the traced code there."""
        return torch.device(self.device_type)

    # -- the block ------------------------------------------------------------------------------
    def __enter__(self) -> Trace:
        if self.entered:
            raise UserError("a trace runs one block; make a new one")
        self.entered, self.start = True, time.perf_counter()
        self.workspaces = CublasWorkspaces(self.tracker, self.device_type, self.warm) if self.cuda_rules else None
        stack = contextlib.ExitStack()
        if self.automatic:
            stack.enter_context(self._automatic())
            self.tracker.start_phase("setup", "activations")
        stack.enter_context(self.rules)
        stack.enter_context(self.tracker)
        self.exits, self.active = stack, True
        return self

    def __exit__(self, *exc_info):
        try:
            self.tracker.phase = None
            self.active = False
            self.exits.close()
        finally:
            for hook in self.hooks:
                hook.remove()
            self.hooks = []
            self.finished, self.seconds = True, time.perf_counter() - self.start
        return False

    def record(self, build):
        """Before the block: run `build()` (a model built, quantized or wrapped on the traced device) under
        the tracker and CUDA's rules, so that its allocations, the transient ones too, come first and in
        their order, as a process that builds its model on the GPU makes them (then the peak counters
        are reset, as the measurement resets them after the build). Returns what `build` returns; `watch`
        its model to count its weights as parameters."""
        if self.entered:
            raise UserError("record a build before the trace's block")
        with self.rules, self.tracker:
            built = build()
        self.tracker.reset_peaks()
        return built

    def workspace_tensors(self, thread: str | None = None) -> list:
        """cuBLAS's workspaces made in the block so far (of the forward's or the backward's thread)."""
        return self.workspaces.tensors(thread) if self.workspaces is not None else []

    def _check_inside(self, what: str) -> None:
        if not self.entered or self.finished:
            raise UserError(f"{what} inside the trace's block: with pipeline.trace() as t: ...")

    def _hook_gradients(self, model) -> None:
        for param in model.parameters():
            if param.requires_grad and id(param) not in self.tracked:
                self.tracked.add(id(param))
                self.hooks.append(param.register_post_accumulate_grad_hook(
                    lambda p: self.tracker.retag(p.grad, "gradients")))

    def _forward_starts(self, *_) -> None:
        """A module's forward outside autograd's backward, in another phase: the forward phase starts
        (the watched models' adapters added since, PEFT's in place, are parameters too)."""
        if self.tracker.phase == "forward" or torch._C._current_graph_task_id() != -1:
            return
        for model in self.models:
            for param in model.parameters():
                self.tracker.retag(param, "parameters")
            self._hook_gradients(model)
            if getattr(model, "is_gradient_checkpointing", False):
                self.rules.wrap_checkpointing(model)
        self.tracker.start_phase("forward", "activations")

    # -- the automatic phases and roles, and what CUDA would do for the traced code -----------------
    @contextlib.contextmanager
    def _automatic(self):
        import torch.optim.optimizer as optimizer_module
        import torch.utils.checkpoint as checkpoint_module

        trace = self
        saved = {"backward": torch.autograd.backward,
                 "foreach": optimizer_module._get_foreach_kernels_supported_devices,
                 "fused": optimizer_module._get_fused_kernels_supported_devices,
                 "checkpoint": checkpoint_module.checkpoint, "empty_cache": torch.cuda.empty_cache,
                 "reset_peak": torch.cuda.reset_peak_memory_stats}
        autocast_class, scaler_class = torch.amp.autocast_mode.autocast, torch.amp.GradScaler
        autocast_methods = {name: getattr(autocast_class, name) for name in ("__init__", "__enter__", "__exit__")}
        scaler_init = scaler_class.__init__

        # a module imported inside the block may keep a reference to a replaced function: each one
        # behaves as the original once the block has ended
        def backward(*args, **kwargs):
            if trace.active:
                trace.tracker.start_phase("backward", "activations")
            return saved["backward"](*args, **kwargs)

        def checkpoint(function, *args, **kwargs):
            original = trace.rules.checkpoint_with_state(saved["checkpoint"]) if trace.active else saved["checkpoint"]
            return original(function, *args, **kwargs)

        def autocast_init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
            self._traced = device_type == "cuda"
            if self._traced:
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    autocast_methods["__init__"](self, device_type, dtype, enabled, cache_enabled)
                self.fast_dtype = torch.float16 if dtype is None else dtype  # CUDA autocast's default
                self._traced_enabled = enabled
                return
            autocast_methods["__init__"](self, device_type, dtype, enabled, cache_enabled)

        def autocast_enter(self):
            if not getattr(self, "_traced", False) or not trace.active:
                return autocast_methods["__enter__"](self)
            self._emulation = trace.rules.autocast(self.fast_dtype, self._traced_enabled)
            self._emulation.__enter__()
            return self

        def autocast_exit(self, *exc):
            emulation = getattr(self, "_emulation", None)
            if emulation is None:
                return autocast_methods["__exit__"](self, *exc)
            self._emulation = None
            return emulation.__exit__(*exc)

        def scaler_init_on_device(self, device="cuda", *args, **kwargs):
            on_device = trace.device_type if device == "cuda" and trace.active else device
            return scaler_init(self, on_device, *args, **kwargs)

        def empty_cache():
            if trace.active:
                trace.tracker.empty_cache()
            return saved["empty_cache"]()

        def reset_peak(device=None):
            if not trace.active:
                return saved["reset_peak"](device)
            trace.tracker.reset_peaks()
            return None

        def pre_step(optimizer, args, kwargs):
            trace.tracker.start_phase("optimizer", "optimizer_intermediates")

        def post_step(optimizer, args, kwargs):
            for state in optimizer.state.values():
                for value in state.values():
                    if torch.is_tensor(value) and value.device.type == trace.device_type:
                        trace.tracker.retag(value, "optimizer_state")
            trace.tracker.category = "activations"

        torch.autograd.backward = backward
        torch.cuda.empty_cache = empty_cache
        torch.cuda.reset_peak_memory_stats = reset_peak
        optimizer_module._get_foreach_kernels_supported_devices = lambda: [*saved["foreach"](), self.device_type]
        optimizer_module._get_fused_kernels_supported_devices = lambda: [*saved["fused"](), self.device_type]
        checkpoint_module.checkpoint = checkpoint
        autocast_class.__init__, autocast_class.__enter__, autocast_class.__exit__ = (
            autocast_init, autocast_enter, autocast_exit)
        scaler_class.__init__ = scaler_init_on_device
        handles = [optimizer_module.register_optimizer_step_pre_hook(pre_step),
                   optimizer_module.register_optimizer_step_post_hook(post_step),
                   torch.nn.modules.module.register_module_forward_pre_hook(self._forward_starts)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            scaler_class.__init__ = scaler_init
            for name, method in autocast_methods.items():
                setattr(autocast_class, name, method)
            checkpoint_module.checkpoint = saved["checkpoint"]
            optimizer_module._get_fused_kernels_supported_devices = saved["fused"]
            optimizer_module._get_foreach_kernels_supported_devices = saved["foreach"]
            torch.autograd.backward = saved["backward"]
            torch.cuda.empty_cache = saved["empty_cache"]
            torch.cuda.reset_peak_memory_stats = saved["reset_peak"]

    def _item_stand_ins(self, replaced: dict) -> dict:
        """`.item()` of a floating-point meta tensor that nothing knows: 0.0, counted (logging asks it);
        of an integer or boolean one: a UserError (the traced code branches on data)."""
        aten = torch.ops.aten

        def answered(known):
            def item(func, args, kwargs):
                try:
                    return known(func, args, kwargs)
                except RuntimeError:
                    tensor = args[0]
                    if not tensor.is_floating_point():
                        raise UserError(f"the traced code needs the value of a {tensor.dtype} meta tensor of shape "
                                        f"{tuple(tensor.shape)} (.item(), bool() or a data-dependent shape), which a "
                                        "trace without weights cannot know") from None
                    self.answered_items += 1
                    return 0.0 if func is aten._local_scalar_dense.default else False
            return item

        return {op: answered(replaced[op]) for op in (aten._local_scalar_dense.default, aten.is_nonzero.default)}

    # -- what was counted ---------------------------------------------------------------------------
    def _check_done(self) -> None:
        if not self.finished:
            raise UserError("a trace's results are read after its with block")

    @property
    def peak_bytes(self) -> int:
        """torch.cuda.max_memory_allocated() over the block."""
        self._check_done()
        return self.tracker.peaks["total"].total if "total" in self.tracker.peaks else 0

    @property
    def components(self) -> dict:
        """Bytes by role at the peak: parameters, gradients, optimizer_state, optimizer_intermediates,
        activations."""
        self._check_done()
        snap = self.tracker.peaks.get("total")
        return dict(snap.parts) if snap is not None else {}

    @property
    def phase_peaks(self) -> dict:
        """The peak allocated bytes of each phase that ran."""
        self._check_done()
        return {phase: self.tracker.peaks[phase].total for phase in PHASES if phase in self.tracker.peaks}

    @property
    def peak_phase(self) -> str | None:
        peaks = self.phase_peaks
        return max(peaks, key=peaks.get) if peaks else None

    @property
    def reserved_bytes(self) -> int:
        """torch.cuda.max_memory_reserved() over the block (the allocator's default settings)."""
        self._check_done()
        return self.reserved.allocators[0].peak

    @property
    def reserved_expandable_bytes(self) -> int:
        """The same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True."""
        self._check_done()
        return self.reserved.allocators[1].peak

    @property
    def verdict(self):
        """The fit verdict on the trace's GPU (`pipeline.formulas.gpus.Verdict`), None without one:
        the reserved bytes plus the memory outside PyTorch (the context of the kernels that ran: with
        16-bit SDPA kernels or without) against the GPU's nvidia-smi total."""
        from pipeline.formulas.gpus import Verdict, outside_bytes

        self._check_done()
        if self.gpu is None:
            return None
        regime = "bf16" if self.rules.half_attention else "fp32"
        return Verdict(self.gpu, self.reserved_bytes, outside_bytes(self.gpu, regime, communicators=self.communicators),
                       self.reserved_expandable_bytes)

    @property
    def fits(self) -> bool | None:
        """Whether the traced code fits the GPU (None without one)."""
        verdict = self.verdict
        return None if verdict is None else bool(verdict.fits)

    @property
    def estimate(self) -> Estimate:
        """The estimators' value: peak, components, reserved bytes, and in details the phase peaks, the
        peak's phase, the verdict's figures, notes and the seconds the block took."""
        details = {"phase_peaks": self.phase_peaks, "peak_phase": self.peak_phase,
                   "reserve_limit_exceeded": self.reserved.allocators[0].out_of_memory,
                   "notes": self.note_lines(), "seconds": self.seconds}
        verdict = self.verdict
        if verdict is not None:
            details.update(gpu=verdict.device.name, fits=bool(verdict.fits), headroom_bytes=verdict.headroom_bytes,
                           outside_bytes=verdict.outside_bytes)
        return Estimate(float(self.peak_bytes), self.components, details, self.reserved_bytes,
                        self.reserved_expandable_bytes)

    def note_lines(self) -> list[str]:
        """What the trace answered without knowing (values of meta tensors), one line each."""
        lines = list(self.notes)
        if self.answered_items:
            lines.append(f".item() of a floating-point meta tensor answered 0.0 ({self.answered_items} times); "
                         "a branch on such a value takes that path")
        return lines

