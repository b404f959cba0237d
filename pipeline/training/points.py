"""The peak table's contract (results/peak_memory.parquet and the per-setting tables beside it):
its columns and their types, the key of a measured point, how rows written before a column existed
are read, and the one reader of such a table. The measurement writes it, the simulator and the
validation read it (docs/architecture.md, "Tables")."""

from __future__ import annotations

from pipeline.core.io import cell, read_table
from pipeline.core.vocabulary import OPTIM_OF_LOOP_OPTIMIZER
from pipeline.training.step import Setting

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
    # adapters (pipeline.training.adapters): None for full fine-tuning
    "lora_r": "Int64", "lora_alpha": "Int64", "lora_targets": "string", "quantization": "string",
    "lora_dropout": "float64", "trainable_parameters": "Int64",
    # Liger's kernels (use_liger_kernel) and the share of positions with a label (SFTTrainer's completion mask)
    "liger_kernel": "boolean", "completion_share": "float64",
    # GRPO / RLOO (`training.rollout`): the rollout's keys as JSON (None: TRL's defaults); every phase's peak (JSON:
    # generation and log-probs beside forward, backward, optimizer); the peak so far after each optimizer step
    "rollout": "string", "phase_peaks": "string", "step_peaks": "string",
    # PYTORCH_CUDA_ALLOC_CONF as the process had it (None: the allocator's defaults)
    "alloc_conf": "string",
    # sft's packed or padding-free batches (`training.packing`) as JSON; None: B rows of L tokens
    "packing": "string",
}
COLUMNS = tuple(COLUMN_DTYPES)

# A measured point of the peak table is one row per these columns.
# The adapter columns (LoRA rank, targets and dropout, the base's quantization) are None without adapters (an adapter
# row written before lora_dropout ran without dropout: 0.0); liger_kernel is false and completion_share 1.0 where
# they do not apply (and in rows written before them).
POINT_KEY = ("model_id", "precision", "variant", "optimizer", "gradient_checkpointing", "attn_implementation",
             "batch_size", "seq_len", "client", "optim", "gradient_accumulation", "lora_r", "lora_targets",
             "quantization", "liger_kernel", "completion_share", "lora_dropout")
ADAPTER_KEY = ("lora_r", "lora_targets", "quantization", "lora_dropout")
# The key of the standard step's points before the client and adapter columns (the simulate stage's table).
STANDARD_KEY = POINT_KEY[:8]
# The columns added after the client columns, and what a row written before them means.
SETTING_DEFAULTS = {"liger_kernel": False, "completion_share": 1.0}


def with_client_columns(row: dict) -> dict:
    """A row written before the client columns existed is the loop's: client loop, optim as the loop's
    optimizer's transformers name, no gradient accumulation; one written before the Liger and
    completion columns ran without Liger, every position labelled (`SETTING_DEFAULTS`)."""
    missing = {k: v for k, v in SETTING_DEFAULTS.items() if row.get(k) is None}
    if cell(row, "lora_r") is not None and cell(row, "lora_dropout") is None:
        missing["lora_dropout"] = 0.0
    if missing:
        row = {**row, **missing}
    if row.get("client") is not None:
        return row
    setting = Setting.from_row(row)
    return {**row, "client": setting.client, "optim": setting.optim,
            "gradient_accumulation": setting.gradient_accumulation}


def with_client_columns_frame(frame):
    """A peak table (pandas) read as `with_client_columns` reads a row: missing client columns are the
    loop's, missing adapter columns None (full fine-tuning)."""
    missing = [column for column in ADAPTER_KEY if column not in frame.columns]
    defaults = {column: value for column, value in SETTING_DEFAULTS.items()
                if column not in frame.columns or frame[column].isna().any()}
    if missing or defaults:
        frame = frame.copy()
        for column in missing:
            frame[column] = None
        for column, value in defaults.items():
            frame[column] = frame[column].fillna(value) if column in frame.columns else value
    if frame["lora_dropout"].isna().any():  # adapter rows written before the column ran without dropout
        frame = frame.copy()
        frame["lora_dropout"] = frame["lora_dropout"].astype("float64").mask(
            frame["lora_dropout"].isna() & frame["lora_r"].notna(), 0.0)
    if "client" in frame.columns:
        return frame
    frame = frame.copy()
    frame["client"] = "loop"
    frame["optim"] = frame["optimizer"].map(OPTIM_OF_LOOP_OPTIMIZER)
    frame["gradient_accumulation"] = 1
    return frame


def first_in_process(frame):
    """Whether each row of a peak table (pandas) is the first point its process ran (`child_pid`,
    `started_at`; a process measures one model): the first whose steps ran (CUDA's
    `allocated_before_bytes` recorded; a skipped point or one settled after an oom ran nothing). There
    cuBLAS's workspaces were made inside the step, not before it (`values.Run.fresh_process`)."""
    import pandas as pd

    if not {"child_pid", "started_at", "model_id"} <= set(frame.columns):
        return pd.Series(False, index=frame.index)
    ran = frame["allocated_before_bytes"].notna() if "allocated_before_bytes" in frame.columns else \
        pd.Series(True, index=frame.index)
    order = frame[ran].sort_values("started_at").groupby(["child_pid", "model_id"]).cumcount()
    return (order == 0).reindex(frame.index, fill_value=False).astype(bool)


def table_rows(path) -> list[dict]:
    """The rows of a peak table (parquet) as plain values, missing ones None."""
    frame = read_table(path, "peak")
    return frame.astype(object).where(frame.notna(), None).to_dict("records")


def read_peaks(path, label: str = "peak"):
    """A peak table, rows from before the client and adapter columns read as the loop's, full fine-tuning."""
    return with_client_columns_frame(read_table(path, label))
