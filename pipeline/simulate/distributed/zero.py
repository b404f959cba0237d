"""DeepSpeed's ZeRO on the meta device, rank 0 of N under torch's fake process group: what the Trainer clients
run with a `deepspeed` config (`sharding` zero1, zero2, zero3; `pipeline.training.zero`).

DeepSpeed's own code runs: `deepspeed.initialize` (called by accelerate's `prepare`), the engine, the ZeRO
optimizers of stages 1-2 (`runtime/zero/stage_1_and_2.py`: flat bf16 groups, fp32 partitions, the IPG
gradient bucket, the averaged-gradient partitions) and of stage 3 (`runtime/zero/stage3.py`,
`partition_parameters.py`, `partitioned_param_coordinator.py`: parameters partitioned at build by
`zero.Init`, all-gathered per module with prefetch, released after use), with what each allocates made on the
meta device and counted by the tracker. What is stood in for, each because it needs a GPU or a second rank:

- DeepSpeed's accelerator (`deepspeed.accelerator`) is its CPU accelerator with the device name "meta" and the
  fake process group's backend name (its `get_accelerator().device_name()` is where DeepSpeed makes its
  buffers); its shared-memory communication op is not built (a CPU op that the fake group does not need);
- `has_overflow` of both optimizers and stage 1-2's `_has_inf_or_nan` (ZeRO-Offload's per-gradient check) answer
  False (a value read back from the device; bf16 has no loss scaler, fp16's dynamic scaler is taken to find no
  overflow, as on all but a few first steps);
- stage 3's `defragment` (zero/utils.py: every partition copied through the host into one flat buffer) runs in
  its order (partitions freed, the cache emptied, the flat buffer made, the partitions its views) without the
  copy through the host;
- `assert_ints_same_as_other_ranks` (a check that every rank traces the same modules) is skipped: one rank;
- stage 3's `LinearFunctionForZeroStage3` asks autocast of the accelerator's device type: it asks CUDA's, which
  the simulator's kernel rules emulate;
- a config's Adam / AdamW (DeepSpeed's FusedAdam, or DeepSpeedCPUAdam when the optimizer is offloaded: compiled
  ops) is torch's fused AdamW: the same two fp32 moments per element, updated in place;
- ZeRO-Offload's host tensors are meta tensors the tracker does not count (`HostOnMeta`), their bytes the host
  memory the process needs.

The model arrives on the GPU where DeepSpeed moves it (`DeepSpeedEngine._configure_distributed_model`:
`module.to(device)` for stages 1-2; stage 3's partitions are made on the GPU by `zero.Init` at build).
"""

from __future__ import annotations

import contextlib

from pipeline.core.patches import attributes_set


def meta_accelerator(tracker):
    """DeepSpeed's CPU accelerator, named "meta" (see the module docstring), with CUDA's streams and cache as the
    simulation has them: torch.cpu's stream stubs (whose blocks `tracker` pools per stream, as FSDP2's) and the
    allocator replay's `empty_cache` (DeepSpeed empties CUDA's cache in its setup and steps)."""
    import torch
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    class MetaStream(torch.cpu.Stream):
        """A CUDA stream's methods that DeepSpeed calls, each done at once (one process runs one rank)."""

        def synchronize(self):
            pass

        def wait_stream(self, stream):
            pass

        def wait_event(self, event):
            pass

        def record_event(self, event=None):
            return event or torch.cpu.Event()

        def query(self):
            return True

    default = MetaStream()  # CUDA's default stream, as DeepSpeed holds it (overlap_comm false reduces on it)

    class MetaAccelerator(CPU_Accelerator):
        def __init__(self):
            super().__init__()
            self._name = "cpu"  # DeepSpeed's op builders are the CPU's
            self._communication_backend_name = "fake"

        def device_name(self, device_index=None):
            return "meta"

        def current_device_name(self):
            return "meta"

        def on_accelerator(self, tensor):
            return tensor.device.type == "meta"

        def create_op_builder(self, op_name):
            return None if op_name == "ShareMemCommBuilder" else super().create_op_builder(op_name)

        def is_synchronized_device(self):  # a GPU's: DeepSpeed overlaps its collectives on streams of their own
            return False

        def Stream(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
            return MetaStream()

        def Event(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
            return torch.cpu.Event()

        def stream(self, stream):
            if stream is None:
                return contextlib.nullcontext()
            return torch.cpu.stream(torch.cpu._default_cpu_stream if stream is default else stream)

        def current_stream(self, device_index=None):
            return torch.cpu.current_stream()

        def default_stream(self, device_index=None):
            return default

        def empty_cache(self):
            tracker.empty_cache()

    return MetaAccelerator()


@contextlib.contextmanager
def meta_deepspeed(tracker, offload: bool = False):
    """DeepSpeed on the meta device (see the module docstring), its model arriving on the GPU through `tracker`;
    undone on exit. `offload`: ZeRO-Offload's host tensors on meta, not counted (`HostOnMeta`, the tracker's
    host placement), which it yields (None without offload)."""
    import deepspeed.accelerator.real_accelerator as real_accelerator
    import deepspeed.runtime.zero.linear as zero_linear
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    import deepspeed.runtime.zero.stage3 as stage3
    import deepspeed.runtime.zero.utils as zero_utils
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def defragment(tensors):
        """zero/utils.py's `defragment` in its order (the partitions freed, the cache emptied, one flat buffer made
        and the partitions its views), without the copy through the host that keeps their values."""
        import gc

        from deepspeed.runtime.zero.utils import get_mapping_to_flat_buffer

        infos = get_mapping_to_flat_buffer(tensors)
        total, dtype, device = sum(t.numel() for t in tensors), tensors[0].dtype, tensors[0].device
        for tensor, _, _ in infos:
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        gc.collect()
        real_accelerator.ds_accelerator.empty_cache()
        buffer = torch.empty(total, dtype=dtype, device=device)
        for tensor, offset, numel in infos:
            tensor.data = buffer.narrow(0, offset, numel)
        return buffer

    class CudaAutocast:
        def device_name(self, device_index=None):
            return "cuda"

    configure = DeepSpeedEngine._configure_distributed_model

    def configure_distributed_model(self, model):
        from pipeline.simulate.distributed.world import arrive

        if not self.zero_optimization_partition_weights():
            arrive(tracker, [*model.parameters(), *model.buffers()])
        with tracker.placed(host=False):
            return configure(self, model)

    configure_zero = DeepSpeedEngine._configure_zero_optimizer

    def configure_zero_optimizer(self, *args, **kwargs):
        """The ZeRO optimizer made where DeepSpeed makes it, on the GPU inside `deepspeed.initialize` (its flat
        groups, fp32 partitions and buffers), not on the host of the Trainer's preparation; stage 1-2's shape
        placeholders (`torch.zeros_like(p, device="meta")`, no bytes on a GPU) are not counted."""
        with tracker.placed(host=False), attributes_set([(torch, "zeros_like", placeholders_uncounted)]):
            return configure_zero(self, *args, **kwargs)

    zeros_like = torch.zeros_like

    def placeholders_uncounted(tensor, *args, **kwargs):
        if kwargs.get("device") == "meta":  # DeepSpeed's literal "meta": a placeholder, not the simulated GPU
            with tracker.placed(host=True):
                return zeros_like(tensor, *args, **kwargs)
        return zeros_like(tensor, *args, **kwargs)

    record_stream = torch.Tensor.record_stream

    def recorded(tensor, stream):
        """A meta tensor keeps no stream's events: its block is free for reuse when freed (CUDA's allocator
        frees a block recorded on another stream once that stream's work is done, soon after)."""
        if not tensor.is_meta:
            record_stream(tensor, stream)

    optimizer_configuration = DeepSpeedEngine.get_optimizer_configuration

    def torch_adam(self, parameters, adam_w_mode, allow_legacy_fallback=False):
        """A config's Adam / AdamW as torch's fused one: DeepSpeed's FusedAdam (CUDA) and DeepSpeedCPUAdam (the
        offloaded step) are compiled ops; each keeps two fp32 moments per element of the fp32 partitions and
        updates in place, as torch's fused AdamW does."""
        if parameters.get("torch_adam"):
            return optimizer_configuration(self, parameters, adam_w_mode, allow_legacy_fallback)
        parameters.pop("fp32_optimizer_states", None)
        return (torch.optim.AdamW if adam_w_mode else torch.optim.Adam), {"fused": True}

    never = lambda self, *args, **kwargs: False  # noqa: E731
    skip = lambda *args, **kwargs: None  # noqa: E731
    patches = [(real_accelerator, "ds_accelerator", meta_accelerator(tracker)),
               (stage3, "defragment", defragment),
               (DeepSpeedZeroOptimizer, "has_overflow", never),
               (DeepSpeedZeroOptimizer, "_has_inf_or_nan", staticmethod(lambda *args, **kwargs: False)),
               (stage3.DeepSpeedZeroOptimizer_Stage3, "has_overflow", never),
               (zero_utils, "assert_ints_same_as_other_ranks", skip),
               (coordinator, "assert_ints_same_as_other_ranks", skip),
               (zero_linear, "get_accelerator", CudaAutocast),
               (zero_linear, "_get_autocast_dtype", lambda device_type: torch.get_autocast_dtype("cuda")),
               (zero_linear, "_is_autocast_enabled", lambda device_type: torch.is_autocast_enabled("cuda")),
               (DeepSpeedEngine, "_configure_distributed_model", configure_distributed_model),
               (DeepSpeedEngine, "_configure_zero_optimizer", configure_zero_optimizer),
               (DeepSpeedEngine, "get_optimizer_configuration", torch_adam),
               (torch.Tensor, "record_stream", recorded),
               # zero.Init replaces F.linear for the rest of the process (memory_efficient_linear): put back on exit,
               # so that a later simulation in this process runs torch's
               (torch.nn.functional, "linear", torch.nn.functional.linear)]
    placement = HostOnMeta() if offload else None
    patches.append((tracker, "host_placement", placement))
    with attributes_set(patches), world_state_restored(), quiet():
        yield placement


@contextlib.contextmanager
def quiet():
    """DeepSpeed's logs below errors and torch's deprecation warnings of the collectives it calls (each call warns)
    off the user's terminal. A filter, not the logger's level: DeepSpeed's engine and transformers' deepspeed_init
    set that level themselves."""
    import logging
    import warnings

    from deepspeed.utils import logger

    def errors_only(record):
        return record.levelno >= logging.ERROR

    logger.addFilter(errors_only)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed")
            yield
    finally:
        logger.removeFilter(errors_only)


def retag_states(optimizer, tracker) -> None:
    """ZeRO's own buffers under the roles of the answer, by the attributes that hold them (stage_1_and_2.py,
    stage3.py): the flat bf16 partitions (stage 3) or groups (stages 1-2) as parameters, the fp32 partitions as
    optimizer_state (the master weights the optimizer steps), the IPG bucket and the gradient partitions as
    gradients."""
    import torch

    roles = {"parameters": ("bit16_groups_flat", "fp16_partitioned_groups_flat", "lp_param_buffer"),
             "optimizer_state": ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"),
             "gradients": ("ipg_buffer", "averaged_gradients", "grad_partitions_flat_buffer",
                           "_DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer")}
    for param in getattr(optimizer, "module", None).parameters() if hasattr(optimizer, "module") else ():
        partition = getattr(param, "ds_tensor", None)  # a frozen weight's partition (a 4-bit base's among them)
        if torch.is_tensor(partition) and tracker.is_counted(partition):
            tracker.retag(partition, "parameters")
    for role, names in roles.items():
        for name in names:
            value = getattr(optimizer, name, None)
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                else [value]
            for tensor in values:
                for item in tensor if isinstance(tensor, (list, tuple)) else [tensor]:
                    if torch.is_tensor(item) and tracker.is_counted(item):
                        tracker.retag(item, role)


@contextlib.contextmanager
def world_state_restored():
    """DeepSpeed's process groups and communication backend, kept in its modules' globals, put back on exit, and
    transformers' reference to the run's DeepSpeed config dropped: a later world (another fake process group)
    must not find the groups of this one, nor a later model be built under this run's `zero.Init`."""
    import deepspeed.comm.comm as comm
    import deepspeed.utils.groups as groups
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    saved = [(module, {name: value for name, value in vars(module).items() if name in ("cdb", "mpu", "mesh_device")
                       or (name.startswith("_") and name.isupper() and not callable(value))})
             for module in (comm, groups)]
    saved = [(module, {name: copy_of(value) for name, value in values.items()}) for module, values in saved]
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        for module, values in saved:
            for name, value in values.items():
                setattr(module, name, value)


def copy_of(value):
    return dict(value) if isinstance(value, dict) else value


@contextlib.contextmanager
def zero3_build(run, tracker):
    """A ZeRO-3 run's model built as a script builds it after its training arguments (`training.zero.zero3_init`),
    each parameter's partition made on the GPU and counted as parameters."""
    from pipeline.training.zero import zero3_init

    with zero3_init(run.deepspeed, run.batch, run.gradient_accumulation, run.precision), \
            tracker.placed(host=False), tracker.scope("parameters"):
        yield


class HostOnMeta:
    """ZeRO-Offload's host tensors on the meta device (the tracker's `host_placement`): DeepSpeed makes its
    offloaded partitions, their gradients and the optimizer's state on the CPU (`device="cpu"`, `.to("cpu")`);
    here an op asked for the CPU makes a meta tensor instead, not counted on the GPU, and so does every op whose
    tensors are all such host tensors (the optimizer's step over them). Their bytes at their peak are the host
    memory the process needs (`peak`)."""

    def __init__(self):
        self.host = {}  # id(storage) -> bytes of the live host storages
        self.live = self.peak = 0

    def place(self, func, args, kwargs) -> tuple:
        """(args, kwargs, on the host?) of an op: a CPU device asked for is the meta device on the host."""
        import torch
        from torch.utils._pytree import tree_flatten

        asked = kwargs.get("device")
        if asked is not None:
            if torch.device(asked).type != "cpu" or not called_by_deepspeed():
                return args, kwargs, False  # the data's host tensors (the collator's) stay real
            return args, {**kwargs, "device": torch.device("meta")}, True
        # a 0-dim tensor beside host tensors (a step count, a learning rate) does not put the op on the GPU
        tensors = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.is_meta and t.dim() > 0]
        return args, kwargs, bool(tensors) and all(self.is_host(t) for t in tensors)

    def made(self, out) -> None:
        """`out` of an op placed on the host: its storages are host storages."""
        import torch
        from torch.utils._pytree import tree_flatten

        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                self.add(tensor)

    def take(self, tensors, tracker) -> None:
        """`tensors`, made on the GPU here, to the host, where DeepSpeed made them: stage 1-2's bf16 copies of the
        offloaded fp32 partitions (`param_buffer_of_bit16_for_cpu_offload_groups`, stage_1_and_2.py, made with
        `device=weights_partition.device`: the host's there, the simulated GPU's on meta)."""
        for tensor in tensors:
            tracker._freed(id(tensor.untyped_storage()), None)
            self.add(tensor)

    def is_host(self, tensor) -> bool:
        return id(tensor.untyped_storage()) in self.host

    def add(self, tensor) -> None:
        import weakref

        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.host:
            return
        self.host[key] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self.remove, key)

    def remove(self, key) -> None:
        self.live -= self.host.pop(key, 0)


def called_by_deepspeed() -> bool:
    """Whether DeepSpeed's code asked for the op being dispatched (a frame of its modules is on the stack)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("deepspeed."):
            return True
        frame = frame.f_back
    return False
