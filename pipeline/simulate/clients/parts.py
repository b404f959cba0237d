"""The transformers.Trainer of `client = trainer` on a model of the meta device (imported only by
`pipeline.simulate.clients.trainer`'s heavy path: it imports transformers and accelerate)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Mapping

import torch
from transformers import Trainer, TrainingArguments

from pipeline.core.vocabulary import precision_mode
from pipeline.training.step import STEPS, autocast_dtype, mixed_precision_args


@contextlib.contextmanager
def host_tensors():
    """`torch.tensor(data, device=meta)` as a host tensor copied to the device: the copy is counted, as CUDA
    allocates it, and carries its host values (on meta the tensor would be made without any dispatched op): a
    number's as its known value (SFTTrainer's token count, `.item()`-ed for its log), a list's as a host shadow
    where the trace keeps them (generation's token ids). The module's function is replaced for the run (a torch
    function mode would see every call of every op)."""
    original = torch.tensor

    def tensor(data, *args, device=None, **kwargs):
        if device is None or torch.device(device).type != "meta":
            return original(data, *args, device=device, **kwargs)
        moved = original(data, *args, **kwargs).to(device)
        if isinstance(data, (bool, int, float)):
            moved._simulated_value = data
        return moved

    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = original


class ModelStaysInPlace:
    """Training arguments (the Trainer's, SFTConfig, DPOConfig) that leave the model where it is: it lives on
    the meta device. On several GPUs the Trainer decides, as it does on GPUs (None: DDP moves the model with
    `_move_model_to_device`, which the several-GPU wing counts as the model's arrival on the GPU; FSDP does not)."""

    @property
    def place_model_on_device(self) -> bool | None:
        return False if self.world_size == 1 else None


class InputsOnSimulatedDevice:
    """A trainer (the Trainer, SFTTrainer, DPOTrainer) whose inputs go to its `simulated_device` (accelerate's
    dataloader does it on a GPU; here the accelerator runs on the CPU)."""

    def _prepare_input(self, data):
        if isinstance(data, Mapping):
            return type(data)({k: self._prepare_input(v) for k, v in data.items()})
        if isinstance(data, (tuple, list)):
            return type(data)(self._prepare_input(v) for v in data)
        if isinstance(data, torch.Tensor):
            return data.to(self.simulated_device)
        return data


def on_simulated_device(trainer_class, arguments_class) -> tuple[type, type]:
    """(trainer, arguments) subclasses of a Trainer and its arguments class for a model on the simulated device."""
    return (type(f"Meta{trainer_class.__name__}", (InputsOnSimulatedDevice, trainer_class), {}),
            type(f"Meta{arguments_class.__name__}", (ModelStaysInPlace, arguments_class), {}))


class MetaTrainingArguments(ModelStaysInPlace, TrainingArguments):
    """The client's arguments; the model is not moved."""


class MetaTrainer(InputsOnSimulatedDevice, Trainer):
    """The Trainer with its inputs placed on the model's device."""


def device_arguments(setting, model) -> dict:
    """What the simulated trainer's arguments say of the device: on one GPU use_cpu=True (the accelerator must
    not ask for a GPU; its autocast and scaler are made CUDA's by `prepare_for_training`); on several GPUs the
    sharding's keys (`pipeline.training.sharding.sharding_arguments`), with accelerate told that it runs on N
    GPUs (`pipeline.simulate.distributed.world.accelerate_on_gpus`)."""
    if setting is None or setting.sharding is None:
        return {"use_cpu": True}
    from pipeline.training.sharding import sharding_arguments

    return sharding_arguments(setting, model)


def meta_trainer(model, batch_size: int, precision: str, optim: str, gradient_accumulation: int,
                 gradient_checkpointing: bool, device_type: str, liger_kernel: bool = False,
                 setting=None) -> MetaTrainer:
    """`pipeline.measure.clients.trainer.training_arguments` for the simulated device (`device_arguments`),
    the model left where it is."""
    output_dir = tempfile.mkdtemp(prefix="avp-simtrainer-")
    args = MetaTrainingArguments(output_dir=output_dir, per_device_train_batch_size=batch_size, max_steps=STEPS,
                                 gradient_accumulation_steps=gradient_accumulation,
                                 **mixed_precision_args(precision),
                                 gradient_checkpointing=gradient_checkpointing, optim=optim,
                                 use_liger_kernel=liger_kernel, save_strategy="no", disable_tqdm=True,
                                 report_to="none", **device_arguments(setting, model),
                                 **(setting.hyperparameters.arguments() if setting is not None else {}))
    trainer = MetaTrainer(model=model, args=args)
    simulated_on(trainer, device_type, setting)
    return trainer


def simulated_on(trainer, device_type: str, setting=None) -> None:
    """The simulated device of `trainer`, and the steps its schedule is made for (`_prepare_for_training`'s
    max_steps: the training file's max_steps, else the three simulated)."""
    trainer.simulated_device = torch.device(device_type)
    trainer.simulated_total_steps = setting.hyperparameters.total_steps(STEPS) if setting is not None else STEPS


def enable_checkpointing(trainer: Trainer, model) -> None:
    """What `Trainer._inner_training_loop` does for `gradient_checkpointing=True`."""
    gc_kwargs = dict(trainer.args.gradient_checkpointing_kwargs or {})
    every_n_layers = gc_kwargs.pop("every_n_layers", 1)
    offload = gc_kwargs.pop("offload", False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs or None,
                                        every_n_layers=every_n_layers, offload=offload)


def prepare_for_training(trainer: Trainer, rules, precision: str, prepared_before: bool = False):
    """The Trainer's own `_prepare_for_training` (`create_optimizer`, `accelerator.prepare` of the model and the
    optimizer: DDP's wrapper or FSDP2's sharding on several GPUs, then the scheduler), as `_inner_training_loop`
    calls it; returns the model the steps call (`model_wrapped`). On the simulated device: no device placement
    (the model stays where it is); accelerate's autocast wrapper CUDA's (`cuda_autocast_preparation`); amp-fp16's
    scaler the one accelerate makes on a GPU (`torch.amp.GradScaler("cuda")`, defaults) on the simulated device;
    torch's optimizers foreach on meta (CUDA's default; meta tensors have none). `prepared_before`: the model
    carries accelerate's `_is_accelerate_prepared` from an earlier Trainer, so `prepare_model` leaves its forward
    unwrapped (no autocast)."""
    accelerator = trainer.accelerator
    accelerator.device_placement = False
    if precision_mode(precision).scaler:
        accelerator.scaler = torch.amp.GradScaler(trainer.simulated_device.type)
    if prepared_before:
        trainer.model._is_accelerate_prepared = True
    create = type(trainer).create_optimizer

    def create_optimizer(model=None):
        optimizer = create(trainer, model)
        if trainer.simulated_device.type == "meta":
            for group in getattr(optimizer, "param_groups", ()):  # DeepSpeed's DummyOptim has none
                if group.get("foreach", False) is None and not group.get("fused"):
                    group["foreach"] = True
        return optimizer

    trainer.create_optimizer = create_optimizer
    try:
        with cuda_autocast_preparation(accelerator, rules, precision):
            model, _ = trainer._prepare_for_training(trainer.simulated_total_steps, None, None)
    finally:
        del trainer.create_optimizer
    return model


@contextlib.contextmanager
def cuda_autocast_preparation(accelerator, rules, precision: str):
    """accelerate's model preparation as on a GPU: its autocast wrapper of the forward (`native_amp`,
    which accelerate on a CPU decides by the CPU's bf16 support, or never for fp16) with CUDA's autocast
    emulated by `rules` in the precision's autocast dtype."""
    import accelerate.accelerator as accelerator_module

    dtype = autocast_dtype(precision)
    if dtype is not None:
        accelerator.native_amp = True
    dtype = dtype or torch.bfloat16
    original = accelerator_module.get_mixed_precision_context_manager
    accelerator_module.get_mixed_precision_context_manager = lambda *a, **k: rules.autocast(dtype)
    try:
        yield
    finally:
        accelerator_module.get_mixed_precision_context_manager = original


def restore(model, trainer) -> None:
    """The model as built: without accelerate's wrapper of its forward and its mark
    `_is_accelerate_prepared` (with it, the next Trainer's `prepare_model` returns the model as it is:
    no autocast wrapper, so an amp run computes in fp32), checkpointing off."""
    for name in ("forward", "_original_forward", "_is_accelerate_prepared"):
        model.__dict__.pop(name, None)
    if getattr(model, "is_gradient_checkpointing", False):
        model.gradient_checkpointing_disable()
    if type(model).__name__ == "DeepSpeedEngine":  # TRL's ZeRO-3 reference model: DeepSpeed's zero_grad
        model.zero_grad()
    else:
        model.zero_grad(set_to_none=True)
    if trainer is not None:
        with contextlib.suppress(Exception):
            trainer.accelerator.free_memory()
        with contextlib.suppress(OSError):
            import shutil

            shutil.rmtree(trainer.args.output_dir, ignore_errors=True)
