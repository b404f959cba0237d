"""What a launch says of its GPUs, read from the files people already have: the `fsdp` / `fsdp_config` keys of a
TrainingArguments or SFTConfig file, and an accelerate config file (`accelerate launch --config_file FILE`, as
`accelerate config` writes it). Read without accelerate or torch (the formula stays torch-free).

FSDP is FSDP2 here (transformers' `fsdp_config` version 2, its default; accelerate's `fsdp_version: 2`):
`full_shard` (or `reshard_after_forward: true`) is `fsdp`, `shard_grad_op` (`false`) is `fsdp-no-reshard`.
DeepSpeed (an accelerate config's `distributed_type: DEEPSPEED`, a training file's `deepspeed` key) is read by
`pipeline.training.zero`. FSDP2's CPU offload (the `offload` word, `offload_params` / `cpu_offload`) is `fsdp-offload`,
whose run crashes under the Trainer (`KNOWN_CRASHES`: the answer says so). What the simulator does not run is
refused in one line (FSDP1, TPUs, a mixed precision other than no, bf16, fp16); what changes
no memory of a step (state-dict types, loading, prefetch knobs of FSDP1) is accepted; what changes memory in a
way no estimator models is named in the answer's notes. Unknown keys are refused, so that a typo is not an
answer to another question.
"""

from __future__ import annotations

from pipeline.core.errors import UserError
from pipeline.core.text import short

# transformers' `fsdp` words (FSDPOption) and what FSDP2 makes of them
FSDP_WORDS = {"full_shard": "fsdp", "shard_grad_op": "fsdp-no-reshard", "auto_wrap": None}
FSDP1_WORDS = ("hybrid_shard", "hybrid_shard_zero2", "no_shard")
# fsdp_config keys (the "fsdp_" prefix dropped, as transformers and accelerate drop it)
FSDP_NO_MEMORY = {"version", "reshard_after_forward", "transformer_layer_cls_to_wrap", "auto_wrap_policy",
                  "state_dict_type", "cpu_ram_efficient_loading", "sync_module_states", "use_orig_params",
                  "forward_prefetch", "backward_prefetch", "limit_all_gathers", "xla", "xla_fsdp_v2",
                  "xla_fsdp_grad_ckpt", "min_num_params", "activation_checkpointing", "offload_params", "cpu_offload",
                  "sharding_strategy"}
FSDP_NOTED = {"mixed_precision_policy": "an FSDP mixed precision policy of its own",
              "ignored_modules": "modules left out of FSDP's sharding"}
ACCELERATE_KEYS = {"compute_environment", "distributed_type", "num_processes", "num_machines", "machine_rank",
                   "main_process_ip", "main_process_port", "rdzv_backend", "same_network", "mixed_precision",
                   "downcast_bf16", "gpu_ids", "use_cpu", "debug", "enable_cpu_affinity", "main_training_function",
                   "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "dynamo_config", "fsdp_config", "deepspeed_config",
                   "megatron_lm_config", "parallelism_config", "fp8_config", "ipex_config", "mpirun_config",
                   "command_file", "commands", "tpu_name", "tpu_zone"}
AUTOCAST = {"no": None, "bf16": "bf16", "fp16": "fp16"}
# What the real run of a crashing sharding (vocabulary.CRASHING_SHARDINGS) does, measured (benchmarks/probe_fsdp_offload.py)
KNOWN_CRASHES = {
    "fsdp-offload": (
        "FSDP2 with CPU offload (sharding fsdp-offload) would crash at the first optimizer step: the Trainer's "
        "gradient norm (accelerate's clip_grad_norm_, then torch's) all-reduces the norm of the gradients FSDP2 keeps "
        "on the host over NCCL, which has no CPU backend (\"No backend type associated with device type cpu\"; "
        "measured on 2 H200s with torch 2.11, transformers 5.17, accelerate 1.15, with max_grad_norm 0 too; "
        "Axolotl's issue 3058): shard with fsdp (no offload), or with zero3 and a DeepSpeed config's "
        "offload_optimizer / offload_param (ZeRO-Offload, simulated)"),
}


def fsdp_settings(fsdp, fsdp_config, label: str) -> dict:
    """{"sharding", "checkpointing"?, "notes"} of the `fsdp` and `fsdp_config` keys of a training file ({} when FSDP
    is off)."""
    if fsdp in (None, False, "", []):
        if fsdp_config not in (None, {}, ""):
            return {"notes": [f"{label}: fsdp_config is given but fsdp is off: it is not used"]}
        return {}
    words = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, list) else [] if fsdp is True \
        else None
    if words is None:
        raise UserError(f"{label}: fsdp must be true or FSDP's words (full_shard auto_wrap ...), not {short(fsdp)}")
    config = _fsdp_config(fsdp_config, label)
    sharding = "fsdp"
    for word in words:
        if word in FSDP1_WORDS:
            raise UserError(f"{label}: fsdp {word} is FSDP1's (transformers runs FSDP2, where it does not exist); "
                            "sharded data parallel across nodes is hsdp (--sharding hsdp --shard-group S)")
        if word == "offload":
            config = {**config, "offload_params": True}
            continue
        if word not in FSDP_WORDS:
            raise UserError(f"{label}: unknown fsdp option {short(word)} (full_shard, shard_grad_op, offload, "
                            "auto_wrap)")
        sharding = FSDP_WORDS[word] or sharding
    return _with_config(sharding, config, label)


def _fsdp_config(config, label: str) -> dict:
    if config in (None, ""):
        return {}
    if not isinstance(config, dict):
        raise UserError(f"{label}: fsdp_config must be an object (the file's content), not {short(config)}")
    return {key.removeprefix("fsdp_"): value for key, value in config.items()}


def _with_config(sharding: str, config: dict, label: str) -> dict:
    unknown = sorted(set(config) - FSDP_NO_MEMORY - set(FSDP_NOTED))
    if unknown:
        raise UserError(f"{label}: unknown fsdp_config key {short(unknown[0])}")
    if str(config.get("version", 2)) != "2":
        raise UserError(f"{label}: FSDP version {short(config['version'])} is not simulated (FSDP2 is: version 2)")
    if config.get("xla") or config.get("xla_fsdp_v2"):
        raise UserError(f"{label}: FSDP on XLA (TPUs) is not simulated")
    strategy = config.get("sharding_strategy")
    if strategy is not None:
        named = str(strategy).lower().split(".")[-1]
        if named not in FSDP_WORDS or named == "auto_wrap":
            raise UserError(f"{label}: sharding_strategy {short(strategy)} is not FSDP2's (FULL_SHARD, SHARD_GRAD_OP)")
        sharding = FSDP_WORDS[named]
    if "reshard_after_forward" in config:
        reshard = config["reshard_after_forward"]
        if str(reshard).lower() not in ("true", "false"):
            raise UserError(f"{label}: reshard_after_forward must be true or false, not {short(reshard)}")
        sharding = "fsdp" if str(reshard).lower() == "true" else "fsdp-no-reshard"
    settings = {"sharding": sharding, "notes": [f"{label}: {what} is not modelled"
                                                for key, what in FSDP_NOTED.items() if config.get(key)]}
    if str(config.get("activation_checkpointing", False)).lower() == "true":
        settings["checkpointing"] = True
        settings["notes"].append(f"{label}: FSDP's activation_checkpointing is simulated as gradient checkpointing "
                                 "of the decoder layers")
    if config.get("auto_wrap_policy") not in (None, "TRANSFORMER_BASED_WRAP"):
        settings["notes"].append(f"{label}: auto_wrap_policy {short(config['auto_wrap_policy'])} is simulated as "
                                 "TRANSFORMER_BASED_WRAP (each decoder layer its own FSDP unit)")
    if str(config.get("cpu_offload") or config.get("offload_params") or "false").lower() not in ("false", "none"):
        settings["sharding"] = "fsdp-offload"  # FSDP2's CPUOffloadPolicy, whichever the resharding
    return settings


def check_crashing_sharding(sharding: str | None, client: str) -> None:
    """A sharding whose real run crashes (`KNOWN_CRASHES`, under the Trainer clients) answers as that crash
    (`RunWouldCrash`); the loop's is not simulated."""
    from pipeline.core.vocabulary import CRASHING_SHARDINGS, TRAINER_CLIENTS
    from pipeline.simulate.crashes import RunWouldCrash

    if sharding not in CRASHING_SHARDINGS:
        return
    if client not in TRAINER_CLIENTS:
        raise UserError(f"sharding {sharding} of the {client} client is not simulated yet (the Trainer clients' run "
                        "crashes: --client trainer says where)")
    raise RunWouldCrash(KNOWN_CRASHES[sharding])


def read_accelerate_config(source) -> dict:
    """{"num_gpus", "sharding", "autocast"?, "notes"} of an accelerate config file (YAML or JSON path, or its dict)."""
    config, label = _load_accelerate(source)
    unknown = sorted(set(config) - ACCELERATE_KEYS)
    if unknown:
        raise UserError(f"{label}: unknown accelerate config key {short(unknown[0])}")
    kind = str(config.get("distributed_type", "NO")).upper().removeprefix("DISTRIBUTEDTYPE.")
    processes = config.get("num_processes", 1)
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise UserError(f"{label}: num_processes must be a positive integer, not {short(processes)}")
    settings = {"num_gpus": processes, "notes": []}
    if config.get("use_cpu"):
        raise UserError(f"{label}: use_cpu: a CPU run has no GPU memory to estimate")
    if kind == "NO":
        settings["num_gpus"] = 1
    elif kind == "MULTI_GPU":
        settings["sharding"] = "ddp"
    elif kind == "FSDP":
        fsdp = _fsdp_config(config.get("fsdp_config"), label)
        settings.update({k: v for k, v in _with_config("fsdp", fsdp, label).items() if k != "notes"})
        settings["notes"] += _with_config("fsdp", fsdp, label)["notes"]
    elif kind == "DEEPSPEED":
        settings["deepspeed_source"] = deepspeed_of_accelerate(config.get("deepspeed_config"), label)
    else:
        raise UserError(f"{label}: distributed_type {short(kind)} is not simulated (NO, MULTI_GPU, FSDP are)")
    precision = str(config.get("mixed_precision", "no")).lower()
    if precision not in AUTOCAST:
        raise UserError(f"{label}: mixed_precision {short(precision)} is not simulated (no, bf16, fp16)")
    if "mixed_precision" in config:
        settings["autocast"] = AUTOCAST[precision]
    if settings["num_gpus"] > 1 and "sharding" not in settings and "deepspeed_source" not in settings:
        raise UserError(f"{label}: {settings['num_gpus']} processes need a distributed_type (MULTI_GPU, FSDP, "
                        "DEEPSPEED)")
    return settings


# accelerate's deepspeed_config keys (`accelerate config` writes them) and the DeepSpeed config keys they stand for
ACCELERATE_DEEPSPEED = {"zero_stage", "offload_optimizer_device", "offload_param_device", "offload_optimizer_nvme_path",
                        "offload_param_nvme_path", "gradient_accumulation_steps", "gradient_clipping", "zero3_init_flag",
                        "zero3_save_16bit_model", "deepspeed_config_file", "deepspeed_multinode_launcher",
                        "deepspeed_hostfile", "deepspeed_exclusion_filter", "deepspeed_inclusion_filter",
                        "deepspeed_moe_layer_cls_names", "transformer_moe_cls_names", "enable_msamp", "msamp_opt_level"}


def deepspeed_of_accelerate(section, label: str):
    """The DeepSpeed config an accelerate config launches: its `deepspeed_config_file`, or the one accelerate's
    DeepSpeedPlugin makes of zero_stage, the offload devices, accumulation and clipping ("auto" elsewhere)."""
    if not isinstance(section, dict):
        raise UserError(f"{label}: distributed_type DEEPSPEED needs a deepspeed_config (zero_stage, or "
                        "deepspeed_config_file)")
    unknown = sorted(set(section) - ACCELERATE_DEEPSPEED)
    if unknown:
        raise UserError(f"{label}: unknown deepspeed_config key {short(unknown[0])}")
    if section.get("deepspeed_config_file"):
        return section["deepspeed_config_file"]
    zero = {"stage": section.get("zero_stage", 2)}
    for key in ("offload_optimizer", "offload_param"):
        device = section.get(f"{key}_device", "none")
        if device not in (None, "none"):
            zero[key] = {"device": device}
    config = {"zero_optimization": zero, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        if key in section:
            config[key] = section[key]
    return config


def _load_accelerate(source) -> tuple[dict, str]:
    from pipeline.core.io import check_depth, parse_yaml, read_input_text

    if isinstance(source, dict):
        check_depth(source, "accelerate config")
        return source, "accelerate config"

    if not isinstance(source, (str, bytes)) and not hasattr(source, "__fspath__"):
        raise UserError(f"accelerate_config must be a path of a YAML file or its dict, not {type(source).__name__}")
    label = short(str(source), 200, quote=False)
    text = read_input_text(source, "accelerate config not found", "not an accelerate config")
    config = parse_yaml(text, label, "not an accelerate config (not YAML)")
    if not isinstance(config, dict):
        raise UserError(f"{label}: not an accelerate config (a mapping of its keys is expected)")
    return config, label
