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
import warnings

from pipeline.core.errors import UserError
from pipeline.core.patches import attributes_set


@contextlib.contextmanager
def fake_world(layout):
    """The default process group: rank 0 of `layout.num_gpus` on the fake backend; yields the layout's mesh on
    the CPU (`training.layout.Layout.mesh`)."""
    with fake_process_group(layout.num_gpus):
        yield layout.mesh("cpu")


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """torch's fake process group of `world_size` ranks as the default group, this process rank 0."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError("the sharded simulation needs a process without a process group of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        with warnings.catch_warnings():
            # about in-place ops on the model's output, which the step does not make
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            yield
    finally:
        dist.destroy_process_group()
        forget_meshes()


@contextlib.contextmanager
def started_by_the_world():
    """What a trainer script asks of its launcher, answered as done in a traced block: `dist.init_process_group`
    (the fake group is the default one already) and `torch.cuda.set_device` (the simulated GPU is the device)."""
    import torch
    import torch.distributed as dist

    patches = [(dist, "init_process_group", lambda *args, **kwargs: None),
               (torch.cuda, "set_device", lambda device: None)]
    with attributes_set(patches):
        yield


def forget_meshes() -> None:
    """DTensor's caches of sharding and redistribution plans, which hold the meshes (and their process groups'
    names) of a world gone: a later world of an equal mesh would find its groups there."""
    import torch.distributed.tensor.debug as debug
    from torch.distributed.tensor import _redistribute

    for name in ("_clear_python_sharding_prop_cache", "_clear_fast_path_sharding_prop_cache"):  # torch's, by version
        getattr(debug, name, lambda: None)()
    getattr(_redistribute._gen_transform_infos, "cache_clear", lambda: None)()


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
    # CUDA's streams hand back an event that was recorded; FSDP2 checks for one (HSDP's all-reduce)
    patches.append((torch.cpu.Stream, "record_event", lambda stream: torch.cpu.Event()))
    # FSDP2 asks the machine's accelerator for its stream in one place (an unshard nobody waited for): the
    # simulated device's (on a machine with CUDA's build and no GPU, CUDA's would fail to start)
    patches.append((torch.accelerator, "current_stream", lambda device=None: torch.cpu.current_stream()))
    patches.append((fully_shard_module, "_get_device_from_mesh", lambda mesh: torch.device("meta")))
    patches.append((param_group.FSDPParamGroup, "_validate_no_meta_params", lambda self: None))
    with attributes_set(patches):
        yield


@contextlib.contextmanager
def accelerate_on_gpus(num_gpus: int):
    """accelerate (and the Trainer's arguments) told that this process is rank 0 of `num_gpus` GPUs: what
    `torchrun --nproc_per_node N` gives a Trainer script. accelerate's `PartialState` detects the backend of the
    fake process group as a GPU's (DistributedType.MULTI_GPU: DDP, or FSDP with the FSDP plugin), its device
    is "meta" (ACCELERATE_TORCH_DEVICE, which accelerate reads before any CUDA call), the environment torchrun
    sets is set, and TrainingArguments' check for a bf16 GPU answers as a bf16 GPU would. A meta tensor's
    `data_ptr()` is its storage's address (on meta it is 0 for all; accelerate maps the optimizer's parameters
    to FSDP2's sharded ones by it)."""
    import os

    import torch
    import torch.distributed as dist
    import transformers.training_args as training_args
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    environment = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": str(num_gpus), "LOCAL_WORLD_SIZE": str(num_gpus),
                   "ACCELERATE_TORCH_DEVICE": "meta"}
    saved = dict(os.environ)  # accelerate and transformers set more (ACCELERATE_USE_FSDP, FSDP_...): all put back
    data_ptr = torch.Tensor.data_ptr

    def meta_data_ptr(tensor):
        if tensor.is_meta:
            return tensor.untyped_storage()._cdata + tensor.storage_offset() * tensor.element_size()
        return data_ptr(tensor)

    def backend(cpu=False, sagemaker_dp=False, backend=None):
        return "fake", DistributedType.MULTI_GPU

    all_gather_into_tensor = dist.all_gather_into_tensor

    def gathered(output_tensor, input_tensor, *args, **kwargs):  # torch's names: DeepSpeed passes them by name
        """Every rank gave what rank 0 gave: the host values of a gathered count (the Trainer's tokens of every
        rank, TRL's `num_valid > 0`, a padding-free batch's token count) are rank 0's, N times."""
        work = all_gather_into_tensor(output_tensor, input_tensor, *args, **kwargs)
        shadow = getattr(input_tensor, "_shadow", None)
        if shadow is not None and output_tensor.numel() == num_gpus * input_tensor.numel():
            output_tensor._shadow = shadow.reshape(-1).repeat(num_gpus).reshape(output_tensor.shape)
        value = getattr(input_tensor, "_simulated_value", None)
        if value is not None:
            output_tensor._simulated_value = value
        return work

    patches = [(PartialState, "_prepare_backend", staticmethod(backend)),
               (training_args, "is_torch_bf16_gpu_available", lambda: True),
               (torch.Tensor, "data_ptr", meta_data_ptr), (dist, "all_gather_into_tensor", gathered)]
    os.environ.update(environment)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with attributes_set(patches):
            yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(saved)


def stream_name():
    """The stream the code runs on (FSDP2 on meta switches torch.cpu's streams): 0 for the default one."""
    import torch

    current = torch.cpu.current_stream()
    return 0 if current is torch.cpu._default_cpu_stream else id(current)


@contextlib.contextmanager
def arrivals(tracker):
    """The places where a model given on the host arrives on the GPU, counted from then on by `tracker` (see
    `pipeline.simulate.memory.tracker`): the Trainer's `_move_model_to_device` (DDP) and accelerate's
    `prepare_model` of a reference model in evaluation mode (a copy of each host tensor, as `.to("cuda")`
    makes one), and `fully_shard` (FSDP2 moves a module's host tensors to the GPU, then shards them, on the
    GPU); DDP's wrapper on meta (`MetaDistributedDataParallel`) made on the GPU too."""
    import torch
    import torch.distributed.fsdp as fsdp
    import torch.distributed.fsdp._fully_shard._fsdp_init as fsdp_init
    import torch.distributed.fsdp._fully_shard._fully_shard as fully_shard_module
    from accelerate import Accelerator
    from transformers import Trainer

    def move_model(self, model, device):
        arrive(tracker, list(model.parameters()) + list(model.buffers()))

    prepare_model = Accelerator.prepare_model

    def prepare_reference(self, model, device_placement=None, evaluation_mode=False):
        if evaluation_mode:
            move_model(None, model, None)
        return prepare_model(self, model, device_placement, evaluation_mode)

    shard = fsdp.fully_shard

    def fully_shard(*args, **kwargs):
        with tracker.placed(host=False):
            return shard(*args, **kwargs)

    def move_states(params, buffers, device):
        arrive(tracker, [*params, *buffers])

    # FSDP2's move lives in _fsdp_init (torch 2.14) or in _fully_shard (earlier): patched where it is called
    patches = [(module, "_move_states_to_device", move_states) for module in (fsdp_init, fully_shard_module)
               if hasattr(module, "_move_states_to_device")]
    patches += [(fsdp, "fully_shard", fully_shard), (Trainer, "_move_model_to_device", move_model),
               (Accelerator, "prepare_model", prepare_reference),
               (torch.nn.parallel, "DistributedDataParallel", meta_ddp_class(tracker))]
    with attributes_set(patches):
        yield


def arrive(tracker, tensors) -> None:
    """Host tensors copied to the GPU (each its own copy, as `.to("cuda")` makes), counted by `tracker` from then on."""
    import torch

    with torch.no_grad():
        for tensor in tensors:
            if tracker.is_counted(tensor):
                continue
            with tracker.placed(host=True):  # a view of the host tensor is the host's
                source = tensor.detach()
            with tracker.placed(host=False):
                tensor.data = source.clone()


def meta_ddp_class(tracker):
    """DistributedDataParallel as accelerate makes it (`device_ids=[local rank]`, the Trainer's kwargs) for a
    model on meta: without device ids (meta has none), with the fake process group's all-reduce hook, its
    buckets made on the GPU under the role ddp_buckets (and rebuilt there in the second step)."""
    from torch.nn.parallel import DistributedDataParallel

    from pipeline.training.sharding import fake_allreduce_hook, shapes_unverified

    class MetaDistributedDataParallel(DistributedDataParallel):
        def __init__(self, module, device_ids=None, output_device=None, **kwargs):
            with tracker.placed(host=False), tracker.scope("ddp_buckets"), shapes_unverified():
                super().__init__(module, **kwargs)
            self.register_comm_hook(None, fake_allreduce_hook)
            self._pre_forward = tracker.scoped(self._pre_forward, "ddp_buckets")

    return MetaDistributedDataParallel
