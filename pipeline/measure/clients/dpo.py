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

from pipeline.measure.clients.sft import train_trl
from pipeline.measure.clients.sft import unavailable as sft_unavailable
from pipeline.measure.clients.tracking import PhaseTracker
from pipeline.training.step import Setting


def unavailable(setting: Setting, device: str) -> str | None:
    """Why a DPO point cannot run here (the sft client's requirements: trl, datasets, peft, bitsandbytes,
    Liger, the optim's package), or None."""
    from pipeline.training.dpo import unavailable as dpo_unavailable

    return dpo_unavailable() or sft_unavailable(setting, device)


def run_steps(model, setting: Setting, precision: str, batch: int, seq: int, device: str,
              tracker: PhaseTracker, use_cache: bool):
    """DPOTrainer.train() for three optimizer steps; returns (seconds per step, optimizer-state bytes)
    and puts the trained model's trainable parameters in `tracker.extra`."""
    from trl import DPOTrainer

    from pipeline.inputs.modeling import vocabulary_size
    from pipeline.training.dpo import dataset_pairs, dpo_arguments, preference_dataset, reference_model
    from pipeline.training.sft import peft_config, tokenizer

    vocab = vocabulary_size(model)

    def make_trainer(output_dir, times, extra):
        return DPOTrainer(model=model, ref_model=reference_model(model, setting, device),
                          args=dpo_arguments(setting, precision, batch, seq, output_dir, **extra),
                          processing_class=tokenizer(vocab),
                          train_dataset=preference_dataset(vocab, dataset_pairs(setting, batch), seq,
                                                           setting.completion_share),
                          peft_config=peft_config(setting), callbacks=[times])

    return train_trl(model, setting, device, tracker, make_trainer, "avp-dpo-")
