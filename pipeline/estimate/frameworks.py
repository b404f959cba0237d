"""The config files of the fine-tuning frameworks people launch, read as the run they start (without torch):
Axolotl's YAML (`axolotl train FILE`) and LLaMA-Factory's (`llamafactory-cli train FILE`).

Both train with transformers' Trainer underneath (their own subclasses: the whole (B, L, V) logits, not TRL's fused
head) for supervised fine-tuning and pre-training, and with TRL's trainers for preference and online RL stages, so
a file maps to this project's clients: `trainer` for sft / pt, `dpo` and `grpo` for those stages. What a key sets
(the model, batch, length, accumulation, precision, checkpointing, optimizer, LoRA / QLoRA, Liger, DeepSpeed, FSDP,
the schedule's numbers) goes where the other inputs put it; a key that changes memory in a way not simulated yet
(a stage or adapter kind, FSDP's CPU offload, activation offloading, Axolotl's plugins, images) stops the answer
with one line naming it, never silently dropped. Packing (Axolotl's sample_packing, LLaMA-Factory's packing, its
pt stage's default) fills every row: it is answered as the full rows it makes, with a note.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.core.errors import UserError
from pipeline.core.text import short

# Axolotl's Liger plugin applies the kernels these keys turn on; the estimate applies Liger's kernels as
# `use_liger_kernel` does (all of those the model takes)
LIGER_KEYS = ("liger_rope", "liger_rms_norm", "liger_glu_activation", "liger_layer_norm",
              "liger_fused_linear_cross_entropy")
# Axolotl's attention keys: None is torch's SDPA (simulated), a name is a kernel the estimate answers as SDPA (flash)
# or refuses
AXOLOTL_ATTENTION = {"flash_attention": "FlashAttention-2", "sdp_attention": None, "xformers_attention": "xformers",
                     "flex_attention": "flex attention", "s2_attention": "shifted-sparse attention"}


# Optimizers by the frameworks' names that the simulated ones stand for on the GPU: bitsandbytes' paged optimizers
# keep their states in unified memory, on the GPU while it has room; its 32-bit AdamW is a fused kernel like
# torch's fused AdamW; Axolotl's adamw_8bit is bitsandbytes' 8-bit AdamW.
OPTIM_ALIASES = {"adamw_8bit": "adamw_bnb_8bit", "paged_adamw_8bit": "adamw_bnb_8bit",
                 "paged_adamw_32bit": "adamw_torch_fused", "paged_adamw": "adamw_torch_fused",
                 "adamw_torch_4bit": None}
# Files that train something other than a causal LM's next-token loss over its vocabulary
NOT_CAUSAL_LM = {"reward_model": "a reward model (a scalar head instead of the vocabulary's logits) is not simulated",
                 "process_reward_model": "a process reward model (a token-classification head) is not simulated",
                 "processor_type": "a vision-language fine-tune (images through a processor) is not simulated yet"}

LLAMAFACTORY_VISION_KEYS = ("image_max_pixels", "image_min_pixels", "video_max_pixels", "freeze_vision_tower",
                            "freeze_multi_modal_projector", "train_mm_proj_only")


def read_axolotl_config(source) -> dict:
    """The run an Axolotl config launches (the settings `read_sft_config` returns, `training_args` keys included)."""
    from pipeline.estimate.sft_config import _load

    args, label = _load(source, "axolotl config")
    refuse(args, label, {
        **NOT_CAUSAL_LM,
        "fsdp_offload_params": None,
        "unfrozen_parameters": "partly frozen full fine-tuning (unfrozen_parameters) is not simulated",
        "relora_steps": "ReLoRA is not simulated",
        "activation_offloading": "activation offloading is not simulated",
        "sequence_parallel_degree": "sequence parallelism is not simulated",
        "tensor_parallel_size": "Axolotl's tensor parallelism is not simulated",
        "context_parallel_size": "context parallelism is not simulated",
        "qat": "quantization-aware training (qat) is not simulated",
    })
    config = typed(args, "fsdp_config", dict, label, {})
    fsdp_list = typed(args, "fsdp", (list, str), label)
    offload = next((f"fsdp_config.{key}" for key in ("fsdp_offload_params", "offload_params") if config.get(key)),
                   "fsdp: offload" if "offload" in str(fsdp_list or "") else None)
    version = config.get("fsdp_version", config.get("version", args.get("fsdp_version", 1)))
    if offload and str(version) != "2":  # FSDP2's is read, and its run crashes (`launch.KNOWN_CRASHES`)
        raise UserError(f"{label}: {offload} with FSDP version 1 (Axolotl's default without fsdp_version: 2): FSDP1's "
                        "CPU offload is not simulated yet")
    if args.get("gradient_checkpointing") == "offload":
        raise UserError(f"{label}: gradient_checkpointing: offload (activations on the host) is not simulated")
    plugins = [p for p in (args.get("plugins") or []) if "liger" not in str(p).lower()]
    liger = any("liger" in str(p).lower() for p in args.get("plugins") or []) and any(
        args.get(key) for key in LIGER_KEYS)
    if plugins:
        raise UserError(f"{label}: plugins {', '.join(map(str, plugins))} change the step in ways not simulated "
                        "(Liger's plugin is)")
    rl = typed(args, "rl", str, label)
    client = {None: "trainer", "dpo": "dpo", "grpo": "grpo"}.get(rl)
    if client is None:
        raise UserError(f"{label}: rl {short(rl)} is not simulated (dpo and grpo are)")
    adapter = axolotl_adapter(args, label)
    notes = attention_notes(args, label)
    if args.get("sample_packing"):
        notes.append(packing_note(label, "sample_packing", "micro_batch_size", "sequence_len"))
    if args.get("micro_batch_size") is None:  # Axolotl's schema default
        args = {**args, "micro_batch_size": 1}
        notes.append(f"{label}: micro_batch_size not set: Axolotl's default, 1")
    settings = framework_settings(
        args, label, client=client, model=args.get("base_model"), batch_key="micro_batch_size",
        seq=args.get("sequence_len", 2048), seq_key="sequence_len", adapter=adapter,
        checkpointing=bool(args.get("gradient_checkpointing", False)), optim=args.get("optimizer"),
        liger=liger, notes=notes,
        schedule={"learning_rate": args.get("learning_rate"), "weight_decay": args.get("weight_decay"),
                  "warmup_steps": args.get("warmup_steps", args.get("warmup_ratio")),
                  "max_steps": args.get("max_steps"), "lr_scheduler_type": args.get("lr_scheduler"),
                  "max_grad_norm": args.get("max_grad_norm")})
    if args.get("attn_implementation") == "eager":
        settings["attn_implementation"] = "eager"
    if client == "grpo":
        from pipeline.estimate.sft_config import ROLLOUT_KEYS

        trl = typed(args, "trl", dict, label, {})
        settings["rollout"] = {k: trl[k] for k in ROLLOUT_KEYS if trl.get(k) is not None}
    fsdp = fsdp_list or config
    if fsdp and str(version) != "2":
        settings["notes"].append(f"{label}: FSDP version 1 (Axolotl's default without fsdp_version: 2) is "
                                 "answered as FSDP2 (the same sharding per decoder layer)")
    from pipeline.estimate.training_args import with_fsdp

    fsdp_text = " ".join(map(str, fsdp_list)) if isinstance(fsdp_list, list) else fsdp_list
    with_fsdp(settings, {"fsdp": (fsdp_text or "full_shard auto_wrap") if fsdp else None,
                         "fsdp_config": fsdp_config(config),
                         "deepspeed": from_repository_root(args.get("deepspeed"), source)}, label)
    return settings


def read_llamafactory_config(source) -> dict:
    """The run a LLaMA-Factory training config launches (the settings `read_sft_config` returns)."""
    from pipeline.estimate.sft_config import _load

    args, label = _load(source, "llamafactory config")
    if args.get("do_train") is not True:  # its stages train only with do_train (TrainingArguments' default false)
        raise UserError(f"{label}: not a training config (no do_train: true): llamafactory-cli trains nothing with "
                        "it (an inference, export, evaluation or preprocessing file)")
    stage = typed(args, "stage", str, label, "sft")
    client = {"sft": "trainer", "pt": "trainer", "dpo": "dpo"}.get(stage)
    if client is None:
        raise UserError(f"{label}: stage {short(stage)} is not simulated (sft, pt and dpo are)")
    packing = args.get("packing")
    if args.get("neat_packing") and args.get("flash_attn") != "fa2":
        raise UserError(f"{label}: neat_packing without flash_attn fa2 makes a (B, 1, L, L) attention mask, which is "
                        "not simulated yet: set flash_attn: fa2, or packing instead")
    vision = [key for key in LLAMAFACTORY_VISION_KEYS if key in args]
    if vision:
        raise UserError(f"{label}: {vision[0]} is set: a vision-language fine-tune (images through a processor) is "
                        "not simulated yet")
    refuse(args, label, {"use_unsloth": "Unsloth's kernels are not simulated",
                         "use_adam_mini": "Adam-mini is not simulated", "use_muon": "Muon is not simulated",
                         "use_dft_loss": "the DFT loss is not simulated", "use_kt": "KTransformers is not simulated",
                         "pipeline_model_parallel_size": "Megatron's parallelism (mcore_adapter) is not simulated",
                         "tensor_model_parallel_size": "Megatron's parallelism (mcore_adapter) is not simulated",
                         "use_badam": "BAdam is not simulated", "use_galore": "GaLore is not simulated",
                         "use_apollo": "APOLLO is not simulated", "use_dora": "DoRA is not simulated",
                         "pissa_init": None, "use_llama_pro": "LLaMA Pro is not simulated",
                         "shift_attn": "shifted-sparse attention is not simulated"})
    adapter = llamafactory_adapter(args, label)
    notes = []
    if packing or (packing is None and stage == "pt") or args.get("neat_packing"):
        notes.append(packing_note(label, "packing" if packing else "neat_packing" if args.get("neat_packing") else
                                  "stage pt (packed by default)",
                                  "per_device_train_batch_size", "cutoff_len"))
    if args.get("flash_attn") == "fa2":
        notes.append(f"{label}: flash_attn fa2 is answered with torch's SDPA flash path (the same saved tensors)")
    settings = framework_settings(
        args, label, client=client, model=args.get("model_name_or_path"), batch_key="per_device_train_batch_size",
        seq=args.get("cutoff_len", 2048), seq_key="cutoff_len", adapter=adapter,
        checkpointing=not args.get("disable_gradient_checkpointing", False), optim=args.get("optim"),
        liger=bool(args.get("enable_liger_kernel", False)), notes=notes,
        schedule={"learning_rate": args.get("learning_rate"), "weight_decay": args.get("weight_decay"),
                  "warmup_steps": args.get("warmup_steps") or args.get("warmup_ratio"),
                  "max_steps": args.get("max_steps"), "lr_scheduler_type": args.get("lr_scheduler_type"),
                  "max_grad_norm": args.get("max_grad_norm")})
    if args.get("pure_bf16"):  # bf16 weights, no autocast
        settings.update(autocast=None, weights="bf16")
    from pipeline.estimate.training_args import with_fsdp

    with_fsdp(settings, {"fsdp": args.get("fsdp"), "fsdp_config": args.get("fsdp_config"),
                         "deepspeed": from_repository_root(args.get("deepspeed"), source)}, label)
    return settings


def lora_dropout(args: dict, label: str) -> float:
    """The file's lora_dropout (both frameworks' default: 0, no dropout)."""
    from pipeline.training.adapters import check_dropout

    value = args.get("lora_dropout")
    try:
        return 0.0 if value is None else check_dropout(value)
    except UserError as exc:
        raise UserError(f"{label}: {exc}") from None


def from_repository_root(path, source):
    """A file a framework's config names (its DeepSpeed config): as given when it exists from the working directory,
    else from the nearest folder above the config file that holds it (the frameworks resolve it from their
    repository's root, `examples/deepspeed/ds_z3_config.json`, where their example configs sit below)."""
    try:
        if not isinstance(path, str) or not isinstance(source, (str, Path)) or Path(path).is_absolute() \
                or Path(path).exists():
            return path
        return next((str(folder / path) for folder in Path(source).resolve().parents if (folder / path).is_file()),
                    path)
    except (OSError, ValueError):  # a name the file system refuses: read (and refused) as given
        return path


def packing_note(label: str, key: str, batch_key: str, seq_key: str) -> str:
    return (f"{label}: {key}: answered as {batch_key} rows of {seq_key} tokens each, every row full (packing fills "
            "them), kept apart as the framework keeps them; a packed row's attention mask (none on flash attention's "
            "variable-length path) is not counted (TRL's packing, which concatenates the rows, is: --client sft "
            "--packing)")


def number(value):
    """A number the frameworks' parsers take from YAML 1.1's text (`5e-5` is a string to PyYAML, a float to
    Axolotl's pydantic and to LLaMA-Factory's HfArgumentParser)."""
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                continue
    return value


def typed(args: dict, key: str, kinds, label: str, default=None):
    """`args[key]` (or `default` where absent or null) if it is of `kinds`, else one line naming the key."""
    value = args.get(key)
    if value is None:
        return default
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in (
            kinds if isinstance(kinds, tuple) else (kinds,)):
        raise UserError(f"{label}: {key} must be a {describe(kinds)}, not {short(value)}")
    return value


def describe(kinds) -> str:
    names = {str: "text", int: "whole number", float: "number", dict: "mapping", list: "list", bool: "true or false"}
    return " or ".join(names.get(k, k.__name__) for k in (kinds if isinstance(kinds, tuple) else (kinds,)))


def refuse(args: dict, label: str, keys: dict) -> None:
    """One line for the first key of `keys` the file turns on (its value not false, empty or zero)."""
    for key, why in keys.items():
        if args.get(key) not in (None, False, 0, "", [], {}):
            raise UserError(f"{label}: {key} is set: {why or key + ' is not simulated yet'}")


def attention_notes(args: dict, label: str) -> list:
    notes = implementation_notes(args, label)
    for key, name in AXOLOTL_ATTENTION.items():
        if args.get(key) and name is not None:
            if key != "flash_attention":
                raise UserError(f"{label}: {key} ({name}) is not simulated")
            return [f"{label}: flash_attention ({name}) is answered with torch's SDPA flash path (the same saved "
                    "tensors)"]
    return notes


FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "vllm-flash-attn3",
                         "kernels-community/flash-attn", "kernels-community/vllm-flash-attn3")


def implementation_notes(args: dict, label: str) -> list:
    """Axolotl's attn_implementation (transformers' name): sdpa as the simulator runs it, flash attention answered
    with SDPA's flash path, eager read into the settings by `read_axolotl_config`, the others refused."""
    name = typed(args, "attn_implementation", str, label)
    if name in (None, "sdpa", "eager"):
        return []
    if name in FLASH_IMPLEMENTATIONS:
        return [f"{label}: attn_implementation {name} is answered with torch's SDPA flash path (the same saved "
                "tensors)"]
    raise UserError(f"{label}: attn_implementation {short(name)} is not simulated (sdpa, eager and flash attention "
                    "are)")


def axolotl_adapter(args: dict, label: str):
    from pipeline.training.adapters import AdapterSpec

    kind = typed(args, "adapter", str, label)
    if kind in (None, ""):
        if args.get("load_in_4bit") or args.get("load_in_8bit"):
            raise UserError(f"{label}: a quantized base (load_in_4bit / load_in_8bit) trains adapters only: set "
                            "adapter: lora or qlora")
        return None
    if kind not in ("lora", "qlora"):
        raise UserError(f"{label}: adapter {short(kind)} is not simulated (lora and qlora are)")
    if kind == "qlora" and not args.get("load_in_4bit"):
        raise UserError(f"{label}: adapter qlora needs load_in_4bit: true (Axolotl refuses it otherwise)")
    quantization = "nf4" if args.get("load_in_4bit") else "int8" if args.get("load_in_8bit") else None
    targets = "all-linear" if args.get("lora_target_linear") else args.get("lora_target_modules")
    if not targets:
        raise UserError(f"{label}: LoRA needs lora_target_modules or lora_target_linear: true (Axolotl refuses it "
                        "otherwise)")
    r = typed(args, "lora_r", int, label, 8)
    return AdapterSpec.make(r, typed(args, "lora_alpha", int, label, r * 2), targets if isinstance(targets, str) else
                            ",".join(map(str, targets)), quantization, lora_dropout(args, label))


def llamafactory_adapter(args: dict, label: str):
    from pipeline.training.adapters import AdapterSpec

    kind = typed(args, "finetuning_type", str, label, "lora")
    bits = typed(args, "quantization_bit", int, label)
    if kind == "full":
        if bits:
            raise UserError(f"{label}: quantization_bit with finetuning_type full: a quantized base trains adapters "
                            "only")
        return None
    if kind != "lora":
        raise UserError(f"{label}: finetuning_type {short(kind)} is not simulated (lora and full are)")
    method = args.get("quantization_method", "bitsandbytes")
    if bits and method not in ("bitsandbytes", "bnb"):
        raise UserError(f"{label}: quantization_method {short(method)} is not simulated (bitsandbytes is)")
    quantization = {None: None, 4: "nf4", 8: "int8"}.get(bits, "unknown")
    if quantization == "unknown":
        raise UserError(f"{label}: quantization_bit {short(bits)} is not simulated (4 and 8 are)")
    target = typed(args, "lora_target", str, label, "all")
    r = typed(args, "lora_rank", int, label, 8)
    return AdapterSpec.make(r, typed(args, "lora_alpha", int, label, r * 2), "all-linear" if target == "all" else target,
                            quantization, lora_dropout(args, label))


def fsdp_config(config: dict) -> dict | None:
    """Axolotl's fsdp_config with its keys as accelerate names them (`fsdp_` prefixed)."""
    if not config:
        return None
    return {key if key.startswith("fsdp_") else f"fsdp_{key}": value for key, value in config.items()
            if key not in ("fsdp_version", "version")}


def framework_settings(args: dict, label: str, *, client: str, model, batch_key: str, seq, seq_key: str, adapter,
                       checkpointing: bool, optim, liger: bool, notes: list, schedule: dict) -> dict:
    """The settings dict of a framework's file (the shape `read_sft_config` returns)."""
    from pipeline.estimate.training_args import positive_int_option
    from pipeline.training.hyperparameters import Hyperparameters

    bf16, fp16 = args.get("bf16"), args.get("fp16")
    if bf16 not in (None, True, False, "auto") or fp16 not in (None, True, False, "auto"):
        raise UserError(f"{label}: bf16 and fp16 must be true, false or auto, not {short(bf16)} / {short(fp16)}")
    half = "fp16" if fp16 is True else "bf16" if bf16 in (True, "auto") else None
    if model is not None and not isinstance(model, str):
        raise UserError(f"{label}: the model must be a model id, not {short(model)}")
    if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0):
        raise UserError(f"{label}: {seq_key} must be a positive whole number, not {short(seq)}")
    if optim is not None and not isinstance(optim, str):
        raise UserError(f"{label}: the optimizer must be a name, not {short(optim)}")
    if optim in OPTIM_ALIASES:
        if OPTIM_ALIASES[optim] is None:
            raise UserError(f"{label}: optim {optim} is not simulated")
        notes.append(f"{label}: optim {optim} is answered as {OPTIM_ALIASES[optim]} (its states' bytes on the GPU)")
        optim = OPTIM_ALIASES[optim]
    schedule = {key: number(value) for key, value in schedule.items()}
    return {"client": client, "batch": positive_int_option(args, batch_key, label),
            "seq": seq, "gradient_accumulation": positive_int_option(args, "gradient_accumulation_steps", label),
            "autocast": half, "checkpointing": checkpointing, "optim": optim, "liger_kernel": liger,
            "adapter": adapter, "weights": "bf16" if half == "bf16" else None, "model": model, "notes": notes,
            "hyperparameters": Hyperparameters.of({k: v for k, v in schedule.items() if v is not None}, label)}
