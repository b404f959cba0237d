"""A `transformers.TrainingArguments` JSON (as `TrainingArguments.to_json_string()` writes it) read
as the settings of a Trainer run: `client = trainer`, its batch, accumulation, precision,
checkpointing and optim. Read as JSON, without transformers: the formula stays torch-free."""

from __future__ import annotations


from pipeline.core.errors import UserError
from pipeline.core.io import read_json_object
from pipeline.core.text import short

# Arguments that change memory in ways no estimator models: named in the answer's notes.
UNMODELLED = {
    "fsdp": "FSDP sharding (see --num-gpus/--sharding)",
    "deepspeed": "DeepSpeed",
    "torch_compile": "torch.compile",
    "optim_args": "optimizer arguments (optim_args)",
    "gradient_checkpointing_kwargs": "gradient checkpointing arguments",
    "torch_empty_cache_steps": "torch_empty_cache_steps",
}


def read_training_args(source) -> dict:
    """The run settings a TrainingArguments JSON file (path) or dict gives: client, batch,
    gradient_accumulation, precision (amp-bf16 for bf16, amp-fp16 for fp16, else None: the weights'
    dtype decides), checkpointing, optim, and notes on what is not modelled."""
    args = _load(source)
    flags = {key: _bool(args, key, source) for key in ("bf16", "fp16", "gradient_checkpointing")}
    if flags["bf16"] and flags["fp16"]:
        raise UserError(f"{_label(source)}: bf16 and fp16 are both true")
    precision = "amp-bf16" if flags["bf16"] else "amp-fp16" if flags["fp16"] else None
    settings = {"client": "trainer", "batch": _int(args, "per_device_train_batch_size", source),
                "gradient_accumulation": _int(args, "gradient_accumulation_steps", source),
                "precision": precision, "checkpointing": flags["gradient_checkpointing"],
                "optim": _optim(args.get("optim"))}
    settings["notes"] = [f"training args: {what} is not modelled" for key, what in UNMODELLED.items()
                         if args.get(key) not in (None, False, "", [], {})]
    return {key: value for key, value in settings.items() if value is not None}


def _load(source) -> dict:
    if isinstance(source, dict):
        return source
    return read_json_object(source, "training arguments not found", "not a TrainingArguments JSON",
                            "not a TrainingArguments JSON (an object is expected)")


def _label(source) -> str:
    return "training args" if isinstance(source, dict) else short(str(source), 200, quote=False)


def _int(args: dict, key: str, source) -> int | None:
    value = args.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{_label(source)}: {key} must be a positive integer, not {short(value)}")
    return value


def _bool(args: dict, key: str, source) -> bool:
    """A flag of the file: a JSON boolean (absent or null: false); "false" or 1 are refused, not guessed."""
    value = args.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise UserError(f"{_label(source)}: {key} must be true or false (a JSON boolean), not {short(value)}")
    return value


def _optim(value):
    """TrainingArguments writes the OptimizerNames enum as its value string."""
    if value is None:
        return None
    text = str(value)
    return text.removeprefix("OptimizerNames.").lower() if text.startswith("OptimizerNames.") else text
