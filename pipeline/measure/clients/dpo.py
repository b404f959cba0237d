"""client = dpo: TRL's DPOTrainer on the already built model (docs/definitions.md; its arguments, data and
reference model are `pipeline.training.dpo`'s): `DPOConfig(per_device_train_batch_size=B, max_length=L,
max_steps=3, ...)`, TRL's defaults otherwise, on B x K x 3 preference pairs of random words (2B
sequences of L tokens a step); without adapters a reference model built beside the policy (a second
copy in its dtype, given as `ref_model`), with adapters none (they go in as `peft_config`: DPOTrainer
wraps the base, which serves as the reference with the adapters disabled; a point with adapters gets a
base of its own, `pipeline.measure.point`).

Phases as the sft client's (`pipeline.measure.clients.sft`): a forward pre-hook and hook on the trained
model and the optimizer callback; the peak counter is reset right before `train()`, so the peak holds
the policy's and the reference's weights. Afterwards the model is as it was (`LigerPatches`: the fused
LM head, accelerate's autocast wrapper, dropout's rates that DPOTrainer set to 0, Liger's kernels) and
the reference model is gone.
"""

from __future__ import annotations

import gc
import tempfile

from pipeline.measure.clients.sft import unavailable as sft_unavailable
from pipeline.measure.clients.tracking import PhaseTracker, optimizer_state_bytes
from pipeline.measure.clients.trainer import StepTimes
from pipeline.training.step import Setting, set_training_mode


def unavailable(setting: Setting, device: str) -> str | None:
    """Why a DPO point cannot run here (the sft client's requirements: trl, datasets, peft, bitsandbytes,
    Liger, the optim's package), or None."""
    from pipeline.training.dpo import unavailable as dpo_unavailable

    return dpo_unavailable() or sft_unavailable(setting, device)


def run_steps(model, setting: Setting, precision: str, batch: int, seq: int, device: str,
              tracker: PhaseTracker, use_cache: bool):
    """DPOTrainer.train() for three optimizer steps; returns (seconds per step, optimizer-state bytes)
    and puts the trained model's trainable parameters in `tracker.extra`."""
    import datasets
    from trl import DPOTrainer

    from pipeline.inputs.modeling import vocabulary_size
    from pipeline.training.adapters import trainable_parameters
    from pipeline.training.dpo import dataset_pairs, dpo_arguments, preference_dataset, reference_model
    from pipeline.training.liger import LigerPatches
    from pipeline.training.sft import peft_config, tokenizer

    datasets.disable_progress_bars()
    set_training_mode(model, Setting())  # checkpointing off: DPOTrainer switches it on when asked
    times = StepTimes(tracker, device)
    trainer, reference, hooks = None, None, []
    vocab = vocabulary_size(model)
    extra = {"use_cpu": True} if device == "cpu" else {}
    try:
        with tempfile.TemporaryDirectory(prefix="avp-dpo-") as output_dir, LigerPatches(model):
            reference = reference_model(model, setting, device)
            trainer = DPOTrainer(model=model, ref_model=reference,
                                 args=dpo_arguments(setting, precision, batch, seq, output_dir, **extra),
                                 processing_class=tokenizer(vocab),
                                 train_dataset=preference_dataset(vocab, dataset_pairs(setting, batch), seq,
                                                                  setting.completion_share),
                                 peft_config=peft_config(setting), callbacks=[times])
            trained = trainer.model
            hooks = [trained.register_forward_pre_hook(lambda *_: tracker.start("forward")),
                     trained.register_forward_hook(lambda *_: tracker.start("backward"))]
            if setting.adapter is not None:
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
        trainer = reference = None
        set_training_mode(model, Setting())
        gc.collect()  # the Trainer's reference cycles hold the optimizer, its state and the reference model
