"""`client = sft` (docs/definitions.md): TRL's SFTTrainer (trl 1.16) as the measurement runs it on a
GPU and the simulator runs it on meta tensors, defined once: its arguments, its offline tokenizer and
its pre-tokenized dataset.

    SFTConfig(output_dir=<tmp>, per_device_train_batch_size=B, max_length=L, max_steps=3,
              gradient_accumulation_steps=K, gradient_checkpointing=..., bf16/fp16 by the precision's
              autocast, optim=..., use_liger_kernel=..., completion_only_loss=(True if share < 1),
              save_strategy="no", disable_tqdm=True, report_to="none")

every other option at TRL's defaults (loss_type "nll": the fused LM head). The data: B x K x 3 rows
of L random ids (`input_ids`; with a completion share s < 1 a `completion_mask` whose first
round((1 - s) x L) positions are the prompt), pre-tokenized, so SFTTrainer neither tokenizes nor
truncates them; the tokenizer only names the pad and eos tokens. LoRA and QLoRA go in as
`peft_config` (SFTTrainer wraps the model itself; on a 4-bit base it casts the adapters to bf16).
"""

from __future__ import annotations

from pipeline.training.step import STEPS, Setting, mixed_precision_args

PAD_ID, EOS_ID = 0, 1  # the offline tokenizer's pad and eos tokens (ids of the model's vocabulary)


def unavailable() -> str | None:
    """Why SFTTrainer cannot run here (trl or datasets missing, or failing to import: a wheel carried to a
    machine whose pyarrow or transformers it does not take), or None."""
    import importlib
    import importlib.util

    for package in ("trl", "datasets"):
        if importlib.util.find_spec(package) is None:
            return f"client sft needs {package}, which is not installed here"
    for package in ("datasets", "trl"):
        try:
            importlib.import_module(package)
        except Exception as exc:  # noqa: BLE001 - the reason of a skipped row
            first = (str(exc).strip().splitlines() or [""])[0]
            return f"client sft needs {package}, which fails to import here: {type(exc).__name__}: {first}"[:300]
    return None


def tokenizer(vocab_size: int):
    """An offline tokenizer over the model's ids: token i is the word "t{i}" (words split at whitespace),
    pad t0, eos t1. SFTTrainer's dataset is pre-tokenized (it asks for the pad and eos ids only);
    DPOTrainer tokenizes text made of such words (`pipeline.training.dpo`)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token=f"t{PAD_ID}"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=f"t{PAD_ID}", eos_token=f"t{EOS_ID}",
                                   unk_token=f"t{PAD_ID}")


def prompt_length(seq_len: int, completion_share: float) -> int:
    """Positions of each row that are prompt (no label) at a completion share."""
    return round((1 - completion_share) * seq_len)


def random_dataset(vocab_size: int, rows: int, seq_len: int, completion_share: float = 1.0, seed: int = 0,
                   documents: tuple[int, ...] | None = None):
    """`rows` pre-tokenized rows of `seq_len` random ids below `vocab_size` (a datasets.Dataset); with a
    completion share below 1, a completion_mask (0 on the prompt, 1 on the completion). `documents`: each row
    is documents of these lengths instead (packing packs them back into rows), each with its own prompt."""
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    lengths = list(documents or (seq_len,)) * rows
    data = {"input_ids": [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]}
    if completion_share < 1:
        data["completion_mask"] = [[0] * prompt_length(n, completion_share)
                                   + [1] * (n - prompt_length(n, completion_share)) for n in lengths]
    return Dataset.from_dict(data)


def train_dataset(setting: Setting, vocab_size: int, batch: int, seq: int):
    """The point's dataset: B x K rows per optimizer step, three steps (`random_dataset`), each row as the point's
    packing makes it (`training.packing`)."""
    documents = setting.packing.row_documents(seq) if setting.packing is not None else None
    return random_dataset(vocab_size, dataset_rows(setting, batch), seq, setting.completion_share, documents=documents)


def sft_arguments(setting: Setting, precision: str, batch: int, seq: int, output_dir: str, config_class=None,
                  **extra):
    """The SFTConfig of a point (`config_class`: SFTConfig or a subclass of it; `extra`: use_cpu and
    the like for a machine without a GPU)."""
    if config_class is None:
        from trl import SFTConfig as config_class
    batching = {"max_length": seq, **(setting.packing.config_arguments() if setting.packing is not None else {})}
    return config_class(output_dir=output_dir, per_device_train_batch_size=batch, max_steps=STEPS, **batching,
                        gradient_accumulation_steps=setting.gradient_accumulation,
                        gradient_checkpointing=setting.gradient_checkpointing, optim=setting.optim,
                        use_liger_kernel=setting.liger_kernel,
                        completion_only_loss=True if setting.completion_share < 1 else None,
                        save_strategy="no", disable_tqdm=True, report_to="none", **mixed_precision_args(precision),
                        **setting.hyperparameters.arguments(), **extra)


def dataset_rows(setting: Setting, batch: int) -> int:
    """Rows of the dataset: B x K per optimizer step, three steps."""
    return batch * setting.gradient_accumulation * STEPS


def peft_config(setting: Setting):
    """SFTTrainer's peft_config of the point's adapters (None for full fine-tuning)."""
    if setting.adapter is None:
        return None
    from pipeline.training.adapters import lora_config

    return lora_config(setting.adapter)
