"""`dpo_peak`: the peak memory of `client = dpo` (TRL's DPOTrainer, `pipeline.training.dpo`; the GPU run is
`pipeline.measure.clients.dpo`) on meta tensors.

The real DPOTrainer is built (`DPOTrainer.__init__`: its tokenization of the preference pairs with
`datasets`, PEFT's wrapping through `peft_config` and the bf16 cast of the adapters on a 4-bit base, its
collator, the fused LM head on the policy and on the reference model, dropout disabled) and its training
steps run (`compute_loss`: the policy's forward over the 2B sequences with the fused head scoring the
completions, the reference's forward under no_grad with checkpointing off, the sigmoid loss, the reward
and accuracy metrics) in the order `pipeline.simulate.clients.trainer.TrainerRun` runs transformers.Trainer's
loop, under the same trace as SFTTrainer's (`pipeline.simulate.clients.sft`). What differs from a CUDA run,
besides the SFTTrainer simulator's stand-ins:

- the reference model is given as `ref_model` (a second copy of the policy built on meta, or none with
  adapters: the base with the adapters disabled), as the GPU client gives it;
- DPOTrainer prepares the reference in its `__init__` (`accelerator.prepare_model(ref, evaluation_mode=True)`):
  there without device placement (the model stays on meta) and with CUDA's autocast, as the policy is
  prepared (`parts.cuda_autocast_preparation`; on a CPU accelerate would wrap it in the CPU's);
- around each reference forward DPOTrainer switches the policy's checkpointing off and on again, which
  makes a new checkpoint function: the kernel rules' wrapper (recompute under the forward's autocast)
  is put back before each policy forward;
- the metrics' `.item()` of floating-point values (logged, never used for memory) answer 0.0.
"""

from __future__ import annotations

import contextlib

from pipeline.simulate.clients.sft import SFTRun, trl_peak
from pipeline.training.step import Setting
from pipeline.training.values import Estimate, Run


def dpo_peak(config, run: Run) -> Estimate:
    """DPOTrainer's `train()` for three optimizer steps of `run.gradient_accumulation` micro-batches of
    `run.batch` preference pairs (2B sequences of `run.seq` tokens) of `config` on meta tensors (client dpo:
    `run.checkpointing`, `run.optim`, `run.liger_kernel`, `run.completion_share`, `run.adapter` as
    peft_config on a base in the precision's dtype, or 4-bit; without adapters a reference model beside
    the policy), answered as `loop_peak` answers; `trainable_parameters` in details with adapters."""
    from pipeline.training.dpo import reference_model, unavailable

    def make_trainer(model, setting, trace):
        reference = reference_model(model, setting, "meta")
        return meta_dpo_trainer(model, reference, setting, run.precision, run.batch, run.seq, "meta", trace.rules)

    return trl_peak(config, run, "dpo", unavailable, DPORun, make_trainer)


def meta_dpo_trainer(model, reference, setting: Setting, precision: str, batch: int, seq: int, device_type: str,
                     rules):
    """DPOTrainer with `pipeline.training.dpo.dpo_arguments` for the simulated device (`parts.device_arguments`)
    on `model` and its `reference` (None with adapters), both left where they are, its inputs placed on
    `device_type`; the reference prepared with CUDA's autocast of `rules`."""
    import tempfile

    import datasets
    from trl import DPOConfig, DPOTrainer

    from pipeline.inputs.modeling import vocabulary_size
    from pipeline.simulate.clients.parts import device_arguments, on_simulated_device, simulated_on
    from pipeline.training.dpo import dataset_pairs, dpo_arguments, preference_dataset
    from pipeline.training.sft import peft_config, tokenizer

    MetaDPOTrainer, MetaDPOConfig = on_simulated_device(DPOTrainer, DPOConfig)
    datasets.disable_progress_bars()
    vocab = vocabulary_size(model)
    args = dpo_arguments(setting, precision, batch, seq, tempfile.mkdtemp(prefix="avp-simdpo-"), MetaDPOConfig,
                         **device_arguments(setting, model))
    with references_prepared(rules, precision):
        trainer = MetaDPOTrainer(model=model, ref_model=reference, args=args, processing_class=tokenizer(vocab),
                                 train_dataset=preference_dataset(vocab, dataset_pairs(setting, batch), seq,
                                                                  setting.completion_share),
                                 peft_config=peft_config(setting))
    simulated_on(trainer, device_type, setting)
    return trainer


@contextlib.contextmanager
def references_prepared(rules, precision: str):
    """accelerate's `prepare_model` in evaluation mode (DPOTrainer's preparation of its reference model)
    without device placement and with CUDA's autocast (`parts.cuda_autocast_preparation`)."""
    from accelerate import Accelerator

    from pipeline.simulate.clients.parts import cuda_autocast_preparation

    original = Accelerator.prepare_model

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if not evaluation_mode:
            return original(self, model, device_placement, evaluation_mode)
        with cuda_autocast_preparation(self, rules, precision):
            return original(self, model, device_placement=False, evaluation_mode=True)

    Accelerator.prepare_model = prepare_model
    try:
        yield
    finally:
        Accelerator.prepare_model = original


class DPORun(SFTRun):
    """`TrainerRun` with a DPOTrainer: the micro-batches are B preference pairs of its prepared dataset through
    its collator (2B sequences); the reference model is counted beside the policy."""

    columns = ("prompt_ids", "chosen_ids", "rejected_ids")

    def models(self) -> list:
        reference = getattr(self.trainer, "ref_model", None)
        return [self.model] + ([reference] if reference is not None else [])

    def attach(self, rules, tracker) -> None:
        super().attach(rules, tracker)
        if self.checkpointing:  # DPOTrainer re-enables checkpointing after each reference forward
            self.hooks.append(self.model.register_forward_pre_hook(lambda *_: rules.wrap_checkpointing(self.model)))

    def close(self) -> None:
        from pipeline.simulate.clients.parts import restore

        reference = getattr(self.trainer, "ref_model", None) if self.trainer is not None else None
        super().close()
        if reference is not None:
            restore(reference, None)
