"""`rollout_peak`: the peak memory of `client = grpo | rloo` (TRL's GRPOTrainer / RLOOTrainer,
`pipeline.training.grpo`; the GPU run is `pipeline.measure.clients.grpo`) on meta tensors.

The real trainer is built (its prompt dataset, PEFT's wrapping, the reference model when beta > 0 and no
adapters, the fused LM head of the log-prob passes) and its training steps run in the order
`pipeline.simulate.clients.trainer.TrainerRun` runs transformers.Trainer's loop: at the first micro-batch of a
generation, `_generate_and_score_completions` (transformers' `generate` with its KV cache over the generation
batch, the rewards, the reference's and, with num_iterations > 1, the old policy's log-probs under no_grad), then
each micro-batch's `compute_loss` and backward, the optimizer. What differs from a CUDA run, besides the SFTTrainer
simulator's stand-ins (`pipeline.simulate.clients.sft`):

- the sampler: `torch.multinomial` (and `argmax` for greedy decoding) draws token `training.grpo.TOKEN` for every
  sequence, a host value the meta output carries; the real run's tokenizer has its end-of-sequence word outside
  the model's vocabulary, so both run every completion to max_completion_length;
- small tensors made from host values (`torch.tensor(ids, device=...)`, `torch.ones`, `torch.full`) carry them
  (`Shadows(host_values=True)`): the token ids, the stopping flags, the completion masks are known exactly, and
  `.cpu()` of the completions answers with them, so TRL decodes them, scores them with the reward function and
  pads them as on a GPU;
- `accelerator.device` is the simulated device (TRL places its tensors there);
- the reference model is built from the policy's config (`training.grpo.ReferenceBuilt`).
"""

from __future__ import annotations

import contextlib

from pipeline.simulate.clients.sft import SFTRun, trl_peak
from pipeline.training.step import Setting
from pipeline.training.values import Estimate, Run

PHASES = ("setup", "generation", "log-probs", "forward", "backward", "optimizer")


def rollout_peak(config, run: Run) -> Estimate:
    """GRPOTrainer's (RLOOTrainer's) `train()` for three optimizer steps (more where a generation serves several:
`training.grpo.rollout_steps`) of `run.gradient_accumulation` micro-batches
    of `run.batch` completions of prompts of `run.seq` tokens, `run.rollout` as their config has it, on meta
    tensors; answered as `loop_peak` answers, with the phase of the peak among generation, log-probs, forward,
    backward and optimizer."""
    from pipeline.core.errors import UserError
    from pipeline.training.grpo import check, unavailable

    check(run.client, run.rollout, run.batch, run.gradient_accumulation, run.seq)  # one GPU

    def make_trainer(model, setting, trace):
        return meta_rollout_trainer(model, setting, run.precision, run.batch, run.seq, "meta", trace.rules)

    return trl_peak(config, run, run.client, lambda: unavailable(run.client), RolloutRun, make_trainer,
                    host_values=True, stand_ins=sampler_stand_ins())


def meta_rollout_trainer(model, setting: Setting, precision: str, batch: int, seq: int, device_type: str, rules):
    """GRPOTrainer / RLOOTrainer with `training.grpo.rollout_arguments` for the simulated device, the model left
    where it is, its tensors placed on `device_type`."""
    import tempfile

    import datasets

    from pipeline.inputs.modeling import vocabulary_size
    from pipeline.simulate.clients.dpo import references_prepared
    from pipeline.simulate.clients.parts import device_arguments, on_simulated_device, simulated_on
    from pipeline.training.grpo import (ReferenceBuilt, config_class, dataset_prompts, eos_out_of_reach,
                                        generation_cache, length_reward, prompt_dataset, rollout_arguments,
                                        tokenizer, trainer_class)
    from pipeline.training.sft import peft_config

    MetaTrainer, MetaConfig = on_simulated_device(trainer_class(setting.client), config_class(setting.client))
    datasets.disable_progress_bars()
    vocab = vocabulary_size(model)
    eos_out_of_reach(model, vocab)
    generation_cache(model, setting)
    args = rollout_arguments(setting, precision, batch, tempfile.mkdtemp(prefix=f"avp-sim{setting.client}-"),
                             MetaConfig, **device_arguments(setting, model))
    with ReferenceBuilt(model, device_type), references_prepared(rules, precision):
        trainer = MetaTrainer(model=model, reward_funcs=length_reward, args=args, processing_class=tokenizer(vocab),
                              train_dataset=prompt_dataset(vocab, dataset_prompts(setting, batch), seq),
                              peft_config=peft_config(setting))
    simulated_on(trainer, device_type, setting)
    on_device(trainer.accelerator, device_type, rules, precision)
    if setting.rollout.use_vllm:
        generated_elsewhere(trainer, setting.rollout)
    return trainer


class VLLMStandIn:
    """TRL's `VLLMGeneration` as the training process sees it: the completions arrive as host lists of token ids
    (every one max_completion_length long, as the simulated sampler's), each token with its sampling log-prob.
    vLLM's own memory is not the training process's allocations: in colocate mode the verdict counts its pool
    beside them (`pipeline.estimate.verdict.vllm_pool_bytes`); its weight sync is not modelled."""

    def __init__(self, length: int):
        self.length = length

    def sync_weights(self) -> None:
        pass

    def generate(self, prompts, images, num_generations, profiler=None):
        from pipeline.training.grpo import TOKEN

        completions = [[TOKEN] * self.length for _ in prompts]
        return prompts, completions, [[[-1.0]] * self.length for _ in prompts], None


def generated_elsewhere(trainer, rollout) -> None:
    """The trainer as TRL builds it with `use_vllm=True` (built without: vLLM is not installed here): generation by
    `VLLMStandIn`, and the paths TRL takes for vLLM's completions (the old policy's log-probs for the importance
    sampling correction)."""
    trainer.use_vllm = True
    trainer.vllm_mode = rollout.vllm_mode or "colocate"
    trainer.vllm_generation = VLLMStandIn(trainer.max_completion_length)
    trainer._last_loaded_step = -1


def on_device(accelerator, device_type: str, rules, precision: str) -> None:
    """`accelerator.device` is `device_type` on meta (the accelerator itself runs on the CPU), and its `autocast()`
    (TRL's log-prob passes run in it) CUDA's autocast of the precision emulated by `rules`, as on a GPU."""
    import torch

    from pipeline.training.step import autocast_dtype

    dtype = autocast_dtype(precision)

    @contextlib.contextmanager
    def autocast(self, autocast_handler=None):
        with rules.autocast(dtype) if dtype is not None else contextlib.nullcontext():
            yield

    base = type(accelerator)
    members = {"autocast": autocast}
    if device_type == "meta":
        device = torch.device(device_type)
        members["device"] = property(lambda self: device)
    accelerator.__class__ = type(f"Simulated{base.__name__}", (base,), members)


def sampler_stand_ins() -> dict:
    """`torch.multinomial` and `torch.argmax` over a meta vocabulary: every row draws `training.grpo.TOKEN`, a host
    value its meta output carries (the allocation is the kernel's own)."""
    import torch

    from pipeline.training.grpo import TOKEN

    aten = torch.ops.aten

    def drawn(func, args, kwargs):
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.device.type == "meta" and out.dtype == torch.long:
            out._shadow = torch.full(out.shape, TOKEN, dtype=torch.long)
        return out

    return {aten.multinomial.default: drawn, aten.argmax.default: drawn}


def deepspeed_autocast(rules):
    """DeepSpeed's engine forward decides its autocast from the one around it (`torch.is_autocast_enabled()`) and
    opens `torch.autocast(<its accelerator's device>)`: here CUDA's autocast is `rules`' emulation, and TRL's log-prob
    passes call the engine inside it; the same decisions, in the emulation."""

    @contextlib.contextmanager
    def autocast_if_enabled(engine):
        inner = engine.torch_autocast_enabled()
        if rules.autocast_dtype is None and not inner:
            yield
            return
        with rules.autocast(engine.torch_autocast_dtype() if inner else None, enabled=inner):
            yield

    stack = contextlib.ExitStack()
    try:
        import deepspeed.runtime.engine as engine_module
    except ImportError:
        return stack
    original = engine_module.autocast_if_enabled
    engine_module.autocast_if_enabled = autocast_if_enabled
    stack.callback(setattr, engine_module, "autocast_if_enabled", original)
    return stack


class RolloutRun(SFTRun):
    """`TrainerRun` with a GRPOTrainer / RLOOTrainer: its micro-batches are its dataloader's generation batches
    (prompts, each repeated num_generations times), which its `_prepare_inputs` turns into completions once per
    generation; the phases add generation and the log-prob passes under no_grad."""

    phases = PHASES

    def __init__(self, trainer, seq_len: int, precision: str, gradient_checkpointing: bool, device_type: str):
        super().__init__(trainer, seq_len, precision, gradient_checkpointing, device_type)
        self.loader = None
        self.steps = trainer.args.max_steps  # `training.grpo.rollout_steps`: to the second generation

    def models(self) -> list:
        reference = getattr(self.trainer, "ref_model", None)
        return [self.model] + ([reference] if reference is not None else [])

    def attach(self, rules, tracker) -> None:
        import torch

        model, trainer = self.model, self.trainer
        self.rules, self.tracker = rules, tracker

        def forward_starts(*_):
            if torch.is_grad_enabled():
                tracker.start_phase("forward", "activations")

        def forward_ends(*_):
            if torch.is_grad_enabled():
                tracker.start_phase("backward", "activations")

        self.hooks = [model.register_forward_pre_hook(forward_starts), model.register_forward_hook(forward_ends)]
        if self.checkpointing:  # generation switches checkpointing off and on again: a new checkpoint function
            self.hooks.append(model.register_forward_pre_hook(lambda *_: rules.wrap_checkpointing(model)))
        from pipeline.training.grpo import mark_phases

        mark_phases(trainer, lambda phase: tracker.start_phase(phase, "activations"))

    def context(self):
        from pipeline.simulate.clients.parts import host_tensors
        from pipeline.simulate.memory.decode import DecodeReplay

        stack = contextlib.ExitStack()
        if self.device_type == "meta":
            stack.enter_context(host_tensors())
            stack.enter_context(DecodeReplay(self.tracker).installed())
        if self.world is not None:  # several GPUs: DeepSpeed's engine may run the steps
            stack.enter_context(deepspeed_autocast(self.rules))
        return stack

    def setup(self) -> None:
        super().setup()
        self.loader = iter(self.trainer.get_train_dataloader())

    def micro_batch(self):
        """The next generation batch of the trainer's own dataloader (prompts as text, on the host); a new epoch
        where one ends (each rank of several GPUs sees its share of the prompts)."""
        batch = next(self.loader, None)
        if batch is None:
            self.loader = iter(self.trainer.get_train_dataloader())
            batch = next(self.loader)
        return batch

    def close(self) -> None:
        from pipeline.simulate.clients.parts import restore

        trainer = self.trainer
        reference = getattr(trainer, "ref_model", None) if trainer is not None else None
        if trainer is not None:
            from pipeline.training.grpo import unmark_phases

            unmark_phases(trainer)
        self.loader = None
        super().close()
        if reference is not None:
            restore(reference, None)

