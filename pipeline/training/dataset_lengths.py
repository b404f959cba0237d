"""A dataset's document lengths as TRL's SFTTrainer tokenizes them (trl 1.16, `SFTTrainer._prepare_dataset`), for
the worst step of packed or padded batches (`training.packing.worst_step`): a local JSON / JSONL file or a Hub
dataset id, and the model's tokenizer (or a tokenizer's folder). Rows by their fields: `input_ids` (already
tokenized: its length), `messages` (the chat template applied), `prompt` and `completion` (concatenated; plain text
ends with the eos token), `text` (the eos token added unless it ends with it). Never with remote code."""

from __future__ import annotations

from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.core.text import short

MAX_ROWS = 2_000_000


def dataset_lengths(dataset: str, tokenizer: str, split: str = "train") -> list[int]:
    """The token counts of `dataset`'s rows (a local .json / .jsonl file or a Hub id) with `tokenizer` (a Hub id or a
    folder); one-line UserError for what cannot be read."""
    rows = load_rows(dataset, split)
    encoder = load_tokenizer(tokenizer)
    return [row_length(row, encoder, f"dataset {dataset}, row {index + 1}") for index, row in enumerate(rows)]


def load_rows(dataset: str, split: str):
    if not isinstance(dataset, str) or not dataset:
        raise UserError(f"dataset must be a JSON / JSONL file or a Hub dataset id, not {short(dataset)}")
    import datasets
    import huggingface_hub

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()  # the Hub's retries are said in the one line of a failure
    huggingface_hub.logging.set_verbosity_error()
    local = Path(dataset)
    try:
        if local.suffix in (".json", ".jsonl"):
            if not local.is_file():
                raise UserError(f"dataset {dataset}: file not found")
            rows = datasets.load_dataset("json", data_files=str(local), split="train")
        else:
            rows = datasets.load_dataset(dataset, split=split)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - any loading failure is the input's: one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"dataset {dataset}: cannot be loaded ({first}); give its lengths instead (--lengths)") \
            from None
    if len(rows) > MAX_ROWS:
        raise UserError(f"dataset {dataset}: {len(rows):,} rows, more than the {MAX_ROWS:,} read here")
    return rows


def load_tokenizer(tokenizer: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - a missing or unreadable tokenizer: one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"tokenizer {tokenizer}: cannot be loaded ({first}); give the dataset's lengths instead "
                        "(--lengths)") from None


def row_length(row: dict, tokenizer, label: str) -> int:
    """One row's tokens as SFTTrainer makes them."""
    if isinstance(row.get("input_ids"), list):
        return len(row["input_ids"])
    eos = tokenizer.eos_token or ""
    prompt, completion = row.get("prompt"), row.get("completion")  # None: a field of other rows only
    if isinstance(prompt, list) and isinstance(completion, list):
        return len(chat_ids(tokenizer, prompt + completion, label))
    if isinstance(prompt, str) and isinstance(completion, str):
        completion = completion if completion.endswith(eos) else completion + eos
        return len(tokenizer(text=prompt + completion)["input_ids"])
    if isinstance(row.get("messages"), list):
        return len(chat_ids(tokenizer, row["messages"], label))
    if isinstance(row.get("text"), str):
        text = row["text"] if row["text"].endswith(eos) else row["text"] + eos
        return len(tokenizer(text=text)["input_ids"])
    raise UserError(f"{label}: no input_ids, messages, prompt and completion, or text field")


def chat_ids(tokenizer, messages: list, label: str) -> list:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    except Exception as exc:  # noqa: BLE001 - a tokenizer without a chat template, bad messages
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"{label}: the chat template cannot be applied ({first})") from None
