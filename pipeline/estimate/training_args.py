"""A `transformers.TrainingArguments` JSON (as `TrainingArguments.to_json_string()` writes it) read
as the settings of a Trainer run: `client = trainer`, its batch, accumulation, autocast (bf16 / fp16:
with the weights' dtype it makes the precision, `pipeline.estimate.api.make_run`), checkpointing, optim
and Liger's kernels. Read as JSON, without transformers: the formula stays torch-free."""

from __future__ import annotations


from pipeline.core.errors import UserError
from pipeline.core.io import read_json_object
from pipeline.core.text import short
from pipeline.training.hyperparameters import Hyperparameters

# Arguments that change memory in ways no estimator models: named in the answer's notes.
UNMODELLED = {
    "torch_compile": "torch.compile",
    "optim_args": "optimizer arguments (optim_args)",
    "gradient_checkpointing_kwargs": "gradient checkpointing arguments",
    "torch_empty_cache_steps": "torch_empty_cache_steps",
}


def read_training_args(source) -> dict:
    """The run settings a TrainingArguments JSON file (path) or dict gives: client, batch,
    gradient_accumulation, autocast ("bf16" for bf16, "fp16" for fp16, else None: the weights' dtype
    alone), checkpointing, optim, liger_kernel, hyperparameters (the optimizer's and the schedule's numbers:
    a DeepSpeed config's "auto" values come from them), and notes on what is not modelled."""
    args = _load(source)
    label = source_label(source)
    for key in ("bf16", "fp16", "gradient_checkpointing", "use_liger_kernel"):
        check_flag(args, key, label)
    if args.get("bf16") and args.get("fp16"):
        raise UserError(f"{label}: bf16 and fp16 are both true")
    settings = {"client": "trainer", "batch": positive_int_option(args, "per_device_train_batch_size", source),
                "gradient_accumulation": positive_int_option(args, "gradient_accumulation_steps", source),
                "autocast": "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else None,
                "checkpointing": bool(args.get("gradient_checkpointing", False)),
                "optim": optim_name(args.get("optim")), "liger_kernel": bool(args.get("use_liger_kernel", False)),
                "hyperparameters": Hyperparameters.of(args, label)}
    settings["notes"] = [f"training args: {what} is not modelled" for key, what in UNMODELLED.items()
                         if args.get(key) not in (None, False, "", [], {})]
    with_fsdp(settings, args, label)
    return {key: value for key, value in settings.items() if value is not None or key == "autocast"}


def with_fsdp(settings: dict, args: dict, label: str) -> None:
    """The sharding a training file's `fsdp` / `fsdp_config` keys launch (`estimate.launch.fsdp_settings`), in
    `settings` (FSDP's activation checkpointing too; its notes added); its `deepspeed` key (a DeepSpeed config's
    path or dict) as `deepspeed_source`, read by `training.zero.read_deepspeed` where the run is made."""
    from pipeline.estimate.launch import fsdp_settings

    fsdp = fsdp_settings(args.get("fsdp"), args.get("fsdp_config"), label)
    if args.get("deepspeed") not in (None, False, "", [], {}):
        if "sharding" in fsdp:
            raise UserError(f"{label}: fsdp and deepspeed are both given (the Trainer takes one of them)")
        settings["deepspeed_source"] = args["deepspeed"]
    settings["notes"] += fsdp.pop("notes", [])
    if fsdp.get("checkpointing"):
        settings["checkpointing"] = True
    if "sharding" in fsdp:
        settings["sharding"] = fsdp["sharding"]


def check_flag(args: dict, key: str, label: str) -> None:
    """A boolean option must be a real boolean (or absent / null): "true" in quotes is a string."""
    value = args.get(key)
    if value is not None and not isinstance(value, bool):
        raise UserError(f"{label}: {key} must be true or false, not {short(value)}")


def _load(source) -> dict:
    if isinstance(source, dict):
        from pipeline.core.io import check_depth

        check_depth(source, "training args")
        return source
    return read_json_object(source, "training arguments not found", "not a TrainingArguments JSON",
                            "not a TrainingArguments JSON (an object is expected)")


def source_label(source) -> str:
    return "training args" if isinstance(source, dict) else short(str(source), 200, quote=False)


def positive_int_option(args: dict, key: str, source) -> int | None:
    value = args.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{source_label(source)}: {key} must be a positive integer, not {short(value)}")
    return value


def optim_name(value):
    """TrainingArguments writes the OptimizerNames enum as its value string."""
    if value is None:
        return None
    text = str(value)
    return text.removeprefix("OptimizerNames.").lower() if text.startswith("OptimizerNames.") else text
