"""DeepSpeed ZeRO as the Trainer runs it: a DeepSpeed config (the file of `--deepspeed ds_config.json`, the
`deepspeed` key of TrainingArguments / SFTConfig, an accelerate config's `deepspeed_config`) read and checked
without torch or DeepSpeed, and carried as its JSON text (`Run.deepspeed`, the tables' `deepspeed` column).

The stage names the sharding: `zero1`, `zero2`, `zero3` (`STAGES`). What the Trainer fills in is left to it
("auto": batch sizes, accumulation, clipping, bf16 / fp16 from the training arguments, stage 3's bucket sizes
from the model's hidden size, `transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig`); a number there
must agree with the run's, as the Trainer requires. The ZeRO knobs that change memory (`overlap_comm`,
`contiguous_gradients`, `reduce_bucket_size`, `allgather_bucket_size`, `stage3_prefetch_bucket_size`,
`stage3_max_live_parameters`, `stage3_param_persistence_threshold`, `offload_optimizer`, `offload_param`, ...)
go to DeepSpeed as written: its own code decides what they do. What the simulator does not run is refused in
one line (ZeRO++, MiCS, NVMe offload, DeepSpeed's pipeline, tensor and sequence parallelism, its activation
checkpointing); unknown keys too, so that a typo is not an answer to another question.
"""

from __future__ import annotations

import contextlib
import json
import math

from pipeline.core.errors import UserError
from pipeline.core.text import short

STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
# top-level keys: those the Trainer fills or that change a step's memory, run as written
RUN = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
       "bf16", "fp16", "optimizer", "scheduler", "zero_optimization", "zero_allow_untested_optimizer",
       "zero_force_ds_cpu_optimizer", "communication_data_type", "prescale_gradients", "gradient_predivide_factor",
       "data_types", "memory_breakdown", "sparse_gradients", "disable_allgather", "seq_parallel_communication_data_type"}
# top-level keys that change no memory of a step (logging, monitoring, checkpoint files)
NO_MEMORY = {"steps_per_print", "wall_clock_breakdown", "dump_state", "tensorboard", "wandb", "csv_monitor", "comet",
             "comms_logger", "flops_profiler", "checkpoint", "logging", "monitor_config", "timers", "dataloader_drop_last",
             "use_node_local_storage", "load_universal_checkpoint", "graph_harvesting", "weight_quantization",
             "eigenvalue", "progressive_layer_drop", "train_data_path", "zero_legacy_stage1"}
REFUSED = {"amp": "apex AMP", "activation_checkpointing": "DeepSpeed's activation checkpointing (use "
           "gradient_checkpointing)", "torch_autocast": "DeepSpeed's torch_autocast", "pipeline": "pipeline parallelism",
           "tensor_parallel": "DeepSpeed's AutoTP", "sequence_parallel_size": "sequence parallelism",
           "compression_training": "compression training", "sparse_attention": "sparse attention",
           "data_efficiency": "data efficiency", "curriculum_learning": "curriculum learning",
           "autotuning": "autotuning", "elasticity": "elasticity", "aio": "NVMe offload (aio)",
           "hybrid_engine": "the hybrid engine", "quantize_training": "quantized training", "moe": "MoE layers",
           "compile": "DeepSpeed's compile"}
# zero_optimization keys run as written (DeepSpeedZeroConfig's, stage 3's under their stage3_ names)
ZERO_KEYS = {"stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
             "allgather_partitions", "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights",
             "elastic_checkpoint", "offload_param", "offload_optimizer", "sub_group_size", "cpu_offload",
             "cpu_offload_param", "cpu_offload_use_pin_memory", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
             "stage3_param_persistence_threshold", "param_persistence_threshold", "stage3_model_persistence_threshold",
             "model_persistence_threshold", "stage3_max_live_parameters", "max_live_parameters",
             "stage3_max_reuse_distance", "max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
             "gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
             "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients", "memory_efficient_linear",
             "stage3_module_granularity_threshold", "module_granularity_threshold", "log_trace_cache_warnings",
             "override_module_apply", "pipeline_loading_checkpoint", "enable_sanity_checks", "parameter_alignment",
             "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params", "stage3_allgather_sequential",
             "allgather_sequential", "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
             "zero_quantized_nontrainable_weights", "mics_shard_size", "mics_hierarchical_params_gather", "zenflow",
             "leaf_module", "reduce_scatter_dtype", "save_muon_momentum_buffer_in_memory"}
ZERO_REFUSED = {"zero_hpz_partition_size": "ZeRO++'s hierarchical partitioning", "zero_quantized_weights":
                "ZeRO++'s quantized weights", "zero_quantized_gradients": "ZeRO++'s quantized gradients",
                "zero_quantized_nontrainable_weights": "ZeRO++'s quantized weights", "mics_shard_size": "MiCS",
                "zenflow": "ZenFlow"}
OFFLOAD_KEYS = {"device", "pin_memory", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read",
                "pipeline_write", "fast_init", "ratio", "super_offload", "cpuadam_cores_perc", "pipeline"}
# zero_optimization sizes that DeepSpeed allocates as buffers (elements), and the counts it compares against
BUFFER_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")
MAX_BUFFER_ELEMENTS = 10**13  # 20 TB in bf16: more than any GPU holds, still exact in an int64
MAX_COUNT = 10**18
OPTIMIZER_TYPES = ("adam", "adamw")  # DeepSpeed's FusedAdam (DeepSpeedCPUAdam when the optimizer is offloaded)
DEFAULT = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
           "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}


def default_config(sharding: str) -> str:
    """The config of `--sharding zero1|zero2|zero3` without a file: the stage, everything else "auto" or
    DeepSpeed's defaults (the Trainer's documented minimal config)."""
    return canonical({**DEFAULT, "zero_optimization": {"stage": STAGES[sharding]}})


def canonical(config: dict) -> str:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def read_deepspeed(source, label: str | None = None) -> dict:
    """{"sharding", "deepspeed" (the config's JSON text), "batch"?, "gradient_accumulation"?, "autocast"?,
    "notes"} of a DeepSpeed config: a path of its JSON file or its dict."""
    config, label = _load(source, label)
    unknown = sorted(set(config) - RUN - NO_MEMORY - set(REFUSED))
    if unknown:
        raise UserError(f"{label}: unknown DeepSpeed key {short(unknown[0])}")
    for key, what in REFUSED.items():
        if key in config and _enabled(config[key]):
            raise UserError(f"{label}: {what} ({key}) is not simulated")
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        raise UserError(f"{label}: zero_optimization must be an object with a stage (1, 2 or 3), not {short(zero)}")
    stage = _stage(zero.get("stage"), label)
    _check_zero(zero, stage, label)
    settings = {"sharding": f"zero{stage}", "notes": []}
    settings.update(_numbers(config, label))
    autocast = _autocast(config, label)
    if autocast != "auto":
        settings["autocast"] = autocast
    _check_optimizer(config.get("optimizer"), label)
    if config.get("optimizer") is not None:
        settings["notes"].append(f"{label}: its optimizer section ({config['optimizer'].get('type')}) runs, not the "
                                 "training arguments' optim: DeepSpeed's FusedAdam (DeepSpeedCPUAdam when the optimizer "
                                 "is offloaded), simulated as torch's fused AdamW (the same state)")
    offloaded = any(_offload_device(zero.get(key), key, label) == "cpu" for key in ("offload_optimizer",
                                                                                      "offload_param"))
    if offloaded and config.get("optimizer") is None and config.get("zero_force_ds_cpu_optimizer", True) is not False:
        raise UserError(f"{label}: ZeRO-Offload with the Trainer's optimizer needs \"zero_force_ds_cpu_optimizer\": "
                        "false (DeepSpeed refuses it otherwise), or an optimizer section (its DeepSpeedCPUAdam)")
    return {**settings, "deepspeed": canonical({**DEFAULT, **config})}


def _load(source, label) -> tuple[dict, str]:
    if isinstance(source, dict):
        from pipeline.core.io import check_depth

        check_depth(source, label or "deepspeed config")
        return source, label or "deepspeed config"
    if not isinstance(source, (str, bytes)) and not hasattr(source, "__fspath__"):
        raise UserError(f"deepspeed must be a path of a JSON file or its dict, not {type(source).__name__}")
    from pipeline.core.io import read_json_object

    label = label or short(str(source), 200, quote=False)
    config = read_json_object(source, "DeepSpeed config not found", "not a DeepSpeed config",
                              "not a DeepSpeed config (an object is expected)")
    return config, label


def _enabled(value) -> bool:
    if isinstance(value, dict):
        return value.get("enabled", True) not in (False, "false")
    return value not in (None, False, 0, "", {}, [])


def _stage(stage, label: str) -> int:
    if stage in (1, 2, 3) and not isinstance(stage, bool):
        return stage
    if stage == 0:
        raise UserError(f"{label}: ZeRO stage 0 is DeepSpeed's plain data parallelism, not simulated (ddp is: "
                        "--sharding ddp)")
    raise UserError(f"{label}: zero_optimization stage must be 1, 2 or 3, not {short(stage)}")


def _check_zero(zero: dict, stage: int, label: str) -> None:
    unknown = sorted(set(zero) - ZERO_KEYS)
    if unknown:
        raise UserError(f"{label}: unknown zero_optimization key {short(unknown[0])}")
    for key, what in ZERO_REFUSED.items():
        value = zero.get(key)
        on = value is True if isinstance(value, bool) else value not in (None, 0, 1, -1) and _enabled(value)
        if on:  # a partition size of 1 is one partition, -1 is MiCS off
            raise UserError(f"{label}: {what} ({key}) is not simulated")
    for key in ("offload_optimizer", "offload_param"):
        device = _offload_device(zero.get(key), key, label)
        if key == "offload_param" and device != "none" and stage != 3:
            raise UserError(f"{label}: offload_param is stage 3's; stage {stage} offloads the optimizer only")
        if device == "nvme":
            raise UserError(f"{label}: {key} to NVMe is not simulated (cpu is)")
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_max_live_parameters", "stage3_param_persistence_threshold", "stage3_max_reuse_distance",
                "sub_group_size", "stage3_model_persistence_threshold"):
        value = zero.get(key)
        if value is None or value == "auto":
            continue
        if not whole_number(value):
            raise UserError(f"{label}: zero_optimization {key} must be a whole number of elements or \"auto\", "
                            f"not {short(value)}")
        limit = MAX_BUFFER_ELEMENTS if key in BUFFER_KEYS else MAX_COUNT
        if value > limit:
            what = ("DeepSpeed allocates buffers of that many elements: the run stops out of memory"
                    if key in BUFFER_KEYS else "beyond any model")
            raise UserError(f"{label}: zero_optimization {key} {short(value, 20)} is more than {limit:.0e} elements "
                            f"({what})")


def whole_number(value) -> bool:
    """A count of elements: a non-negative integer, or a float with an integer's value (JSON's 2e8)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return value >= 0 and value == int(value)


def offload_devices(config_text: str) -> dict:
    """{"offload_optimizer", "offload_param"}: "cpu" or "none" each."""
    zero = json.loads(config_text).get("zero_optimization", {})
    return {key: _offload_device(zero.get(key), key, "deepspeed") for key in ("offload_optimizer", "offload_param")}


def _offload_device(section, key: str, label: str) -> str:
    if section in (None, {}):
        return "none"
    if not isinstance(section, dict):
        raise UserError(f"{label}: {key} must be an object ({{\"device\": \"cpu\"}}), not {short(section)}")
    unknown = sorted(set(section) - OFFLOAD_KEYS)
    if unknown:
        raise UserError(f"{label}: unknown {key} key {short(unknown[0])}")
    device = str(section.get("device", "none")).lower()
    if device not in ("none", "cpu", "nvme"):
        raise UserError(f"{label}: {key} device must be none, cpu or nvme, not {short(section.get('device'))}")
    return device


def _numbers(config: dict, label: str) -> dict:
    """The batch and accumulation a config fixes (numbers, not "auto")."""
    found = {}
    for key, name in (("train_micro_batch_size_per_gpu", "batch"), ("gradient_accumulation_steps",
                                                                     "gradient_accumulation")):
        value = config.get(key, "auto")
        if value == "auto":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{label}: {key} must be a positive integer or \"auto\", not {short(value)}")
        found[name] = value
    total = config.get("train_batch_size", "auto")
    if total != "auto" and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
        raise UserError(f"{label}: train_batch_size must be a positive integer or \"auto\", not {short(total)}")
    return found


def _autocast(config: dict, label: str):
    """"bf16", "fp16" or None as the config fixes it, "auto" where the training arguments decide."""
    flags = {}
    for key in ("bf16", "fp16"):
        section = config.get(key, {"enabled": "auto"})
        if not isinstance(section, dict):
            raise UserError(f"{label}: {key} must be an object ({{\"enabled\": ...}}), not {short(section)}")
        enabled = section.get("enabled", False if key in config else "auto")
        if enabled not in (True, False, "auto"):
            raise UserError(f"{label}: {key} enabled must be true, false or \"auto\", not {short(enabled)}")
        flags[key] = enabled
    if flags["bf16"] is True and flags["fp16"] is True:
        raise UserError(f"{label}: bf16 and fp16 are both enabled")
    if True in flags.values():
        return "bf16" if flags["bf16"] is True else "fp16"
    return "auto" if "auto" in flags.values() else None


def _check_optimizer(section, label: str) -> None:
    if section is None:
        return
    if not isinstance(section, dict) or str(section.get("type", "")).lower() not in OPTIMIZER_TYPES:
        kind = section.get("type") if isinstance(section, dict) else section
        raise UserError(f"{label}: DeepSpeed optimizer {short(kind)} is not simulated (Adam, AdamW are; without an "
                        "optimizer section the Trainer's optim runs)")


def check_run(config_text: str, sharding: str, batch: int, accumulation: int, num_gpus: int, autocast) -> None:
    """The config's numbers and precision agree with the run's (the Trainer refuses a mismatch)."""
    config = json.loads(config_text)
    stage = config["zero_optimization"]["stage"]
    if STAGES.get(sharding) != stage:
        raise UserError(f"the DeepSpeed config's stage {stage} is zero{stage}, not sharding {sharding}")
    numbers = _numbers(config, "the DeepSpeed config")
    for name, value in (("batch", batch), ("gradient_accumulation", accumulation)):
        if name in numbers and numbers[name] != value:
            raise UserError(f"the DeepSpeed config's {name.replace('_', ' ')} {numbers[name]} is not the run's {value}")
    total = config.get("train_batch_size", "auto")
    if total != "auto" and total != batch * accumulation * num_gpus:
        raise UserError(f"the DeepSpeed config's train_batch_size {total} is not batch x accumulation x GPUs "
                        f"({batch} x {accumulation} x {num_gpus})")
    fixed = _autocast(config, "the DeepSpeed config")
    if fixed != "auto" and fixed != autocast:
        raise UserError(f"the DeepSpeed config's precision ({fixed or 'fp32'}) is not the run's "
                        f"({autocast or 'no autocast'})")


@contextlib.contextmanager
def zero3_init(config_text: str, batch: int, accumulation: int, precision: str):
    """While it lasts, a model built with transformers (`from_config`, `from_pretrained`) is built as a script's
    is after its training arguments name a ZeRO-3 config: under `deepspeed.zero.Init` (the arguments'
    `HfDeepSpeedConfig` is in force while they live), each parameter partitioned on the GPU as it is made."""
    import tempfile

    from transformers import TrainingArguments

    from pipeline.training.step import mixed_precision_args

    with tempfile.TemporaryDirectory(prefix="avp-zero3-") as output_dir:
        args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=accumulation, report_to="none",
                                 deepspeed=json.loads(config_text), **mixed_precision_args(precision))
        yield
        del args
