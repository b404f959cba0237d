"""client = sft: TRL's SFTTrainer on the already built model (docs/definitions.md; its arguments, tokenizer
and dataset are `pipeline.training.sft`'s): `SFTConfig(per_device_train_batch_size=B, max_length=L,
max_steps=3, ...)`, TRL's defaults otherwise, on B x K x 3 pre-tokenized rows of random ids (with a
completion mask when the completion share is below 1); adapters go in as `peft_config`, so SFTTrainer
wraps the model itself (a point with adapters gets a base of its own, `pipeline.measure.point`).

Phases as the trainer client's (`pipeline.measure.clients.trainer`): a forward pre-hook and hook on the
model (the PeftModel SFTTrainer made, with adapters) and the optimizer callback. The peak counter is
reset right before `train()`. Afterwards the model is as it was: SFTTrainer's fused LM head and
accelerate's autocast wrapper of the forward, checkpointing and Liger's kernels (its rebound module
globals included) are taken off (`pipeline.training.liger.LigerPatches`).
"""

from __future__ import annotations

from pipeline.measure.clients.tracking import PhaseTracker
from pipeline.measure.clients.trainer import NEEDS_PACKAGE, train_phased
from pipeline.training.step import Setting, set_training_mode


def unavailable(setting: Setting, device: str) -> str | None:
    import importlib.util

    from pipeline.training.sft import unavailable as sft_unavailable

    reason = sft_unavailable()
    if reason:
        return reason
    if setting.adapter is not None and importlib.util.find_spec("peft") is None:
        return "adapters need peft, which is not installed here"
    if setting.adapter is not None and setting.adapter.quantization and importlib.util.find_spec("bitsandbytes") is None:
        return f"quantization {setting.adapter.quantization} needs bitsandbytes, which is not installed here"
    if setting.liger_kernel:
        from pipeline.training.liger import liger_unavailable

        reason = liger_unavailable(device)
        if reason:
            return reason
    package = NEEDS_PACKAGE.get(setting.optim)
    if package and importlib.util.find_spec(package) is None:
        return f"optim {setting.optim} needs {package}, which is not installed here"
    return None


def run_steps(model, setting: Setting, precision: str, batch: int, seq: int, device: str,
              tracker: PhaseTracker, use_cache: bool):
    """SFTTrainer.train() for three optimizer steps; returns (seconds per step, optimizer-state bytes)
    and puts the trained model's trainable parameters in `tracker.extra`."""
    from trl import SFTTrainer

    from pipeline.inputs.modeling import vocabulary_size
    from pipeline.training.sft import peft_config, sft_arguments, tokenizer, train_dataset

    vocab = vocabulary_size(model)

    def make_trainer(output_dir, times, extra):
        return SFTTrainer(model=model, args=sft_arguments(setting, precision, batch, seq, output_dir, **extra),
                          processing_class=tokenizer(vocab),
                          train_dataset=train_dataset(setting, vocab, batch, seq),
                          peft_config=peft_config(setting), callbacks=[times])

    return train_trl(model, setting, device, tracker, make_trainer, "avp-sft-")


def train_trl(model, setting: Setting, device: str, tracker: PhaseTracker, make_trainer, prefix: str,
              grad_only_hooks: bool = False):
    """A TRL trainer's train() (the sft and dpo clients) through `trainer.train_phased`: `make_trainer(output_dir,
    times, extra)` builds it on `model` (`extra`: use_cpu on a CPU). Afterwards the model is as it was.
    `grad_only_hooks`: forward and backward are the forwards with grad enabled (GRPO generates under no_grad)."""
    import datasets

    from pipeline.training.sharding import sharding_arguments

    datasets.disable_progress_bars()
    extra = {"use_cpu": True} if device == "cpu" else {}
    extra.update(sharding_arguments(setting, model))
    return train_phased(model, setting, device, tracker, lambda output_dir, times: make_trainer(output_dir, times, extra),
                        prefix, lambda built: set_training_mode(built, Setting()), grad_only_hooks)
