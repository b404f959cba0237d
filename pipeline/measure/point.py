"""Real peak memory of a training step (CUDA), one point at a time.

`measure_point` runs the setting's client (pipeline.measure.clients: the standard training step of
`pipeline.training.step` or the blog's loop, `variant="blog"`; or transformers.Trainer) on an already
built model: a fresh optimizer, three steps, peaks per phase (a `PhaseTracker`). `pipeline.measure.sweep`
runs it over a grid, one process per (model, precision, attention); `measure` one point of one model.

A point with adapters (LoRA, QLoRA: `Setting.adapter`, pipeline.training.adapters) gets a model of its own,
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
import os
import time
from dataclasses import asdict

from pipeline.core.text import first_line
from pipeline.core.errors import UserError
from pipeline.core.vocabulary import ATTENTIONS, PRECISIONS, ROLLOUT_CLIENTS, WEIGHT_BYTES, check_choice
from pipeline.inputs.modeling import attn_used, build, count_parameters
from pipeline.inputs.records import ModelRecord
from pipeline.measure.clients import WRAPS_ADAPTERS, client_module
from pipeline.measure.clients.tracking import PhaseTracker, storage_bytes
from pipeline.measure.device import setup_device
from pipeline.measure.nvml import nvml_columns
from pipeline.training.points import COLUMNS
from pipeline.training.step import Setting


def weights_bytes(model, device: str) -> int:
    """Allocated bytes right after the build (CUDA), or the bytes of parameters and buffers (CPU)."""
    import torch

    if device == "cuda":
        return torch.cuda.memory_allocated()
    return storage_bytes(list(model.parameters()) + list(model.buffers()))


def mode_columns(setting: Setting, blog_use_cache: bool) -> dict:
    """The blog built its model with from_pretrained, which leaves it in eval mode with the config's
    use_cache; the standard step trains in train mode with use_cache=False; GRPO's and RLOO's generation uses
    the KV cache (`training.grpo.generation_cache`)."""
    if setting.client in ROLLOUT_CLIENTS:
        from pipeline.training.rollout import Rollout

        return {"train_mode": True, "use_cache": (setting.rollout or Rollout()).defaults(setting.client).use_cache}
    return {"train_mode": not setting.blog, "use_cache": blog_use_cache if setting.blog else False}


def is_out_of_memory(exc: BaseException) -> bool:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


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
    too_large = host_memory_shortfall(record, precision, device)
    if too_large:
        return finish_row(row, status="skipped", reason=too_large)
    try:
        model, built = build_point_model(record, setting, precision, attn, device)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - a model that cannot be built is an error row
        return finish_row(row, status="error", reason=f"model build failed: {first_line(exc)}")
    row.update(built, step_flops=6.0 * built["parameters"] * batch * seq * setting.gradient_accumulation)
    row.update(measure_point(model, setting, precision, batch, seq, device, record.use_cache))
    return finish_row(row)


def host_memory_shortfall(record: ModelRecord, precision: str, device: str) -> str | None:
    """Why a CPU run cannot fit in this machine's free memory (weights, gradients and AdamW's two
    moments: four copies of the weights), or None; a CUDA run is the GPU's to refuse."""
    if device != "cpu" or not record.parameters:
        return None
    needed = 4 * WEIGHT_BYTES[precision] * record.parameters
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needed <= free:
        return None
    return f"a CPU run needs about {needed / 2**30:.1f} GiB of host memory for weights and optimizer state; " \
           f"{free / 2**30:.1f} GiB are free"


def build_point_model(record: ModelRecord, setting: Setting, precision: str, attn: str, device: str):
    """(model, the columns of its build): random weights in the precision's dtype; with adapters a
    fresh base (quantized for QLoRA) wrapped by PEFT (pipeline.training.adapters), whose `parameters` are the
    base's and `trainable_parameters` the adapters'. A client that wraps the adapters itself
    (`clients.WRAPS_ADAPTERS`: SFTTrainer's peft_config) gets the fresh base alone; it reports the
    trainable parameters as it runs."""
    start = time.perf_counter()
    config = record.transformers_config()
    if setting.adapter is not None and setting.client in WRAPS_ADAPTERS:
        from pipeline.training.adapters import build_adapter_base

        model = build_adapter_base(config, record.model_id, setting.adapter, precision, attn, device)
        parameters, trainable = record.parameters, None
    elif setting.adapter is None:
        model = build(config, precision, attn, device)
        parameters, trainable = count_parameters(model), None
    else:
        from pipeline.training.adapters import build_adapter_model, trainable_parameters

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
    row.update(setting.adapter_columns(), hyperparameters=setting.hyperparameters.to_text(),
               rollout=setting.rollout.to_text() if setting.rollout is not None else None,
               packing=setting.packing.to_text() if setting.packing is not None else None,
               alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None)
    return row


def finish_row(row: dict, **updates) -> dict:
    row.update(updates)
    now = time.time()
    row["started_at"] = row["started_at"] or now
    row["finished_at"] = row["finished_at"] or now
    return {column: row.get(column) for column in COLUMNS}
