"""client = trainer: transformers.Trainer on the already built model (docs/definitions.md):

    TrainingArguments(output_dir=<tmp>, per_device_train_batch_size=B, max_steps=3,
                      gradient_accumulation_steps=K, bf16=(the precision's autocast is bf16: amp-bf16,
                      bf16-autocast), fp16=(precision == "amp-fp16"), gradient_checkpointing=..., optim=...,
                      use_liger_kernel=..., save_strategy="no", disable_tqdm=True)

every other argument at its default. The two exceptions change no memory of a step:
save_strategy="no" (the default, "steps", saves a checkpoint after the last step: weights and
optimizer state written to disk, seconds of device time for an 8B model, and no part of a training
step) and disable_tqdm (the progress bar). On the CPU debug device, use_cpu=True: what the default
picks on a machine without a GPU. The data: B*K*3 fixed-length sequences of random ids below the
vocabulary size, labels = input_ids.

Phases, seen through a forward pre-hook and hook on the model and a TrainerCallback: `forward` from
the model's forward to its output (the loss included: labels are passed), `backward` from there to
the next micro-batch's forward or the optimizer step (gradient clipping and the scaler's unscale
included), `optimizer` from on_pre_optimizer_step to the next forward (scheduler, zero_grad, the
end of training), `setup` from train()'s start to the first forward. The peak is the max of all.
"""

from __future__ import annotations

import gc
import importlib.util
import tempfile
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from pipeline.measure.clients.tracking import PhaseTracker, optimizer_state_bytes, reserved_by_stream
from pipeline.training.liger import LigerPatches
from pipeline.training.sharding import sharding_arguments
from pipeline.inputs.modeling import vocabulary_size
from pipeline.training.step import STEPS, Setting, mixed_precision_args, set_training_mode

NEEDS_PACKAGE = {"adamw_bnb_8bit": "bitsandbytes"}


def unavailable(setting: Setting, device: str) -> str | None:
    package = NEEDS_PACKAGE.get(setting.optim)
    if package and importlib.util.find_spec(package) is None:
        return f"optim {setting.optim} needs {package}, which is not installed here"
    if setting.liger_kernel:
        from pipeline.training.liger import liger_unavailable

        return liger_unavailable(device)
    return None


class RandomTokens(torch.utils.data.Dataset):
    """Fixed-length sequences of random ids; each item's labels are its input_ids."""

    def __init__(self, ids):
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class StepTimes(TrainerCallback):
    """Seconds of each optimizer step (on_step_begin to on_step_end) and the optimizer phase's start; on
    several GPUs (`sharded`) the peak counter reset when training begins (on_train_begin: after the Trainer
    wrapped the model in DDP or sharded it with FSDP2 and made the optimizer)."""

    def __init__(self, tracker: PhaseTracker, device: str, sharded: bool = False):
        self.tracker, self.cuda, self.sharded = tracker, device == "cuda", sharded
        self.started, self.seconds = None, []

    def on_train_begin(self, args, state, control, **kwargs):
        if self.sharded:
            self.tracker.restart("setup")

    def on_train_end(self, args, state, control, **kwargs):
        """On several GPUs, what the process holds before the trainer lets go: its NVML figure and the
        allocator's segments (the memory outside PyTorch is the difference; the segments by stream)."""
        if self.sharded and self.cuda:
            from pipeline.measure.nvml import nvml_columns
            from pipeline.training import memory_history

            memory_history.mark("train_end")
            self.tracker.extra.update(nvml_train_end_bytes=nvml_columns("cuda")["nvml_used_bytes"],
                                      reserved_train_end_bytes=torch.cuda.memory_reserved(),
                                      reserved_by_stream=reserved_by_stream())

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.tracker.start("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self.started)


def training_arguments(setting: Setting, precision: str, batch: int, device: str, output_dir: str, model=None):
    """The point's TrainingArguments (`model`: the one trained, whose decoder layers FSDP2 wraps)."""
    extra = {"use_cpu": True} if device == "cpu" else {}
    extra.update(sharding_arguments(setting, model), **setting.hyperparameters.arguments())
    return TrainingArguments(output_dir=output_dir, per_device_train_batch_size=batch, max_steps=STEPS,
                             gradient_accumulation_steps=setting.gradient_accumulation,
                             **mixed_precision_args(precision),
                             gradient_checkpointing=setting.gradient_checkpointing, optim=setting.optim,
                             use_liger_kernel=setting.liger_kernel, save_strategy="no", disable_tqdm=True, **extra)


def random_tokens(model, batch: int, seq: int, setting: Setting) -> RandomTokens:
    count = batch * setting.gradient_accumulation * STEPS
    return RandomTokens(torch.randint(0, vocabulary_size(model), (count, seq)))


def run_steps(model, setting: Setting, precision: str, batch: int, seq: int, device: str,
              tracker: PhaseTracker, use_cache: bool):
    """Trainer.train() for three optimizer steps; returns (seconds per step, optimizer-state bytes)."""
    def make_trainer(output_dir, times):
        return Trainer(model=model, args=training_arguments(setting, precision, batch, device, output_dir, model),
                       train_dataset=random_tokens(model, batch, seq, setting), callbacks=[times])

    return train_phased(model, setting, device, tracker, make_trainer, "avp-trainer-", restore)


def train_phased(model, setting: Setting, device: str, tracker: PhaseTracker, make_trainer, prefix: str,
                 restore_model, grad_only_hooks: bool = False):
    """A trainer's train() (the trainer, sft and dpo clients): `make_trainer(output_dir, times)` builds it on
    `model` under Liger's patches when asked; phases from hooks on the model it trains; returns (seconds per
    step, optimizer-state bytes). A trainer that wraps adapters itself (TRL's peft_config) puts the trained
    model's trainable parameters in `tracker.extra`. Afterwards `restore_model(model)`."""
    from pipeline.training.adapters import trainable_parameters

    set_training_mode(model, Setting())  # checkpointing off: the trainer switches it on when asked
    times = StepTimes(tracker, device, sharded=setting.sharding is not None)
    trainer, hooks = None, []
    try:
        with tempfile.TemporaryDirectory(prefix=prefix) as output_dir, LigerPatches(model):
            trainer = make_trainer(output_dir, times)
            trained = trainer.model
            hooks = [trained.register_forward_pre_hook(phase_hook(tracker, "forward", grad_only_hooks)),
                     trained.register_forward_hook(phase_hook(tracker, "backward", grad_only_hooks))]
            if setting.adapter is not None and trained is not model:
                tracker.extra["trainable_parameters"] = trainable_parameters(trained)
            tracker.start("setup")
            trainer.train()
            tracker.stop()
            return times.seconds, optimizer_state_bytes(trainer.optimizer, device)
    finally:
        for hook in hooks:
            hook.remove()
        if trainer is not None:
            trainer.accelerator.free_memory()
        trainer = None
        restore_model(model)
        gc.collect()  # the trainer's reference cycles hold the optimizer, its state (and DPO's reference model)


def phase_hook(tracker: PhaseTracker, phase: str, grad_only: bool):
    """A hook starting `phase` (`grad_only`: only for a forward with grad enabled)."""
    import torch

    def hook(*_):
        if not grad_only or torch.is_grad_enabled():
            tracker.start(phase)

    return hook


def restore(model) -> None:
    """The model as built: without accelerate's autocast wrapper of its forward and its mark
    `_is_accelerate_prepared` (left set, the next Trainer's `prepare_model` skips the autocast wrapper:
    the next point of the process computes in fp32), checkpointing off."""
    for name in ("forward", "_original_forward", "_is_accelerate_prepared"):
        model.__dict__.pop(name, None)
    set_training_mode(model, Setting())
