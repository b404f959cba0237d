"""TRL's SFT configuration file, as `trl sft --config FILE` takes it (YAML, or JSON, which YAML reads
too: SFTConfig's and ModelConfig's fields at the top level), read as the settings of an SFTTrainer run
(`client = sft`), without torch, trl or transformers: the formula stays torch-free.

Read: per_device_train_batch_size, max_length (the sequence length; TRL's default 1024), packing and
padding_free (`training.packing`),
gradient_checkpointing (default true), bf16 / fp16 (bf16 by default), optim, gradient_accumulation_steps,
use_liger_kernel, use_peft with lora_r / lora_alpha / lora_target_modules (TRL's defaults 16 / 32 /
PEFT's per model type), load_in_4bit (QLoRA, nf4), model_name_or_path (the model, unless one is given)
and dtype (what `trl sft` loads the weights in: float32 by default; with bf16 autocast it makes
amp-bf16, bfloat16 makes bf16-autocast). Options that change memory in ways no estimator models are
named in the answer's notes (`UNMODELLED`), never silently dropped; booleans must be real booleans.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.core.text import short
from pipeline.core.vocabulary import ROLLOUT_CLIENTS, WEIGHTS_DTYPE_OF_TORCH_NAME
from pipeline.training.rollout import Rollout
from pipeline.estimate.training_args import with_fsdp, check_flag, optim_name, positive_int_option

MAX_LENGTH_DEFAULT = 1024  # SFTConfig.max_length (trl 1.16)
LORA_DEFAULTS = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05}  # ModelConfig (trl 1.16)
# PEFT's default targets of a LoRA with target_modules None, for llama-style models (q and v projections)
PEFT_DEFAULT_TARGETS = "q_proj,v_proj"
FLAGS = ("bf16", "fp16", "gradient_checkpointing", "use_liger_kernel", "use_peft", "load_in_4bit", "load_in_8bit",
         "packing", "padding_free", "completion_only_loss", "assistant_only_loss", "use_dora",
         "activation_offloading", "torch_compile")
# Options whose memory no estimator models: (their notes, a test of the value that turns them on).
UNMODELLED = {
    "torch_compile": "torch.compile",
    "activation_offloading": "activation offloading",
    "gradient_checkpointing_kwargs": "gradient checkpointing arguments",
    "optim_args": "optimizer arguments (optim_args)",
    "use_dora": "DoRA (its magnitude vectors)",
    "lora_modules_to_save": "modules trained in full beside LoRA (lora_modules_to_save)",
    "lora_target_parameters": "LoRA on parameters (lora_target_parameters)",
    "liger_kernel_config": "a Liger kernel configuration (the defaults are modelled)",
    "load_in_8bit": "an 8-bit base (load_in_8bit; nf4 is modelled)",
    "use_bnb_nested_quant": "nested quantization of the 4-bit statistics",
    "neftune_noise_alpha": "NEFTune noise",
    "torch_empty_cache_steps": "torch_empty_cache_steps",
}


# What each kind of training file is, for the messages about one that cannot be read
FILE_KINDS = {"sft config": "an SFT config, as `trl sft --config` takes it",
              "grpo config": "a GRPO config, as `trl grpo --config` takes it",
              "rloo config": "an RLOO config, as `trl rloo --config` takes it",
              "axolotl config": "an Axolotl config, as `axolotl train` takes it",
              "llamafactory config": "a LLaMA-Factory config, as `llamafactory-cli train` takes it"}
# GRPOConfig / RLOOConfig keys of the rollout (`training.rollout.Rollout`'s fields)
ROLLOUT_KEYS = tuple(field.name for field in fields(Rollout))


def read_sft_config(source, client: str = "sft") -> dict:
    """The run settings of a TRL SFT config file (path) or dict: client sft, batch, seq, gradient_accumulation,
    autocast (bf16 | fp16), checkpointing, optim, liger_kernel, adapter (LoRA / QLoRA or None), weights
    (bf16 | fp32 | None: the model's own, dtype auto), model, and notes. `client` grpo or rloo: a GRPOConfig /
    RLOOConfig file, the same keys but the length (the prompt's is --seq), and its rollout keys
    (`training.rollout.Rollout`) as `rollout`."""
    from pipeline.training.adapters import AdapterSpec
    from pipeline.training.hyperparameters import Hyperparameters

    args, label = _load(source, f"{client} config")
    rollout = None
    if client in ROLLOUT_CLIENTS:
        rollout = {k: args[k] for k in ROLLOUT_KEYS if k in args}
        unmodelled = [k for k in ("generation_batch_size", "vllm_enable_sleep_mode", "cast_lm_head_to_fp32",
                                  "vllm_tensor_parallel_size", "reward_model_name_or_path") if args.get(k) not in
                      (None, False)]
        if any("/" in str(f) for f in (args.get("reward_funcs") or [])):  # a Hub id: a reward model on the GPU
            unmodelled.append("reward_funcs (a reward model)")
        args = {k: v for k, v in args.items() if k not in ROLLOUT_KEYS and k != "max_length"}
    for key in FLAGS:
        check_flag(args, key, label)
    fp16 = bool(args.get("fp16"))
    bf16 = (not fp16) if args.get("bf16") is None else args["bf16"]
    if bf16 and fp16:
        raise UserError(f"{label}: bf16 and fp16 are both true")
    notes = [f"{client} config: {what} is not modelled" for key, what in UNMODELLED.items()
             if args.get(key) not in (None, False, "", [], {})]
    seq = positive_int_option(args, "max_length", source) if "max_length" in args else \
        MAX_LENGTH_DEFAULT if rollout is None else None
    if "max_length" in args and args["max_length"] is None:
        notes.append(f"{client} config: max_length is null (no truncation): the sequence length is --seq's")
    adapter = None
    if args.get("use_peft"):
        targets = args.get("lora_target_modules")
        if targets is None:
            targets = PEFT_DEFAULT_TARGETS
            notes.append(f"{client} config: no lora_target_modules: PEFT's default for llama-style models "
                         f"({PEFT_DEFAULT_TARGETS}) is assumed")
        quantization = "nf4" if args.get("load_in_4bit") else None
        with _located(label):
            adapter = AdapterSpec.make(_lora_int(args, "lora_r", label), _lora_int(args, "lora_alpha", label),
                                       targets, quantization, args.get("lora_dropout", LORA_DEFAULTS["lora_dropout"]))
    elif args.get("load_in_4bit") or args.get("load_in_8bit"):
        raise UserError(f"{label}: a quantized base (load_in_4bit / load_in_8bit) trains adapters only: set use_peft")
    weights = _weights(args.get("dtype", "float32"), label)
    if adapter is not None and adapter.quantization and weights != "bf16":
        notes.append(f"{client} config: load_in_4bit with dtype float32 computes the 4-bit matmuls in fp32 "
                     "(bnb_4bit_compute_dtype = dtype); the estimate takes bf16 compute")
    if args.get("completion_only_loss") or args.get("assistant_only_loss"):
        notes.append(f"{client} config: only completion (or assistant) tokens carry a label: give their share with "
                     "--completion-share (default 1.0, every position)")
    model = args.get("model_name_or_path")
    if model is not None and not isinstance(model, str):
        raise UserError(f"{label}: model_name_or_path must be a model id, not {model!r}")
    settings = {"client": client, "batch": positive_int_option(args, "per_device_train_batch_size", source),
                "seq": seq, "gradient_accumulation": positive_int_option(args, "gradient_accumulation_steps", source),
                "autocast": "bf16" if bf16 else "fp16" if fp16 else None,
                "checkpointing": args.get("gradient_checkpointing", True),
                "optim": optim_name(args.get("optim")), "liger_kernel": bool(args.get("use_liger_kernel", False)),
                "adapter": adapter, "weights": weights, "model": model, "notes": notes,
                "hyperparameters": Hyperparameters.of(args, label)}
    packing = file_packing(args, label, client)
    if packing is not None:
        settings["packing"] = packing
    if rollout is not None:
        settings["rollout"] = rollout
        notes += [f"{client} config: {key} is not modelled" for key in unmodelled]
    with_fsdp(settings, args, label)
    return settings


def file_packing(args: dict, label: str, client: str):
    """An SFT config's packing / padding_free (`training.packing.Packing`, None where neither is on). TRL refuses
    padding_free without packing when max_length is set (it would not enforce it); packing with another strategy
    than bfd (wrapped: rows cut at max_length, attention across documents) is not simulated."""
    from pipeline.simulate.crashes import RunWouldCrash
    from pipeline.training.packing import Packing

    if client != "sft":
        return None
    packing = Packing.of(args.get("packing"), args.get("padding_free"), label)
    if packing is None:
        return None
    strategy = args.get("packing_strategy", "bfd")
    if packing.packing and strategy != "bfd":
        raise UserError(f"{label}: packing_strategy {short(strategy)} is not simulated yet (bfd, TRL's default, is)")
    if packing.packing and "max_length" in args and args["max_length"] is None:
        raise RunWouldCrash(f"{label}: TRL refuses packing with max_length null (the rows' length): set max_length")
    if not packing.packing and args.get("max_length", MAX_LENGTH_DEFAULT) is not None:
        raise RunWouldCrash(f"{label}: TRL refuses padding_free without packing when max_length is set (it would "
                            "not be enforced): set max_length: null (documents untruncated; give their length with "
                            "--seq) or packing: true")
    return packing


def _load(source, label: str = "sft config") -> tuple[dict, str]:
    from pipeline.core.io import check_depth, parse_yaml

    if isinstance(source, dict):
        check_depth(source, label)
        return source, label
    if not isinstance(source, (str, Path)):
        raise UserError(f"{label.replace(' ', '_')} must be a path of a YAML or JSON file or its dict, not "
                        f"{type(source).__name__}")
    path = Path(source)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: {label} not found") from None
    except (OSError, UnicodeDecodeError):
        raise UserError(f"{path}: {label} cannot be read") from None
    what = FILE_KINDS.get(label, f"a {label}")
    data = parse_yaml(text, str(path), f"not YAML or JSON ({what})")
    if not isinstance(data, dict):
        raise UserError(f"{path}: not {what.split(',')[0]} (a mapping of its options is expected)")
    return data, str(path)


def _weights(dtype, label: str) -> str | None:
    """The weights' dtype of ModelConfig.dtype: bf16, fp32, or None for auto (the checkpoint's)."""
    if dtype == "auto":
        return None
    if dtype not in WEIGHTS_DTYPE_OF_TORCH_NAME:
        raise UserError(f"{label}: dtype {dtype!r} is not one of bfloat16, float32, auto "
                        "(float16 weights are not a precision this project models)")
    return WEIGHTS_DTYPE_OF_TORCH_NAME[dtype]


def _lora_int(args: dict, key: str, label: str) -> int:
    value = args.get(key, LORA_DEFAULTS[key])
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{label}: {key} must be a positive integer, not {value!r}")
    return value


class _located:
    """UserErrors raised inside get the file's name in front."""

    def __init__(self, label: str):
        self.label = label

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, traceback):
        if isinstance(exc, UserError) and not str(exc).startswith(self.label):
            raise UserError(f"{self.label}: {exc}") from None
        return False
