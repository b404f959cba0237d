"""Stage: the estimators against the training settings beyond the standard step (the Trainer and
SFTTrainer clients, amp-fp16, bf16-autocast, the optimizers, adapters, Liger), measured on several GPUs.

The measured tables are one per GPU and plan (`SETTINGS_TABLES`: the tuned plan and its held-out
models, whose rows nobody tunes on); `settings_rows` joins them with their `split`. Every `ok` and
`oom` row is answered by each estimator with the row's client, optim, accumulation and precision:

- `exact`: the simulator (`pipeline.simulate.simulate`: `trainer_peak` for the Trainer, `sft_peak` for
  SFTTrainer, `loop_peak` for the loop),
  run once by `simulate-settings` into a table (results/settings_simulated.parquet) that
  `validate-settings` reads, as the standard step's `simulate-peaks` and `validate` do;
- `formula`, `heuristic`, `blog`: the closed forms with each optimizer's terms.

Each row gets allocated and reserved errors and the fit verdict on the measured GPU (predicted
reserved + the memory outside PyTorch <= the GPU's CUDA total), summarized per split, client,
estimator and device. The exact replay of the reserved bytes stops at that GPU's edge (cached
segments given back after a failed cudaMalloc, as the allocator does): the simulated table is
keyed by the point and its device.
"""

from __future__ import annotations

import math

from pipeline.formulas.coefficients import reserved_ratio
from dataclasses import replace

from pipeline.formulas.gpus import context_bytes, nccl_bytes
from pipeline.core.errors import UserError
from pipeline.core.vocabulary import SPLITS, check_choice
from pipeline.estimate.estimators import BlogEstimator, ExactEstimator, FormulaEstimator, HeuristicEstimator
from pipeline.training.values import Estimate, Run, Target
from pipeline.core.paths import REPO_ROOT, SETTINGS_SIMULATED, SETTINGS_SUMMARY, SETTINGS_TABLES, SETTINGS_VALIDATION
from pipeline.training.adapters import ADAPTER_COLUMNS
from pipeline.training.points import SETTING_DEFAULTS
from pipeline.validate.peaks import error_summary, predicted_or_reason

SETTING_KEY = ("model_id", "precision", "client", "optim", "optimizer", "gradient_accumulation",
               "gradient_checkpointing", "batch_size", "seq_len", "lora_r", "lora_alpha", "lora_targets", "quantization",
               "lora_dropout", "liger_kernel", "completion_share", "first_in_process", "num_gpus", "sharding", "shard_group",
               "tensor_parallel", "deepspeed", "hyperparameters", "alloc_conf", "rollout", "packing")
ROW_COLUMNS = (*SETTING_KEY, "model_type", "family", "parameters", "status", "device", "split", "setting", "layout",
               "rank")
# The columns of the several-GPU tables, and what a single-GPU row means by them.
LAYOUT_DEFAULTS = {"num_gpus": 1, "sharding": None, "shard_group": None, "tensor_parallel": 1, "rank": 0,
                   "deepspeed": None, "hyperparameters": None, "alloc_conf": None, "rollout": None, "packing": None}


def settings_rows(tables: dict):
    """The ok and oom rows of the measured tables ({path: split}), with their split."""
    import pandas as pd

    from pipeline.core.io import read_table
    from pipeline.training.points import first_in_process

    frames = []
    for path, split in tables.items():
        frame = read_table(path, "training-settings peak")
        frame = frame.assign(first_in_process=first_in_process(frame))  # before rows are left out: the process's order
        frame = frame[(frame["status"] == "oom") | ((frame["status"] == "ok") & frame["peak_allocated_bytes"].notna())]
        frames.append(frame.assign(split=split))
    rows = pd.concat(frames, ignore_index=True)
    rows["gradient_checkpointing"] = rows["gradient_checkpointing"].fillna(False).astype(bool)
    rows["gradient_accumulation"] = rows["gradient_accumulation"].fillna(1).astype(int)
    for column in ADAPTER_COLUMNS:
        if column not in rows.columns:
            rows[column] = None
    rows["lora_dropout"] = rows["lora_dropout"].astype("float64").mask(  # adapter rows from before the column
        rows["lora_dropout"].isna() & rows["lora_r"].notna(), 0.0)
    for column, value in SETTING_DEFAULTS.items():  # tables from before Liger and the completion share
        rows[column] = rows[column].fillna(value) if column in rows.columns else value
    for column, value in LAYOUT_DEFAULTS.items():  # single-GPU tables
        if column not in rows.columns:
            rows[column] = value
        elif value is not None:
            rows[column] = rows[column].fillna(value).astype(int)
    rows["setting"] = [setting_name(row) for row in rows.itertuples(index=False)]
    rows["layout"] = [layout_name(row) for row in rows.itertuples(index=False)]
    return rows


def layout_name(row) -> str:
    """The validation's layout groups: 1 GPU, ddp, fsdp, fsdp-no-reshard, hsdp, with "+tp" under tensor
    parallelism (tp alone: "tp")."""
    if int(row.num_gpus) == 1:
        return "1 GPU"
    sharding = _text(row.sharding)
    if int(row.tensor_parallel) > 1:
        return f"{sharding}+tp" if sharding else "tp"
    return sharding


def setting_name(row) -> str:
    """full (fine-tuning), lora or qlora: the validation's groups; bf16-autocast, FSDP2's mixed precision,
    LoRA dropout, Liger's kernels, ZeRO-Offload and packed batches are reported apart (", bf16-autocast", ", mp-bf16",
    "+dropout", "+liger", "+offload", "+packing", "+padding-free")."""
    name = "full" if _text(row.lora_r) == "" else "qlora" if _text(row.quantization) else "lora"
    if _text(getattr(row, "lora_dropout", None)) not in ("", "0"):
        name += "+dropout"
    if _text(getattr(row, "liger_kernel", False)) == "True":
        name += "+liger"
    if _text(getattr(row, "deepspeed", None)):
        from pipeline.training.zero import offload_devices

        name += "+offload" if "cpu" in offload_devices(row.deepspeed).values() else ""
    if _text(getattr(row, "packing", None)):
        from pipeline.training.packing import Packing

        name += "+packing" if Packing.from_text(row.packing).packing else "+padding-free"
    if getattr(row, "precision", None) in ("bf16-autocast", "mp-bf16"):
        name += f", {row.precision}"
    return name


def run_of(row) -> Run:
    """The run of a measured point, with the bytes it could reserve on its GPU (the CUDA total less
    the memory outside PyTorch, as the verdict counts them)."""
    run = Run.from_row(row)
    return replace(run, reserve_limit=int(row.gpu_total_bytes) - row_outside_bytes(row, run))


def row_outside_bytes(row, run: Run | None = None) -> int:
    """The memory outside PyTorch of a measured point's process: the CUDA context, and NCCL's on several GPUs."""
    run = run or Run.from_row(row)
    return context_bytes(row.precision, None) + nccl_bytes(run.layout.communicators)


def setting_key(row) -> tuple:
    """A measured point on its GPU (the replay of the reserved bytes stops at that GPU's edge)."""
    get = row.get if isinstance(row, dict) else lambda name: getattr(row, name, None)
    defaults = {**SETTING_DEFAULTS, **LAYOUT_DEFAULTS}
    parts = {name: _text(defaults[name] if name in defaults and _text(get(name)) == "" else get(name))
             for name in (*SETTING_KEY, "device")}
    if parts["lora_dropout"] == "0":  # no dropout: keyed as the tables written before the column key it
        parts["lora_dropout"] = ""
    return tuple(parts.values())


def _text(value) -> str:
    """A key part: missing values (None, NaN, pandas' NA) alike."""
    import pandas as pd

    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


class ConfigTargets:
    """The target of a row: its parameter count and the config of configs.json."""

    def __init__(self, configs_path):
        from pipeline.inputs.configs import read_config_records

        self.records = read_config_records(configs_path)
        self.configs_path = configs_path

    def target(self, row) -> Target:
        record = self.records.get(row.model_id) or {}
        if record.get("status") != "ok":
            raise UserError(f"{row.model_id}: no ok config in the configs file")
        parameters = row.parameters
        if _text(parameters) == "":  # a point settled as oom by a smaller one ran nothing: the registry's count
            from pipeline.inputs.records import model_record

            parameters = model_record(row.model_id, None, self.configs_path).parameters
        return Target(int(parameters), row.model_id, record["config"])


class OnSettingRows:
    """An estimator answering for the rows of a training-settings table."""

    def __init__(self, estimator, targets: ConfigTargets):
        self.estimator, self.targets = estimator, targets

    def predict(self, row) -> Estimate:
        """The estimate of the row's run, its reserved bytes those of the row's allocator settings."""
        run = run_of(row)
        estimate = self.estimator.predict(self.targets.target(row), run)
        return replace(estimate, reserved_bytes=estimate.reserved(run.expandable_segments))


class SimulatedSettings:
    """The exact estimator's answers read from simulate-settings' table."""

    def __init__(self, simulated):
        self.lookup = {setting_key(r): r for r in simulated.to_dict("records")}

    def predict(self, row) -> Estimate:
        found = self.lookup.get(setting_key(row))
        if found is None:
            raise UserError("point not in the simulated settings table (run simulate-settings)")
        if found["simulate_status"] != "ok":
            raise UserError(f"simulator: {found['simulate_reason']}")
        return Estimate(float(found["simulated_peak_bytes"]), None,
                        reserved_bytes=float(found["simulated_peak_reserved_bytes"]))


def simulate_settings(rows, configs_path, reuse=None):
    """The simulator's answer for every distinct setting of the rows (one failing point is a row). `reuse`:
    earlier simulate-settings tables whose ok answers are kept for the settings they hold (each with the
    versions and commit that made it); the rest is simulated."""
    import pandas as pd

    from pipeline.core.provenance import software

    exact = OnSettingRows(ExactEstimator(), ConfigTargets(configs_path))
    kept = {setting_key(r): r for r in (reuse.to_dict("records") if reuse is not None else [])
            if r.get("simulate_status") == "ok"}
    records, versions = [], software()
    for row in rows.drop_duplicates([*SETTING_KEY, "device"]).itertuples(index=False):
        if setting_key(row) in kept:
            records.append(kept[setting_key(row)])
            continue
        peak, reserved, reason = predicted_or_reason(row, exact)
        records.append({**{name: getattr(row, name) for name in (*SETTING_KEY, "device")}, "simulated_peak_bytes": peak,
                        "simulated_peak_reserved_bytes": reserved, "simulate_status": "error" if reason else "ok",
                        "simulate_reason": reason, **versions})
    columns = [*SETTING_KEY, "device", "simulated_peak_bytes", "simulated_peak_reserved_bytes", "simulate_status",
               "simulate_reason", *versions]
    return pd.DataFrame.from_records(records).reindex(columns=columns)


def validate_settings(rows, coefficients: dict, configs_path, simulated=None):
    """One row per measured point x estimator: allocated and reserved errors, the fit verdict."""
    import pandas as pd

    from pipeline.core.provenance import software

    targets = ConfigTargets(configs_path)
    estimators = {"blog": OnSettingRows(BlogEstimator(reserved_ratio(coefficients)), targets),
                  "heuristic": OnSettingRows(HeuristicEstimator(coefficients), targets),
                  "formula": OnSettingRows(FormulaEstimator(coefficients), targets)}
    if simulated is not None:
        estimators["exact"] = SimulatedSettings(simulated)
    records = []
    for row in rows.itertuples(index=False):
        for name, estimator in estimators.items():
            predicted, reserved, reason = predicted_or_reason(row, estimator)
            records.append(_record(row, name, predicted, reserved, reason))
    table = pd.DataFrame.from_records(records)
    for name, value in software().items():
        table[name] = value
    return table


def _record(row, estimator: str, predicted: float, reserved: float, reason) -> dict:
    ok = row.status == "ok"
    measured = float(row.peak_allocated_bytes) if ok else math.nan
    measured_reserved = float(row.peak_reserved_bytes) if ok else math.nan
    outside = row_outside_bytes(row)
    record = {name: getattr(row, name) for name in ROW_COLUMNS}
    record.update(
        estimator=estimator, predicted_peak_bytes=predicted, measured_peak_bytes=measured,
        relative_error=(predicted - measured) / measured if ok else math.nan,
        predicted_reserved_bytes=reserved, measured_reserved_bytes=measured_reserved,
        reserved_relative_error=(reserved - measured_reserved) / measured_reserved if ok else math.nan,
        gpu_memory_bytes=row.gpu_total_bytes, outside_bytes=outside, fits_measured=ok,
        fits_predicted=None if math.isnan(predicted) else bool(predicted <= row.gpu_total_bytes),
        fits_predicted_reserved=None if math.isnan(reserved) else bool(reserved + outside <= row.gpu_total_bytes),
        reason=reason)
    return record


def summary_table(table):
    """Per split, client, estimator and device: allocated and reserved errors, fit accuracy."""
    import pandas as pd

    records = []
    for (split, setting, client, layout, estimator, device), group in table.groupby(
            ["split", "setting", "client", "layout", "estimator", "device"], sort=False):
        records.append({"split": split, "setting": setting, "client": client, "layout": layout,
                        "estimator": estimator, "device": device, **error_summary(group)})
    return pd.DataFrame.from_records(records)


def summary_markdown(summary) -> str:
    def pct(value):
        return "" if value is None or value != value else f"{100 * value:.1f}%"

    lines = ["| split | setting | client | GPUs | estimator | device | points | median | p90 | worst | reserved median | "
             "reserved p90 | fit right (reserved) |", "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary.itertuples(index=False):
        fit = "" if r.reserved_fit_accuracy is None or r.reserved_fit_accuracy != r.reserved_fit_accuracy else \
            f"{100 * r.reserved_fit_accuracy:.1f}% of {r.reserved_fit_points}"
        lines.append(f"| {r.split} | {r.setting} | {r.client} | {r.layout} | {r.estimator} | {r.device} | {r.points} | "
                     f"{pct(r.median_abs_relative_error)} | {pct(r.p90_abs_relative_error)} | "
                     f"{pct(r.worst_abs_relative_error)} | {pct(r.reserved_median_abs_relative_error)} | "
                     f"{pct(r.reserved_p90_abs_relative_error)} | {fit} |")
    return "\n".join(lines) + "\n"


def run_simulate_settings(tables: dict, configs_path, out_path, reuse_paths=()):
    import pandas as pd

    from pipeline.core.io import read_table, write_parquet

    reuse = pd.concat([read_table(path, "simulated settings") for path in reuse_paths]) if reuse_paths else None
    table = simulate_settings(settings_rows(tables), configs_path, reuse)
    write_parquet(table, out_path)
    return table


def run_validate_settings(tables: dict, coefficients_path, configs_path, simulated_path, out_path, summary_path):
    from pipeline.formulas.coefficients import load_coefficients
    from pipeline.core.io import write_parquet, write_text
    from pipeline.core.io import read_table

    simulated = read_table(simulated_path, "simulated settings") if simulated_path else None
    table = validate_settings(settings_rows(tables), load_coefficients(coefficients_path), configs_path, simulated)
    summary = summary_table(table)
    write_parquet(table, out_path)
    write_text("# The estimators on the training settings beyond the standard step\n\n"
               "Errors are |predicted / measured - 1| of ok rows; the fit verdict covers ok and oom rows.\n\n"
               + summary_markdown(summary), summary_path)
    return summary


def add_cli(subparsers) -> None:
    from pipeline.core.paths import COEFFICIENTS, CONFIGS

    tables = ", ".join(f"{path} ({split})" for path, split in SETTINGS_TABLES.items())
    simulate = subparsers.add_parser("simulate-settings", help="the simulator at every measured training-settings point")
    simulate.add_argument("--tables", nargs="*", metavar="PATH[=SPLIT]", help=f"default: {tables}")
    simulate.add_argument("--configs", default=CONFIGS)
    simulate.add_argument("--out", default=SETTINGS_SIMULATED)
    simulate.add_argument("--reuse", nargs="*", default=[], metavar="TABLE",
                          help="earlier simulate-settings tables: their ok answers are kept for the settings they "
                               "hold (with the versions and commit that made them), the rest is simulated")
    simulate.set_defaults(handler=_simulate_command)
    validate = subparsers.add_parser("validate-settings",
                                     help=f"every estimator against the measured training settings ({tables})")
    validate.add_argument("--tables", nargs="*", metavar="PATH[=SPLIT]", help=f"default: {tables}")
    validate.add_argument("--coefficients", default=COEFFICIENTS)
    validate.add_argument("--configs", default=CONFIGS)
    validate.add_argument("--simulated", default=SETTINGS_SIMULATED, help="simulate-settings' table ('' for none)")
    validate.add_argument("--out", default=SETTINGS_VALIDATION)
    validate.add_argument("--summary", default=SETTINGS_SUMMARY)
    validate.set_defaults(handler=_validate_command)


def _tables(paths: list | None) -> dict:
    """The tables given (PATH or PATH=SPLIT), else the committed ones present."""
    if paths:
        tables = dict((p.split("=", 1) + ["tuned"])[:2] for p in paths)
        for split in tables.values():
            check_choice("split", split, SPLITS)
        return tables
    found = {str(REPO_ROOT / path): split for path, split in SETTINGS_TABLES.items() if (REPO_ROOT / path).is_file()}
    if not found:
        raise UserError(f"no training-settings table found ({', '.join(SETTINGS_TABLES)})")
    return found


def _simulate_command(args) -> int:
    table = run_simulate_settings(_tables(args.tables), args.configs, args.out, args.reuse)
    print(f"simulate-settings: {len(table)} settings, {int((table['simulate_status'] != 'ok').sum())} failed "
          f"-> {args.out}")
    return 0


def _validate_command(args) -> int:
    summary = run_validate_settings(_tables(args.tables), args.coefficients, args.configs, args.simulated or None,
                                    args.out, args.summary)
    print(summary_markdown(summary), end="")
    print(f"validate-settings: -> {args.out}")
    return 0
