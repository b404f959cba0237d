"""Stage: real peak memory of a training step (CUDA), one point at a time.

`measure_point` runs the setting's client (pipeline.clients: the standard training step of
`pipeline.step` or the blog's loop, `variant="blog"`; or transformers.Trainer) on an already built
model: a fresh optimizer, three steps, peaks per phase (a `PhaseTracker`). `pipeline.sweep` runs it over a grid, one process per (model, precision,
attention); `python -m pipeline measure` runs one point.

A point with adapters (LoRA, QLoRA: `Setting.adapter`, pipeline.adapters) gets a model of its own,
built fresh (`build_point_model`): PEFT wraps the base's modules in place.

Reusing one built model across points is allowed because every point starts from the same state:
fresh optimizer, grads set to None, `torch.cuda.empty_cache()`, peak counter reset. Only the weight
values drift (the optimizer updates them), and values do not change memory, except through MoE
routing, which is random for random weights anyway. `allocated_before_bytes` shows any leak.

On `device="cpu"` (a debug mode for tests) the step is real but no allocator peaks exist: the peak
columns are None and only weights, optimizer state and times are recorded.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.errors import UserError
from pipeline.modeling import _first_int, attn_used, build, context_length, count_parameters, text_config
from pipeline.paths import CONFIGS
from pipeline.clients import client_module
from pipeline.clients.tracking import PhaseTracker, optimizer_state_bytes, storage_bytes  # noqa: F401 - re-exported
from pipeline.step import TRAINER_DEFAULT_OPTIM, Setting
from pipeline.vocabulary import ATTENTIONS, CLIENTS, OPTIMIZERS, OPTIMS, PRECISIONS, VARIANTS, check_choice

# Column -> pandas dtype of results/peak_memory.parquet (the contract columns of docs/architecture.md first).
COLUMN_DTYPES = {
    "model_id": "string", "model_type": "string", "family": "string", "parameters": "Int64",
    "precision": "string", "optimizer": "string", "gradient_checkpointing": "boolean",
    "attn_implementation": "string", "variant": "string", "client": "string", "optim": "string",
    "gradient_accumulation": "Int64", "batch_size": "Int64", "seq_len": "Int64",
    "status": "string", "reason": "string",
    "peak_allocated_bytes": "Int64", "peak_reserved_bytes": "Int64", "weights_bytes": "Int64",
    "optimizer_state_bytes": "Int64", "forward_peak_bytes": "Int64", "backward_peak_bytes": "Int64",
    "optimizer_peak_bytes": "Int64", "nvml_used_bytes": "Int64", "nvml_device_used_bytes": "Int64",
    "step_seconds": "float64", "tokens_per_second": "float64", "gpu_total_bytes": "Int64",
    "device": "string", "driver_version": "string",
    "tokens": "Int64", "step_flops": "float64", "steps": "Int64", "steps_seconds_total": "float64",
    "allocated_before_bytes": "Int64", "measure_device": "string", "attn_implementation_used": "string",
    "train_mode": "boolean", "use_cache": "boolean", "allow_tf32": "boolean",
    "build_seconds": "float64", "started_at": "float64", "finished_at": "float64", "child_pid": "Int64",
    "torch_version": "string", "transformers_version": "string", "cuda_version": "string",
    "python_version": "string", "git_commit": "string", "config_source": "string",
    "config_revision": "string",
    # adapters (pipeline.adapters): None for full fine-tuning
    "lora_r": "Int64", "lora_alpha": "Int64", "lora_targets": "string", "quantization": "string",
    "trainable_parameters": "Int64",
}
COLUMNS = tuple(COLUMN_DTYPES)


# --- the model to measure: a configs.json record plus the facts a plan needs ---------------------

@dataclass(frozen=True)
class ModelRecord:
    """One model as the measurement sees it: its config.json facts, where they came from, and facts
    read from the config (`parameters` counted on the meta device, None if it cannot be built
    there; `plan_parameters` the same, else a rough 12*layers*width^2 + 2*vocab*width)."""

    model_id: str
    config: dict
    family: str | None
    model_type: str | None
    config_source: str | None
    config_revision: str | None
    parameters: int | None
    plan_parameters: int
    layers: int
    hidden: int
    vocab: int
    context: int | None
    use_cache: bool  # as the config sets it (the blog's loop uses it)

    def transformers_config(self):
        from pipeline.configs import config_from_dict

        return config_from_dict(self.config, self.model_id)

    @classmethod
    def from_config(cls, model_id: str, config, facts: dict, family: str | None, model_type: str | None,
                    source: str | None, revision: str | None) -> ModelRecord:
        """The record of a transformers `config` built from the config.json `facts`."""
        text = text_config(config)
        layers = _positive(_first_int(text, ("num_hidden_layers", "n_layer", "num_layers")))
        hidden = _positive(_first_int(text, ("hidden_size", "n_embd", "d_model")))
        vocab = _positive(_first_int(text, ("vocab_size",)))
        parameters = meta_parameters(config)
        return cls(model_id, facts, family, model_type, source, revision, parameters,
                   parameters or 12 * layers * hidden**2 + 2 * vocab * hidden, layers, hidden, vocab,
                   context_length(config), bool(getattr(text, "use_cache", True)))


def _positive(value: int | None) -> int:
    return value if value is not None and value > 0 else 1


def meta_parameters(config) -> int | None:
    from pipeline.modeling import build_model, training_config

    try:
        return count_parameters(build_model(training_config(config), device="meta"))
    except Exception:  # noqa: BLE001 - a model that cannot be built fails in its child, with a row
        return None


def load_model_records(configs_path, model_ids) -> tuple[dict[str, ModelRecord], list[str]]:
    """Records of `model_ids` from configs.json (ok entries) and the ids that have none."""
    from pipeline.configs import config_from_dict, read_config_records

    entries = read_config_records(configs_path)
    records, missing = {}, []
    for model_id in model_ids:
        entry = entries.get(model_id)
        if not entry or entry.get("status") != "ok":
            missing.append(model_id)
            continue
        records[model_id] = ModelRecord.from_config(
            model_id, config_from_dict(entry["config"], model_id), entry["config"], entry.get("family"),
            entry.get("model_type"), entry.get("config_source"), entry.get("config_revision"))
    return records, missing


def model_record(model_id: str | None, config_path: str | None, configs_path=CONFIGS) -> ModelRecord:
    """The record of one model for `measure`: configs.json first, else the registry or the Hub."""
    from pipeline.configs import config_from_file, resolve_model

    if model_id and Path(configs_path).exists():
        records, missing = load_model_records(configs_path, [model_id])
        if not missing:
            return records[model_id]
    try:
        resolved = config_from_file(config_path) if config_path else resolve_model(model_id)
    except ModuleNotFoundError as exc:  # the GPU machine has no jsonschema to read the registry with
        raise UserError(f"{model_id}: not in {configs_path}, and the registry cannot be read here "
                        f"({exc.name} is not installed)") from None
    return ModelRecord.from_config(resolved.model_id, resolved.config, resolved.config.to_dict(), None,
                                   resolved.config.model_type, resolved.source, resolved.revision)


# --- one point ------------------------------------------------------------------------------------

def weights_bytes(model, device: str) -> int:
    """Allocated bytes right after the build (CUDA), or the bytes of parameters and buffers (CPU)."""
    import torch

    if device == "cuda":
        return torch.cuda.memory_allocated()
    return storage_bytes(list(model.parameters()) + list(model.buffers()))


def mode_columns(setting: Setting, blog_use_cache: bool) -> dict:
    """The blog built its model with from_pretrained, which leaves it in eval mode with the config's
    use_cache; the standard step trains in train mode with use_cache=False."""
    return {"train_mode": not setting.blog, "use_cache": blog_use_cache if setting.blog else False}


def is_out_of_memory(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def first_line(exc: BaseException, limit: int = 300) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text}"[:limit]


def measure_point(model, setting: Setting, precision: str, batch: int, seq: int, device: str = "cuda",
                  blog_use_cache: bool = True) -> dict:
    """One grid point: the columns that the measurement fills (status ok, oom or error; skipped
    when the client cannot run the setting here, e.g. a missing optional package).

    Never raises for a failing step: out of memory is a result, any other exception an error row.
    """
    import torch

    tracker = PhaseTracker(device)
    client = client_module(setting.client)
    columns = {"status": "ok", "reason": None, "started_at": time.time(),
               "allocated_before_bytes": torch.cuda.memory_allocated() if device == "cuda" else None}
    unavailable = client.unavailable(setting, device)
    if unavailable:
        columns.update(status="skipped", reason=unavailable, finished_at=time.time())
        return columns
    try:
        columns.update(mode_columns(setting, blog_use_cache))
        seconds, state_bytes = client.run_steps(model, setting, precision, batch, seq, device, tracker,
                                                columns["use_cache"])
    except Exception as exc:  # noqa: BLE001 - a failing point is recorded, the sweep goes on
        oom = is_out_of_memory(exc)
        where = f" in {tracker.current}" if tracker.current else ""
        columns.update(status="oom" if oom else "error", reason=f"{'out of memory' if oom else 'failed'}{where}: "
                       f"{first_line(exc)}")
        seconds, state_bytes = None, None
    if columns["status"] == "ok":
        median = sorted(seconds)[len(seconds) // 2]
        tokens = batch * seq * setting.gradient_accumulation  # per optimizer step
        columns.update(tracker.columns(), optimizer_state_bytes=state_bytes, step_seconds=median,
                       steps=len(seconds), steps_seconds_total=sum(seconds),
                       tokens_per_second=tokens / median if median > 0 else None)
        columns.update(nvml_columns(device))
    release(model, device, columns["status"] != "ok", columns["allocated_before_bytes"])
    columns["finished_at"] = time.time()
    return columns


def release(model, device: str, failed: bool, allocated_before: int | None) -> None:
    """Back to weights only: grads to None, cache emptied, and reference cycles collected where
    memory is still held (after a failure, whose traceback held the step's tensors)."""
    import torch

    model.zero_grad(set_to_none=True)
    if failed or device != "cuda" or torch.cuda.memory_allocated() > allocated_before:
        gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# --- NVML: the process's memory as the driver sees it (context + allocator cache) -----------------

_NVML = {"ready": None}


def _nvml():
    if _NVML["ready"] is None:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML["ready"] = pynvml
        except Exception:  # noqa: BLE001 - NVML is optional
            _NVML["ready"] = False
    return _NVML["ready"]


def nvml_columns(device: str) -> dict:
    """`nvml_used_bytes` (this process, None where NVML cannot see it, e.g. in a PID namespace)
    and `nvml_device_used_bytes` (the whole GPU)."""
    pynvml = _nvml() if device == "cuda" else None
    if not pynvml:
        return {"nvml_used_bytes": None, "nvml_device_used_bytes": None}
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        for handle in handles:
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == os.getpid():
                    return {"nvml_used_bytes": process.usedGpuMemory,
                            "nvml_device_used_bytes": pynvml.nvmlDeviceGetMemoryInfo(handle).used}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        index = int(visible) if visible.isdigit() else (0 if len(handles) == 1 else None)
        used = pynvml.nvmlDeviceGetMemoryInfo(handles[index]).used if index is not None else None
        return {"nvml_used_bytes": None, "nvml_device_used_bytes": used}
    except Exception:  # noqa: BLE001
        return {"nvml_used_bytes": None, "nvml_device_used_bytes": None}


# --- one process's setup --------------------------------------------------------------------------

def setup_device(device: str, allow_tf32: bool) -> dict:
    """Initialise the device once per process; the columns that describe it (with provenance)."""
    import torch

    from pipeline.provenance import provenance

    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.init()
        torch.set_float32_matmul_precision("high" if allow_tf32 else "highest")
        total = torch.cuda.get_device_properties(0).total_memory
    else:
        total = None
    row = provenance()
    row.update(gpu_total_bytes=total, measure_device=device, allow_tf32=allow_tf32 if device == "cuda" else False)
    return row


def cuda_available() -> bool:
    """Whether CUDA can be used, asked through NVML so that this process stays fork-safe."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    return torch.cuda.is_available()


def resolve_device(device: str) -> str | None:
    """`auto` -> cuda when available, else None (the caller decides what no GPU means)."""
    if device == "auto":
        return "cuda" if cuda_available() else None
    if device == "cuda" and not cuda_available():
        raise UserError("--device cuda: no CUDA device is available here")
    return device


# --- `python -m pipeline measure` -----------------------------------------------------------------

def measure(record: ModelRecord, batch: int, seq: int, precision: str = "fp32", setting: Setting = Setting(),
            attn: str = "default", device: str = "cuda", allow_tf32: bool = True) -> dict:
    """One point of one model, in this process: a full peak-memory row (see `model_record`)."""
    check_choice("precision", precision, PRECISIONS)
    check_choice("attn_implementation", attn, ATTENTIONS)
    setting.check()
    if batch <= 0 or seq <= 0:
        raise UserError("batch size and sequence length must be positive")
    limit = record.context
    row = base_columns(record, precision, attn, setting, batch, seq)
    row.update(setup_device(device, allow_tf32))
    if limit is not None and seq > limit:
        return finish_row(row, status="skipped", reason=f"seq_len {seq} beyond the context length {limit}")
    unavailable = client_module(setting.client).unavailable(setting, device)
    if unavailable:
        return finish_row(row, status="skipped", reason=unavailable)
    try:
        model, built = build_point_model(record, setting, precision, attn, device)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - a model that cannot be built is an error row
        return finish_row(row, status="error", reason=f"model build failed: {first_line(exc)}")
    row.update(built, step_flops=6.0 * built["parameters"] * batch * seq * setting.gradient_accumulation)
    row.update(measure_point(model, setting, precision, batch, seq, device, record.use_cache))
    return finish_row(row)


def build_point_model(record: ModelRecord, setting: Setting, precision: str, attn: str, device: str):
    """(model, the columns of its build): random weights in the precision's dtype; with adapters a
    fresh base (quantized for QLoRA) wrapped by PEFT (pipeline.adapters), whose `parameters` are the
    base's and `trainable_parameters` the adapters'."""
    start = time.perf_counter()
    config = record.transformers_config()
    if setting.adapter is None:
        model = build(config, precision, attn, device)
        parameters, trainable = count_parameters(model), None
    else:
        from pipeline.adapters import build_adapter_model, trainable_parameters

        model = build_adapter_model(config, record.model_id, setting.adapter, precision, attn, device,
                                    setting.gradient_checkpointing)
        parameters, trainable = record.parameters, trainable_parameters(model)
    return model, {"build_seconds": time.perf_counter() - start, "weights_bytes": weights_bytes(model, device),
                   "parameters": parameters, "attn_implementation_used": attn_used(model),
                   "trainable_parameters": trainable}


def base_columns(record: ModelRecord, precision: str, attn: str, setting: Setting, batch: int, seq: int) -> dict:
    row = dict.fromkeys(COLUMNS)
    row.update(model_id=record.model_id, model_type=record.model_type, family=record.family,
               parameters=record.parameters, precision=precision, attn_implementation=attn,
               batch_size=batch, seq_len=seq, tokens=batch * seq * setting.gradient_accumulation,
               config_source=record.config_source,
               config_revision=record.config_revision, child_pid=os.getpid(), **asdict(setting))
    row.update(setting.adapter_columns())
    return row


def finish_row(row: dict, **updates) -> dict:
    row.update(updates)
    now = time.time()
    row["started_at"] = row["started_at"] or now
    row["finished_at"] = row["finished_at"] or now
    return {column: row.get(column) for column in COLUMNS}


def add_cli(subparsers) -> None:
    from pipeline.arguments import positive_int

    parser = subparsers.add_parser("measure", help="peak memory of one training point (CUDA; --device cpu to debug)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model id (looked up in --configs, else the registry or the Hub)")
    source.add_argument("--config", help="a Hugging Face config.json")
    parser.add_argument("--configs", default=CONFIGS, help="output of `pipeline configs`")
    parser.add_argument("--batch", type=positive_int, required=True)
    parser.add_argument("--seq", type=positive_int, required=True)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--client", choices=CLIENTS, default="loop")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, help="the loop's optimizer (default adamw)")
    parser.add_argument("--optim", choices=OPTIMS, help=f"the trainer's, by transformers name (default {TRAINER_DEFAULT_OPTIM})")
    parser.add_argument("--gradient-accumulation", type=positive_int, default=1, metavar="K",
                        help="micro-batches per optimizer step (trainer)")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--attn", choices=ATTENTIONS, default="default")
    parser.add_argument("--variant", choices=VARIANTS, default="standard")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--no-tf32", action="store_true", help="keep fp32 matmuls in full fp32 (slower)")
    parser.add_argument("--json", action="store_true", help="print the whole row as JSON")
    from pipeline.adapters import add_adapter_arguments

    add_adapter_arguments(parser)
    parser.set_defaults(handler=_measure_command)


def _measure_command(args) -> int:
    device = resolve_device(args.device)
    if device is None:
        raise UserError("no CUDA device here; use --device cpu for a (peak-less) CPU debug run")
    record = model_record(args.model, args.config, args.configs)
    from pipeline.adapters import adapter_from_arguments

    setting = Setting(args.variant, args.optimizer, args.checkpointing, args.client, args.optim,
                      args.gradient_accumulation, adapter_from_arguments(args))
    row = measure(record, args.batch, args.seq, args.precision, setting, args.attn, device, not args.no_tf32)
    if args.json:
        print(json.dumps(row, default=str))
    else:
        peak = row["peak_allocated_bytes"]
        print(f"{row['model_id']} {args.precision} B={args.batch} L={args.seq}: {row['status']}"
              + (f", peak {peak / 2**30:.2f} GiB" if peak else "") + (f" ({row['reason']})" if row["reason"] else ""))
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m pipeline.memory", commands=(add_cli,)) -> int:
    """`python -m pipeline.memory measure ...`: only the `commands` given (each an `add_cli`), so that
    the GPU machine does not depend on the other stages' imports (`python -m pipeline.sweep` adds
    the sweep)."""
    from pipeline.arguments import OneLineParser

    parser = OneLineParser(prog=prog)
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for add in commands:
        add(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.handler(args) or 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
