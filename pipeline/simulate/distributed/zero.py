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
- `has_overflow` of both optimizers answers False (a value read back from the device; bf16 has no loss scaler,
  fp16's dynamic scaler is taken to find no overflow, as on all but a few first steps);
- stage 3's `defragment` (stage3.py: a copy of every partition through the host into one flat buffer) makes
  the flat buffer on the device with the partitions as views of it, without the trip through the host;
- `assert_ints_same_as_other_ranks` (a check that every rank traces the same modules) is skipped: one rank;
- stage 3's `LinearFunctionForZeroStage3` asks autocast of the accelerator's device type: it asks CUDA's, which
  the simulator's kernel rules emulate.

The model arrives on the GPU where DeepSpeed moves it (`DeepSpeedEngine._configure_distributed_model`:
`module.to(device)` for stages 1-2; stage 3's partitions are made on the GPU by `zero.Init` at build).
"""

from __future__ import annotations

import contextlib

from pipeline.core.patches import attributes_set


def meta_accelerator():
    """DeepSpeed's CPU accelerator, named "meta" (see the module docstring)."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

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

    return MetaAccelerator()


@contextlib.contextmanager
def meta_deepspeed(tracker):
    """DeepSpeed on the meta device (see the module docstring), its model arriving on the GPU through `tracker`;
    undone on exit."""
    import deepspeed.accelerator.real_accelerator as real_accelerator
    import deepspeed.runtime.zero.linear as zero_linear
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator
    import deepspeed.runtime.zero.stage3 as stage3
    import deepspeed.runtime.zero.utils as zero_utils
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    def defragment(tensors):
        buffer = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
        offset = 0
        for tensor in tensors:
            tensor.data = buffer.narrow(0, offset, tensor.numel()).view_as(tensor)
            offset += tensor.numel()
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

    never = lambda self, *args, **kwargs: False  # noqa: E731
    skip = lambda *args, **kwargs: None  # noqa: E731
    patches = [(real_accelerator, "ds_accelerator", meta_accelerator()),
               (stage3, "defragment", defragment),
               (DeepSpeedZeroOptimizer, "has_overflow", never),
               (stage3.DeepSpeedZeroOptimizer_Stage3, "has_overflow", never),
               (zero_utils, "assert_ints_same_as_other_ranks", skip),
               (coordinator, "assert_ints_same_as_other_ranks", skip),
               (zero_linear, "get_accelerator", CudaAutocast),
               (zero_linear, "_get_autocast_dtype", lambda device_type: torch.get_autocast_dtype("cuda")),
               (zero_linear, "_is_autocast_enabled", lambda device_type: torch.is_autocast_enabled("cuda")),
               (DeepSpeedEngine, "_configure_distributed_model", configure_distributed_model)]
    with attributes_set(patches), world_state_restored():
        yield


@contextlib.contextmanager
def world_state_restored():
    """DeepSpeed's process groups and communication backend, kept in its modules' globals, put back on exit: a
    later world (another fake process group) must not find the groups of this one."""
    import deepspeed.comm.comm as comm
    import deepspeed.utils.groups as groups

    saved = [(module, {name: value for name, value in vars(module).items() if name in ("cdb", "mpu", "mesh_device")
                       or (name.startswith("_") and name.isupper() and not callable(value))})
             for module in (comm, groups)]
    saved = [(module, {name: copy_of(value) for name, value in values.items()}) for module, values in saved]
    try:
        yield
    finally:
        for module, values in saved:
            for name, value in values.items():
                setattr(module, name, value)


def copy_of(value):
    return dict(value) if isinstance(value, dict) else value


@contextlib.contextmanager
def world_state_restored():
    """DeepSpeed's process groups and communication backend, kept in its modules' globals, put back on exit: a
    later world (another fake process group) must not find the groups of this one."""
    import deepspeed.comm.comm as comm
    import deepspeed.utils.groups as groups

    saved = [(module, {name: value for name, value in vars(module).items() if name in ("cdb", "mpu", "mesh_device")
                       or (name.startswith("_") and name.isupper() and not callable(value))})
             for module in (comm, groups)]
    saved = [(module, {name: copy_of(value) for name, value in values.items()}) for module, values in saved]
    try:
        yield
    finally:
        for module, values in saved:
            for name, value in values.items():
                setattr(module, name, value)


def copy_of(value):
    return dict(value) if isinstance(value, dict) else value


@contextlib.contextmanager
def zero3_build(run, tracker):
    """A ZeRO-3 run's model built as a script builds it after its training arguments: transformers' `from_config` /
    `from_pretrained` under `deepspeed.zero.Init` (the arguments' `HfDeepSpeedConfig` is in force while they
    live), each parameter's partition made on the GPU and counted as parameters."""
    import json
    import tempfile

    from transformers import TrainingArguments

    from pipeline.training.step import mixed_precision_args

    with tempfile.TemporaryDirectory(prefix="avp-zero3-") as output_dir:
        args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=run.batch,
                                 gradient_accumulation_steps=run.gradient_accumulation, report_to="none",
                                 deepspeed=json.loads(run.deepspeed), **mixed_precision_args(run.precision))
        with tracker.placed(host=False), tracker.scope("parameters"):
            yield
        del args


@contextlib.contextmanager
def zero3_build(run, tracker):
    """A ZeRO-3 run's model built as a script builds it after its training arguments (`training.zero.zero3_init`),
    each parameter's partition made on the GPU and counted as parameters."""
    from pipeline.training.zero import zero3_init

    with zero3_init(run.deepspeed, run.batch, run.gradient_accumulation, run.precision), \
            tracker.placed(host=False), tracker.scope("parameters"):
        yield
