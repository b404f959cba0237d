"""client = grpo | rloo: TRL's GRPOTrainer / RLOOTrainer on the already built model (docs/grpo.md; its arguments,
prompts, reward and reference model are `pipeline.training.grpo`'s), generation by transformers' `generate`.

Phases: `setup`, `generation` (from `_generate`'s start: the rollout, the rewards), `log-probs` (the no-grad
passes of the reference and the old policy), `forward` and `backward` (hooks on the trained model, with grad
enabled only: generation's forwards run under no_grad), `optimizer` (the callback). `tracker.extra["step_peaks"]`:
the peak allocated so far at the end of each optimizer step (whether the peak moves after the first step).
"""

from __future__ import annotations

from pipeline.measure.clients.sft import unavailable as sft_unavailable
from pipeline.measure.clients.tracking import PhaseTracker
from pipeline.training.step import Setting


def unavailable(setting: Setting, device: str) -> str | None:
    from pipeline.training.grpo import unavailable as rollout_unavailable

    if setting.rollout is not None and setting.rollout.use_vllm:
        return "use_vllm: vLLM is not installed on the measuring machine (too large to carry); generation by transformers"
    return rollout_unavailable(setting.client) or sft_unavailable(setting, device)


def run_steps(model, setting: Setting, precision: str, batch: int, seq: int, device: str,
              tracker: PhaseTracker, use_cache: bool):
    """GRPOTrainer.train() (RLOOTrainer's) for three optimizer steps; returns (seconds per step, optimizer-state
    bytes)."""
    from pipeline.inputs.modeling import vocabulary_size
    from pipeline.measure.clients.sft import train_trl
    from pipeline.training.grpo import (ReferenceBuilt, check, dataset_prompts, eos_out_of_reach,
                                        generation_cache, length_reward, mark_phases, prompt_dataset,
                                        rollout_arguments, tokenizer, trainer_class)
    from pipeline.training.sft import peft_config

    import torch.distributed as dist

    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    check(setting.client, setting.rollout, batch, setting.gradient_accumulation, seq, ranks)
    vocab = vocabulary_size(model)
    eos_out_of_reach(model, vocab)
    generation_cache(model, setting)

    def make_trainer(output_dir, times, extra):
        with ReferenceBuilt(model, device):
            trainer = trainer_class(setting.client)(
                model=model, reward_funcs=length_reward, processing_class=tokenizer(vocab),
                args=rollout_arguments(setting, precision, batch, output_dir, **extra),
                train_dataset=prompt_dataset(vocab, dataset_prompts(setting, batch), seq),
                peft_config=peft_config(setting), callbacks=[times, StepPeaks(tracker)])
        mark_phases(trainer, tracker.start)
        return trainer

    return train_trl(model, setting, device, tracker, make_trainer, f"avp-{setting.client}-",
                     grad_only_hooks=True)


def StepPeaks(tracker: PhaseTracker):
    """A callback writing the peak allocated so far at each optimizer step's end to `tracker.extra`."""
    from transformers import TrainerCallback

    class Callback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            import torch

            if torch.cuda.is_available():
                seen = max([*tracker.peaks.values(), torch.cuda.max_memory_allocated()])
                tracker.extra.setdefault("step_peaks", []).append(int(seen))

    return Callback()
