"""`client = dpo` (docs/definitions.md): TRL's DPOTrainer (trl 1.16) as the measurement runs it on a GPU
and the simulator runs it on meta tensors, defined once: its arguments, its data and its reference model.

    DPOConfig(output_dir=<tmp>, per_device_train_batch_size=B, max_length=L, max_steps=3,
              gradient_accumulation_steps=K, gradient_checkpointing=..., bf16/fp16 by the precision's
              autocast, optim=..., use_liger_kernel=..., save_strategy="no", disable_tqdm=True,
              report_to="none")

every other option at TRL's defaults (sigmoid loss, beta 0.1, dropout disabled, the fused LM head that
scores the completion's positions for the policy and the reference). `batch` is the number of preference
pairs: a step runs 2B sequences (prompt + chosen, prompt + rejected) of L tokens. The data: B x K x 3
pairs of random words of the offline tokenizer (`pipeline.training.sft.tokenizer`, token i is "t{i}"),
a prompt of round((1 - s) x L) tokens (s: the completion share, default 1.0, every position scored) and
a chosen and a rejected completion of L - prompt tokens each; DPOTrainer tokenizes them, appends EOS and
its collator truncates each sequence to L. The reference model: without adapters a second copy of the
policy, built the same way in its dtype (what DPOTrainer itself loads from the policy's path; a model
built from a config has none, so it is given as `ref_model`); with adapters (`peft_config`) none, the
base with the adapters disabled.
"""

from __future__ import annotations

from pipeline.training.step import STEPS, Setting, mixed_precision_args


def unavailable() -> str | None:
    """Why DPOTrainer cannot run here (trl or datasets missing), or None."""
    import importlib.util

    for package in ("trl", "datasets"):
        if importlib.util.find_spec(package) is None:
            return f"client dpo needs {package}, which is not installed here"
    return None


def words(ids) -> str:
    """Token ids as the offline tokenizer's text (each word followed by a space)."""
    return "".join(f"t{i} " for i in ids)


def preference_dataset(vocab_size: int, pairs: int, seq_len: int, completion_share: float = 1.0, seed: int = 0):
    """`pairs` preference pairs of random words (a datasets.Dataset with prompt, chosen and rejected
    text): the prompt round((1 - completion_share) x seq_len) words, each completion the rest."""
    import torch
    from datasets import Dataset

    from pipeline.training.sft import prompt_length

    prompt = prompt_length(seq_len, completion_share)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (pairs, prompt + 2 * (seq_len - prompt)), generator=generator).tolist()
    rows = [(row[:prompt], row[prompt:seq_len], row[seq_len:]) for row in ids]
    return Dataset.from_dict({"prompt": [words(p) for p, _, _ in rows], "chosen": [words(c) for _, c, _ in rows],
                              "rejected": [words(r) for _, _, r in rows]})


def dpo_arguments(setting: Setting, precision: str, batch: int, seq: int, output_dir: str, config_class=None,
                  **extra):
    """The DPOConfig of a point (`config_class`: DPOConfig or a subclass of it; `extra`: use_cpu and the
    like for a machine without a GPU)."""
    if config_class is None:
        from trl import DPOConfig as config_class
    return config_class(output_dir=output_dir, per_device_train_batch_size=batch, max_length=seq, max_steps=STEPS,
                        gradient_accumulation_steps=setting.gradient_accumulation,
                        gradient_checkpointing=setting.gradient_checkpointing, optim=setting.optim,
                        use_liger_kernel=setting.liger_kernel, save_strategy="no", disable_tqdm=True,
                        report_to="none", **mixed_precision_args(precision),
                        **setting.hyperparameters.arguments(), **extra)


def dataset_pairs(setting: Setting, batch: int) -> int:
    """Preference pairs of the dataset: B x K per optimizer step, three steps."""
    return batch * setting.gradient_accumulation * STEPS


def reference_model(model, setting: Setting, device: str):
    """DPOTrainer's `ref_model` for `model`: a second copy built like it (its config, dtype, attention
    implementation) with random weights on `device`, then where `model` is (the host, on several GPUs), or None
    with adapters (the base serves)."""
    if setting.adapter is not None:
        return None
    from pipeline.inputs.modeling import build_model

    reference = build_model(model.config, device=device, dtype=model.dtype,
                            attn_implementation=getattr(model.config, "_attn_implementation", None))
    if reference.device != model.device:  # several GPUs: on the host, as the policy (random weights made on the GPU)
        import torch

        reference.to(model.device)
        if device == "cuda":
            torch.cuda.empty_cache()
    return reference
