"""`client = grpo | rloo` (docs/grpo.md): TRL's GRPOTrainer and RLOOTrainer (trl 1.16) as the measurement runs
them on a GPU and the simulator runs them on meta tensors, defined once: their arguments, the prompts, the reward
and the reference model.

    GRPOConfig(output_dir=<tmp>, per_device_train_batch_size=B, num_generations=G,
               max_completion_length=C, max_steps=3, gradient_accumulation_steps=K,
               gradient_checkpointing=..., bf16/fp16 by the precision's autocast, optim=...,
               save_strategy="no", disable_tqdm=True, report_to="none", logging_steps=1)

(RLOOConfig alike), every other option at TRL's defaults unless the run's `Rollout` gives it (beta, loss_type,
steps_per_generation, num_iterations, ...). `batch` is TRL's per_device_train_batch_size: completions per
micro-batch; a generation makes B x steps_per_generation completions, G per prompt. `seq` is the prompt's
length in tokens: every prompt has exactly `seq` words.

Completions run to `max_completion_length`: the tokenizer's end-of-sequence token lies outside the model's
vocabulary (id V of a V-word model) and replaces the model's own in its generation config (`eos_out_of_reach`),
so the model never samples one and generation stops at the length limit.
That is the step's worst case, the one a fit verdict needs; a run whose completions end earlier holds less.

The reward is the completion's length in characters (a real function of the text: rewards vary, so the
advantages are not all zero). The reference model (beta > 0, no adapters) is what GRPOTrainer builds with
`create_model_from_path` from the policy's name: a second copy built like the policy.
"""

from __future__ import annotations

from pipeline.core.errors import UserError
from pipeline.training.rollout import Rollout
from pipeline.training.step import STEPS, Setting, mixed_precision_args

TOKEN = 2  # what the simulated sampler draws: neither pad (0) nor the unreachable eos


def unavailable(client: str = "grpo") -> str | None:
    """Why GRPOTrainer / RLOOTrainer cannot run here (trl or datasets missing), or None."""
    from pipeline.training.sft import unavailable as sft_unavailable

    reason = sft_unavailable()
    return reason.replace("client sft", f"client {client}") if reason else None


def check(client: str, rollout: Rollout, batch: int, accumulation: int, seq: int | None = None,
          ranks: int = 1) -> None:
    """What TRL checks of the batch before it builds anything, said in one line: the generation batch (every
    data-parallel rank's completions, `ranks` of them) must be a whole number of prompts, each with num_generations
    completions; and the project's bound on the tokens one GPU generates (`vocabulary.MAX_TOKENS`)."""
    from pipeline.core.vocabulary import MAX_TOKENS

    full = rollout.defaults(client)
    steps = full.steps_per_generation or accumulation
    local = batch * steps
    if seq is not None and local * (seq + full.max_completion_length) > MAX_TOKENS:
        raise UserError(f"{client}: a generation of {local} completions of {seq} + {full.max_completion_length} "
                        f"tokens per GPU is more than the {MAX_TOKENS:,} tokens this project estimates")
    if steps * full.num_iterations // accumulation + 1 > MAX_ROLLOUT_STEPS:
        raise UserError(f"{client}: a generation every {steps * full.num_iterations // accumulation} optimizer steps "
                        f"(steps_per_generation {steps} x num_iterations {full.num_iterations}) is more than the "
                        f"{MAX_ROLLOUT_STEPS - 1} this project simulates")
    if local * ranks % full.num_generations:
        across = f" x {ranks} GPUs" if ranks > 1 else ""
        raise UserError(f"{client}: the generation batch (batch {batch} x steps_per_generation {steps}{across} = "
                        f"{local * ranks} completions) must be a multiple of num_generations {full.num_generations}: "
                        f"TRL refuses it before training (change --batch or --num-generations)")


def tokenizer(vocab_size: int):
    """`pipeline.training.sft.tokenizer` with its end-of-sequence word one past the model's vocabulary: the model
    never samples it, so every completion runs to max_completion_length."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    from pipeline.training.sft import PAD_ID

    vocab = {f"t{i}": i for i in range(vocab_size + 1)}
    backend = Tokenizer(WordLevel(vocab, unk_token=f"t{PAD_ID}"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=f"t{PAD_ID}", eos_token=f"t{vocab_size}",
                                   unk_token=f"t{PAD_ID}")


def eos_out_of_reach(model, vocab_size: int) -> None:
    """TRL stops a completion at the tokenizer's end-of-sequence token and at those of the model's generation
    config: the model's are replaced by the tokenizer's (one past the vocabulary), so no completion ends early."""
    model.generation_config.eos_token_id = vocab_size


def prompt_dataset(vocab_size: int, prompts: int, seq_len: int, seed: int = 0):
    """`prompts` prompts of `seq_len` random words of the offline tokenizer (never pad or eos)."""
    import torch
    from datasets import Dataset

    from pipeline.training.dpo import words

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(TOKEN, vocab_size, (prompts, seq_len), generator=generator).tolist()
    return Dataset.from_dict({"prompt": [words(row) for row in ids]})


def rollout_steps(setting: Setting) -> int:
    """The optimizer steps a point runs: three (the first has no optimizer state yet), or as many as it takes to reach
    the second generation, which is the first with the optimizer state beside it. TRL generates every
    steps_per_generation x num_iterations micro-batches (TRL's default steps_per_generation is the accumulation:
    a generation every optimizer step)."""
    full = setting.rollout.defaults(setting.client)
    every = (full.steps_per_generation or setting.gradient_accumulation) * full.num_iterations
    return max(STEPS, every // setting.gradient_accumulation + 1)


MAX_ROLLOUT_STEPS = 65  # a generation every 64 optimizer steps at most: far beyond the recipes, bounds the simulation


def dataset_prompts(setting: Setting, batch: int) -> int:
    """Prompts enough for the point's optimizer steps (`rollout_steps`) on every data-parallel rank (the ranks of
    torch.distributed's world where one is up), at least one generation batch."""
    import torch.distributed as dist

    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    full = setting.rollout.defaults(setting.client)
    # num_iterations > 1: each generation's completions serve that many passes
    completions = -(-batch * setting.gradient_accumulation * rollout_steps(setting) * ranks // full.num_iterations)
    return max(2, -(-completions // full.num_generations))


def length_reward(completions, **kwargs) -> list[float]:
    """The reward: each completion's length in characters."""
    return [float(len(text)) for text in completions]


def rollout_arguments(setting: Setting, precision: str, batch: int, output_dir: str, config_class=None, **extra):
    """The GRPOConfig (RLOOConfig) of a point (`config_class`: either or a subclass; `extra`: use_cpu and the like
    for a machine without a GPU)."""
    return (config_class or globals()["config_class"](setting.client))(output_dir=output_dir, per_device_train_batch_size=batch,
                        max_steps=rollout_steps(setting), gradient_accumulation_steps=setting.gradient_accumulation,
                        gradient_checkpointing=setting.gradient_checkpointing, optim=setting.optim,
                        use_liger_kernel=setting.liger_kernel, save_strategy="no", disable_tqdm=True,
                        report_to="none", logging_steps=1, **mixed_precision_args(precision),
                        **setting.rollout.arguments(), **setting.hyperparameters.arguments(), **extra)


def generation_cache(model, setting: Setting) -> None:
    """The model's generation config as a checkpoint's gives it: `generate` with the KV cache (the project's builds
    switch use_cache off for the training step, and `generate` takes it from the generation config); off only
    for rows measured before (`Rollout.use_cache`)."""
    model.generation_config.use_cache = setting.rollout.defaults(setting.client).use_cache


def trainer_class(client: str):
    import trl

    return {"grpo": trl.GRPOTrainer, "rloo": trl.RLOOTrainer}[client]


def config_class(client: str):
    import trl

    return {"grpo": trl.GRPOConfig, "rloo": trl.RLOOConfig}[client]


PHASE_METHODS = ("_generate", "_get_per_token_logps_and_entropies")


def mark_phases(trainer, start) -> None:
    """`start("generation")` where the trainer's `_generate` begins, `start("log-probs")` where it scores sequences
    under no_grad (the reference's and the old policy's passes): the phases of a rollout, for the measurement's
    tracker and the simulator's alike. The wrappers are the trainer's own attributes (`unmark_phases`)."""
    import torch

    generate, logps = (getattr(trainer, name) for name in PHASE_METHODS)

    def generating(*args, **kwargs):
        start("generation")
        return generate(*args, **kwargs)

    def scoring(*args, **kwargs):
        if not torch.is_grad_enabled():
            start("log-probs")
        return logps(*args, **kwargs)

    trainer._generate, trainer._get_per_token_logps_and_entropies = generating, scoring


def unmark_phases(trainer) -> None:
    for name in PHASE_METHODS:
        trainer.__dict__.pop(name, None)


class ReferenceBuilt:
    """GRPOTrainer / RLOOTrainer build their reference model with `create_model_from_path(name, dtype=...,
    attn_implementation=...)`; a model built from a config has no name: inside this context that call builds a
    second copy of `model` on `device` (random weights), as `pipeline.training.dpo.reference_model` does."""

    def __init__(self, model, device: str):
        self.model, self.device = model, device
        self.modules = []

    def build(self, name, **kwargs):
        from pipeline.inputs.modeling import build_model

        model = self.model
        reference = build_model(model.config, device=self.device, dtype=kwargs.get("dtype") or model.dtype,
                                attn_implementation=kwargs.get("attn_implementation"))
        if reference.device != model.device:
            reference.to(model.device)
        return reference

    def __enter__(self):
        import trl.trainer.grpo_trainer as grpo
        import trl.trainer.rloo_trainer as rloo

        self.modules = [(m, m.create_model_from_path) for m in (grpo, rloo)]
        for module, _ in self.modules:
            module.create_model_from_path = self.build
        return self

    def __exit__(self, *exc):
        for module, original in self.modules:
            module.create_model_from_path = original
