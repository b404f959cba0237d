"""Stage: the published dataset — one parquet table per subset under `results/dataset/data/`,
the figures, and a dataset card (`README.md`) that `datasets.load_dataset` reads.

Every column of every table must be described in COLUMNS (unit and meaning): a column without a
description fails the build, so the card cannot fall behind the tables.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from pipeline.errors import UserError

BLOG_URL = "https://huggingface.co/blog/train_memory"
BLOG_TITLE = "Visualize and understand GPU memory in PyTorch"
DEFAULT_REPO = "OWNER/activations-vs-parameters"

# subset -> (file under results/, what one row is). Order is the card's order.
SUBSETS = {
    "models": ("models.parquet", "one row per registry model: parameter counts and architecture facts"),
    "activations": ("activations.parquet",
                    "one row per model x method x dtype x (batch, sequence length): activation counts"),
    "peak_memory": ("peak_memory.parquet",
                    "one row per measured point: CUDA peak memory of the standard training step"),
    "validation": ("validation.parquet",
                   "one row per measured point x estimator: predicted against measured peak"),
    "coefficients": ("coefficients.json", "the refit heuristic, flattened: one row per coefficient set"),
    "simulated": ("simulated.parquet", "one row per model x point: peak predicted by the exact simulator"),
}

PROVENANCE = {
    "torch_version": ("", "PyTorch version that produced the row"),
    "transformers_version": ("", "transformers version that built the model (activation counts depend on it)"),
    "cuda_version": ("", "CUDA version PyTorch was built with (empty on CPU builds)"),
    "python_version": ("", "Python version"),
    "git_commit": ("", "commit of this project's code that produced the row (-dirty: uncommitted changes)"),
    "device": ("", "device the number comes from: GPU name, or cpu (...) for meta-device counts"),
    "driver_version": ("", "NVIDIA driver version (empty on CPU)"),
    "config_source": ("", "where the model config came from: hub (config.json download) or embedded (registry facts)"),
    "config_revision": ("", "Hub commit of the config.json when known"),
}

# column -> (unit, meaning). Units are also in the names: *_bytes, *_elements, *_per_token.
COLUMNS = {
    **PROVENANCE,
    "model_id": ("", "Hugging Face model id (owner/name)"),
    "family": ("", "model family; the group left out in leave-one-family-out cross-validation"),
    "model_type": ("", "transformers model_type of the config"),
    "status": ("", "ok, or why there is no number: oom, skipped, error"),
    "reason": ("", "why the row is not ok (empty when ok)"),
    "parameters": ("parameters", "N: parameters of the model built from its config, shared/tied weights counted once"),
    "embedding_parameters": ("parameters", "parameters of the input (and untied output) embeddings"),
    "non_embedding_parameters": ("parameters", "parameters minus embedding parameters"),
    "active_parameters": ("parameters", "parameters used per token (differs from N for mixture-of-experts)"),
    "is_moe": ("", "the model is a mixture of experts"),
    "num_experts": ("count", "experts per MoE layer (empty for dense models)"),
    "num_experts_per_tok": ("count", "experts routed per token (empty for dense models)"),
    "num_hidden_layers": ("count", "transformer layers"),
    "hidden_size": ("elements", "width of the residual stream"),
    "intermediate_size": ("elements", "width of the MLP"),
    "num_attention_heads": ("count", "query heads"),
    "num_key_value_heads": ("count", "key/value heads"),
    "head_dim": ("elements", "width of one attention head"),
    "vocab_size": ("tokens", "vocabulary size"),
    "context_length": ("tokens", "longest position the model takes (empty when unlimited)"),
    "tie_word_embeddings": ("", "input and output embeddings share their weights"),
    "attention_kind": ("", "mha, gqa, mqa, mla or none (attention-free)"),
    "method": ("", "hook: sum of module outputs of a forward in eval/no_grad (the blog's method); "
                   "saved: distinct storages autograd saves for backward in the standard step's forward"),
    "dtype": ("", "dtype of the forward (element size for the byte columns)"),
    "batch_size": ("sequences", "B, sequences per batch"),
    "seq_len": ("tokens", "L, tokens per sequence"),
    "tokens": ("tokens", "B x L"),
    "elements": ("elements", "activation elements counted for the whole input"),
    "elements_per_token": ("elements/token", "elements / tokens"),
    "bytes": ("bytes", "activation bytes for the whole input (elements x element size)"),
    "bytes_per_token": ("bytes/token", "bytes / tokens"),
    "forward": ("", "where the forward ran: meta (no weights), meta-fallback, or cpu"),
    "seconds": ("s", "wall time of the count"),
    "precision": ("", "fp32, bf16 (bf16 weights, grads, AdamW state) or amp-bf16 (fp32 weights, bf16 autocast)"),
    "optimizer": ("", "optimizer of the training step (adamw: torch.optim.AdamW defaults)"),
    "gradient_checkpointing": ("", "gradient checkpointing was on"),
    "attn_implementation": ("", "attention implementation (transformers default when empty)"),
    "variant": ("", "standard: loss from labels (the standard training step); blog: mean of the logits"),
    "peak_allocated_bytes": ("bytes", "torch.cuda.max_memory_allocated() over three training steps, "
                                      "counter reset after the model was built"),
    "peak_reserved_bytes": ("bytes", "torch.cuda.max_memory_reserved() over the same steps"),
    "weights_bytes": ("bytes", "memory allocated right after building the model (weights and buffers)"),
    "optimizer_state_bytes": ("bytes", "memory of the AdamW state after the steps"),
    "forward_peak_bytes": ("bytes", "peak allocated during the forwards (max over the steps)"),
    "backward_peak_bytes": ("bytes", "peak allocated during the backwards (max over the steps)"),
    "optimizer_peak_bytes": ("bytes", "peak allocated during the optimizer steps (max over the steps)"),
    "nvml_used_bytes": ("bytes", "GPU memory of this process as NVML reports it, CUDA context included "
                                 "(empty where NVML cannot see the process)"),
    "nvml_device_used_bytes": ("bytes", "GPU memory in use on the whole device as NVML reports it"),
    "step_seconds": ("s", "wall time of one training step (median of the steps)"),
    "steps": ("count", "training steps run at the point (three)"),
    "steps_seconds_total": ("s", "wall time of all the steps"),
    "step_flops": ("FLOPs", "6 x parameters x B x L: the compute estimate the sweep's budget uses"),
    "allocated_before_bytes": ("bytes", "memory allocated before the point's first step (a leak would show here)"),
    "measure_device": ("", "device type of the measurement: cuda (real peaks) or cpu (debug, no peaks)"),
    "attn_implementation_used": ("", "attention implementation the built model really used"),
    "train_mode": ("", "the model was in train mode (standard step) rather than eval (blog variant)"),
    "use_cache": ("", "the forward used the KV cache (only the blog variant can)"),
    "allow_tf32": ("", "fp32 matmuls ran on TF32 tensor cores (speed only; memory is the same)"),
    "build_seconds": ("s", "wall time to build the model with random weights on the device"),
    "started_at": ("s since epoch", "when the point started (Unix time)"),
    "finished_at": ("s since epoch", "when the point finished (Unix time)"),
    "child_pid": ("", "process id of the measuring child process (one process per model and precision)"),
    "tokens_per_second": ("tokens/s", "B x L / step_seconds"),
    "gpu_total_bytes": ("bytes", "total memory of the GPU"),
    "estimator": ("", "blog (the blog's formula and coefficients), heuristic (refit coefficients), "
                      "exact (simulated from the model's modules)"),
    "predicted_peak_bytes": ("bytes", "peak predicted by the estimator"),
    "measured_peak_bytes": ("bytes", "measured peak_allocated_bytes (for oom rows: the GPU's memory, a lower bound)"),
    "relative_error": ("ratio", "(predicted - measured) / measured"),
    "fits_predicted": ("", "the estimator says the point fits in gpu_memory_bytes"),
    "fits_measured": ("", "the point ran without running out of memory"),
    "gpu_memory_bytes": ("bytes", "memory of the GPU the fit decision refers to"),
    "predicted_reserved_bytes": ("bytes", "peak reserved (allocator segments) predicted by the estimator"),
    "measured_reserved_bytes": ("bytes", "measured peak_reserved_bytes (empty for oom rows)"),
    "reserved_relative_error": ("ratio", "(predicted - measured) / measured peak reserved"),
    "outside_bytes": ("bytes", "memory of the process outside PyTorch's allocator that the fit verdict adds "
                               "(CUDA context, kernels, libraries; measured on the H200)"),
    "fits_predicted_reserved": ("", "the fit verdict: predicted reserved + outside_bytes <= gpu_memory_bytes"),
}

# The coefficients subset (coefficients.json flattened; units of a and b are in unit_a, unit_b).
COLUMNS.update({
    "fit": ("", "which fit: hook_elements_vs_<x> (hook elements per token against the x column), "
                "saved_bytes_vs_parameters (saved-for-backward bytes per token), or blog"),
    "role": ("", "heuristic (the top-level a, b the estimator uses), alternative, reference length, point estimate at this "
                 "length, or published (the blog's coefficients, fp32 bytes)"),
    "formula": ("", "the fitted line, y = a * x + b"),
    "weighting": ("", "none: ordinary least squares; relative: weights 1/y^2 (least squares of the relative error)"),
    "x": ("", "the x column of the fit"),
    "y": ("", "the y column of the fit"),
    "a": ("unit_a", "slope"),
    "a_low": ("unit_a", "lower end of the interval of a (bootstrap over models)"),
    "a_high": ("unit_a", "upper end of the interval of a"),
    "b": ("unit_b", "intercept"),
    "b_low": ("unit_b", "lower end of the interval of b"),
    "b_high": ("unit_b", "upper end of the interval of b"),
    "interval_level": ("fraction", "confidence level of the intervals (0.95)"),
    "unit_a": ("", "unit of a"),
    "unit_b": ("", "unit of b"),
    "n_models": ("count", "models in the fit"),
    "n_families": ("count", "families in the fit"),
    "fitted_at": ("", "date of the fit (UTC, ISO 8601)"),
})
for _split, _label in (("in_sample", "in sample"), ("kfold", "shuffled k-fold cross-validation"),
                       ("leave_one_family_out", "leave-one-family-out cross-validation")):
    COLUMNS.update({
        f"{_split}_r2": ("", f"R^2, {_label}"),
        f"{_split}_mape": ("fraction", f"mean absolute percentage error, {_label}"),
        f"{_split}_max_abs_percentage_error": ("fraction", f"worst absolute percentage error, {_label}"),
        f"{_split}_worst_model_id": ("", f"model with the worst error, {_label}"),
    })

# The simulated subset (python -m pipeline simulate-peaks): the exact simulator at each measured point.
COLUMNS.update({
    "simulated_peak_bytes": ("bytes", "peak of the standard training step predicted by the simulator"),
    "simulated_forward_peak_bytes": ("bytes", "simulated peak during the forward"),
    "simulated_backward_peak_bytes": ("bytes", "simulated peak during the backward"),
    "simulated_optimizer_peak_bytes": ("bytes", "simulated peak during the optimizer step"),
    "simulated_saved_bytes": ("bytes", "bytes saved for backward in the simulated forward"),
    "simulated_optimizer_state_bytes": ("bytes", "simulated optimizer state"),
    "simulated_peak_phase": ("", "phase of the step where the simulated peak happens"),
    "simulate_status": ("", "ok, or why the simulator has no number (error, skipped)"),
    "simulate_reason": ("", "why the simulation is not ok (empty when ok)"),
    "simulate_seconds": ("s", "wall time of the simulation"),
    "simulated_peak_reserved_bytes": ("bytes", "peak reserved (the caching allocator's segments) predicted by the "
                                               "simulator, torch.cuda.max_memory_reserved()"),
})

# Same column name, different meaning in one subset: (subset, column) -> (unit, meaning).
SUBSET_COLUMNS: dict[tuple[str, str], tuple[str, str]] = {
    ("coefficients", "batch_size"): ("sequences", "B of the saved-for-backward counts the fit used"),
    ("coefficients", "seq_len"): ("tokens", "L of the saved-for-backward counts the fit used"),
    ("coefficients", "precision"): ("", "precision of the saved-for-backward counts (empty for hook fits)"),
}


def column_doc(subset: str, column: str) -> tuple[str, str] | None:
    return SUBSET_COLUMNS.get((subset, column)) or COLUMNS.get(column)


def load_tables(results_dir) -> dict:
    """The subsets present under `results_dir`, as DataFrames (absent files are left out)."""
    import pandas as pd

    results_dir = Path(results_dir)
    tables = {}
    for subset, (name, _) in SUBSETS.items():
        path = results_dir / name
        if not path.exists():
            continue
        if subset == "coefficients":
            tables[subset] = coefficients_table(json.loads(path.read_text()))
        else:
            tables[subset] = pd.read_parquet(path)
    if "models" not in tables:
        raise UserError(f"{results_dir}: models.parquet not found (run the activations stage first)")
    return tables


def coefficients_table(coefficients: dict):
    """coefficients.json as a table: one row per fit (and per length for the saved-bytes fits),
    plus one row for the blog's own coefficients. The JSON file keeps everything else."""
    import pandas as pd

    fits = coefficients.get("fits", {})
    main_name = coefficients.get("fit") or next(iter(fits), None)
    rows = []
    for name, fit in fits.items():
        if name == "saved_bytes_vs_parameters":
            for precision, saved in (fit or {}).items():
                if saved:
                    rows.append(_fit_row(name, "reference length", saved, precision))
                    rows.extend(_per_length_row(name, precision, point, saved) for point in saved.get("by_seq_len", []))
        elif fit:
            rows.append(_fit_row(name, "heuristic" if name == main_name else "alternative", fit))
    blog = coefficients.get("blog", {})
    if blog:
        rows.append({"fit": "blog", "role": "published", "formula": "A = a * N + b", "x": "parameters",
                     "y": "fp32 bytes per token (hook method)", "a": blog.get("a"), "b": blog.get("b"),
                     "unit_a": blog.get("units", {}).get("a"), "unit_b": blog.get("units", {}).get("b")})
    versions = coefficients.get("versions", {})
    for row in rows:
        row.update(torch_version=versions.get("torch"), transformers_version=versions.get("transformers"),
                   git_commit=versions.get("git_commit"), fitted_at=coefficients.get("date"))
    return pd.DataFrame(rows)


def _fit_row(name: str, role: str, fit: dict, precision: str | None = None) -> dict:
    intervals, metrics, units = fit.get("intervals", {}), fit.get("metrics", {}), fit.get("units", {})
    row = {"fit": name, "role": role, "precision": precision, "formula": fit.get("formula"), "x": fit.get("x"),
           "y": fit.get("y"), "weighting": fit.get("weighting"), "batch_size": fit.get("batch_size"),
           "seq_len": fit.get("seq_len"),
           "a": fit.get("a"), "a_low": _end(intervals.get("a"), 0), "a_high": _end(intervals.get("a"), 1),
           "b": fit.get("b"), "b_low": _end(intervals.get("b"), 0), "b_high": _end(intervals.get("b"), 1),
           "interval_level": intervals.get("level"), "unit_a": units.get("a"), "unit_b": units.get("b"),
           "n_models": fit.get("n_models"), "n_families": fit.get("n_families")}
    for split in ("in_sample", "kfold", "leave_one_family_out"):
        values = metrics.get(split) or {}
        for metric in ("r2", "mape", "max_abs_percentage_error", "worst_model_id"):
            row[f"{split}_{metric}"] = values.get(metric)
    return row


def _per_length_row(name: str, precision: str, point: dict, reference: dict) -> dict:
    units = reference.get("units", {})
    return {"fit": name, "role": "point estimate at this length", "precision": precision,
            "formula": reference.get("formula"), "x": reference.get("x"), "y": reference.get("y"),
            "batch_size": point.get("batch_size"), "seq_len": point.get("seq_len"), "a": point.get("a"),
            "b": point.get("b"), "unit_a": units.get("a"), "unit_b": units.get("b"), "n_models": point.get("n_models")}


def _end(interval, index: int):
    return interval[index] if isinstance(interval, list) and len(interval) == 2 else None


def undocumented_columns(tables: dict) -> list[str]:
    return [f"{subset}.{column}" for subset, frame in tables.items() for column in frame.columns
            if column_doc(subset, column) is None]


def failures(tables: dict):
    """Models that were not counted (status not ok) and rows with status error in any subset:
    subset, model_id, status, reason."""
    import pandas as pd

    parts = []
    for subset, frame in tables.items():
        if "status" not in frame.columns or "model_id" not in frame.columns:
            continue
        bad = frame[frame["status"] != "ok"] if subset == "models" else frame[frame["status"] == "error"]
        if len(bad):
            part = bad[["model_id", "status"]].assign(subset=subset, reason=bad["reason"] if "reason" in bad else None)
            parts.append(part.drop_duplicates(["model_id", "status"]))  # one line per model: its first reason
    columns = ["subset", "model_id", "status", "reason"]
    if not parts:
        return pd.DataFrame(columns=columns)
    return pd.concat(parts, ignore_index=True)[columns]


def failure_report(results_dir="results") -> list[str]:
    """One line per failing (subset, model), for the end of a workflow run; [] when none."""
    try:
        frame = failures(load_tables(results_dir))
    except (UserError, OSError, ValueError):
        return []
    return [failure_line(row) for row in frame.itertuples()]


def failure_line(row, width: int = 240) -> str:
    line = f"{row.subset}: {row.model_id}: {row.status}: {row.reason}"
    return line if len(line) <= width else line[: width - 3] + "..."


def build_dataset(results_dir="results", out_dir="results/dataset", repo: str = DEFAULT_REPO,
                  figures_dir=None) -> dict:
    """Write the subsets, figures and card into `out_dir` (replaced whole, never half-written)."""
    from pipeline.io import write_parquet, write_text

    results_dir, out_dir = Path(results_dir), Path(out_dir)
    tables = load_tables(results_dir)
    missing = undocumented_columns(tables)
    if missing:
        raise UserError(f"column(s) without a description in pipeline/dataset.py COLUMNS: {', '.join(missing)}")
    figures = sorted(Path(figures_dir or results_dir / "figures").glob("*.png"))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}.", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the dataset is for everyone
    try:
        for subset, frame in tables.items():
            write_parquet(frame, staging / "data" / f"{subset}.parquet")
        for figure in figures:
            (staging / "figures").mkdir(exist_ok=True)
            shutil.copyfile(figure, staging / "figures" / figure.name)
        summary_path = results_dir / "validation_summary.md"
        summary = summary_path.read_text() if summary_path.exists() else None
        write_text(dataset_card(tables, repo, [f.name for f in figures], summary), staging / "README.md")
        _replace_dir(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tables


def _replace_dir(new: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".tmp-old-{target.name}.", dir=target.parent))
        target.rename(old / target.name)
    new.rename(target)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def size_category(rows: int) -> str:
    for limit, label in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"),
                         (1_000_000, "100K<n<1M"), (10_000_000, "1M<n<10M")):
        if rows < limit:
            return label
    return "10M<n<100M"


def card_header(tables: dict) -> str:
    import yaml

    header = {
        "license": "apache-2.0",
        "pretty_name": "Activations vs parameters: LLM training memory",
        "tags": ["gpu-memory", "pytorch", "transformers", "training", "llm", "benchmark", "tabular"],
        "size_categories": [size_category(max(len(frame) for frame in tables.values()))],
        "configs": [
            {"config_name": subset, "data_files": [{"split": "train", "path": f"data/{subset}.parquet"}]}
            for subset in tables
        ],
    }
    return "---\n" + yaml.safe_dump(header, sort_keys=False) + "---\n"


def dataset_card(tables: dict, repo: str, figures: list[str], validation_summary: str | None) -> str:
    parts = [
        card_header(tables),
        "# Activations vs parameters: LLM training memory\n",
        f"This dataset extends the \"activations vs parameters\" heuristic of the Hugging Face blog post "
        f"[{BLOG_TITLE}]({BLOG_URL}). The blog sums the outputs of every module for a one-token input, "
        "finds that the sum grows roughly linearly with the parameter count N, fits "
        "`A = 4.6894e-4 * N + 1.8494e6` (fp32 bytes per token, i.e. `/4` for elements) and uses it "
        "in a training-memory formula. Here the count is made for many causal language models, set "
        "against real CUDA peaks of a standard training step, refit and cross-validated.\n",
        _loading_section(repo, tables),
        _subsets_section(tables),
        _method_section(tables),
        _headline_section(tables, figures, validation_summary),
        _limits_section(tables),
    ]
    return "\n".join(parts)


def _loading_section(repo: str, tables: dict) -> str:
    subset = "activations" if "activations" in tables else next(iter(tables))
    return (
        "## How to load\n\n"
        "```python\n"
        "from datasets import load_dataset\n\n"
        f"activations = load_dataset(\"{repo}\", \"{subset}\", split=\"train\")\n"
        "```\n\n"
        f"Subsets: {', '.join(f'`{name}`' for name in tables)}. The refit coefficients are also in "
        "`coefficients.json` at the root of the repository.\n"
    )


def _subsets_section(tables: dict) -> str:
    lines = ["## Subsets and columns\n"]
    for subset, frame in tables.items():
        lines.append(f"### `{subset}` ({len(frame)} rows)\n\n{SUBSETS[subset][1].capitalize()}.\n")
        lines.append("| column | type | unit | meaning |\n|---|---|---|---|")
        for column in frame.columns:
            unit, meaning = column_doc(subset, column)
            lines.append(f"| `{column}` | {frame[column].dtype} | {unit} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def _distinct(tables: dict, subset: str, column: str) -> str:
    frame = tables.get(subset)
    if frame is None or column not in frame.columns:
        return "n/a"
    values = sorted(str(v) for v in frame[column].dropna().unique())
    return ", ".join(values) if values else "n/a"


def _method_section(tables: dict) -> str:
    lines = [
        "## How it was measured\n",
        "- **Activations (hook, the blog's method)**: sum over `model.modules()` of the tensor outputs "
        "of a forward pass in eval mode under `no_grad`, divided by the tokens; counted in elements "
        "(bytes = elements x element size). Models are built from their configs on the meta device "
        "(no weights), falling back to the CPU where the meta device cannot run the forward.",
        "- **Saved for backward**: bytes of the distinct storages autograd saves during the forward "
        "of the standard training step (parameters excluded), at several batch sizes and lengths.",
        "- **Standard training step**: a fresh model from its config with random weights on the GPU, "
        "`use_cache=False`, default attention; `torch.optim.AdamW`; three steps of "
        "`loss = model(input_ids=ids, labels=ids).loss; loss.backward(); opt.step(); "
        "opt.zero_grad(set_to_none=True)` with uniform random ids of shape (B, L). **Peak** is "
        "`torch.cuda.max_memory_allocated()` over the three steps, the counter reset after the model "
        "was built. Each model runs in its own process.",
        "- **Precision modes**: `fp32`; `bf16` (bf16 weights, gradients and AdamW state); `amp-bf16` "
        "(fp32 weights and state, forward under `torch.autocast(\"cuda\", torch.bfloat16)`).",
        "",
        "| subset | device | torch | transformers | CUDA | driver | code commit |",
        "|---|---|---|---|---|---|---|",
    ]
    for subset in tables:
        if "torch_version" in tables[subset].columns:
            values = [_distinct(tables, subset, c) for c in
                      ("device", "torch_version", "transformers_version", "cuda_version", "driver_version", "git_commit")]
            lines.append(f"| {subset} | " + " | ".join(values) + " |")
    lines.append(f"\nModel configs came from: {_distinct(tables, 'models', 'config_source')}.\n")
    return "\n".join(lines)


def _headline_section(tables: dict, figures: list[str], validation_summary: str | None) -> str:
    lines = ["## Headline results\n"]
    coefficients = tables.get("coefficients")
    if coefficients is not None and len(coefficients):
        lines.append(_refit_sentence(coefficients))
        lines.append("All fits (see `coefficients.json` for the cross-validation details):\n")
        lines.append(coefficients_markdown(coefficients))
    for name in figures:
        lines.append(f"![{name[:-4].replace('_', ' ')}](figures/{name})\n")
    lines.append("### Validation\n")
    if validation_summary:
        lines.append(validation_summary.strip() + "\n")
    elif "validation" in tables:
        lines.append(validation_markdown(tables["validation"]))
    else:
        lines.append("No measured peaks in this build, so no validation.\n")
    return "\n".join(lines)


def _refit_sentence(frame) -> str:
    from pipeline.formulas import BLOG_A_BYTES_PER_ELEMENT

    main = frame[frame["role"] == "heuristic"]
    blog = frame[frame["fit"] == "blog"]
    if main.empty:
        return ""
    row = main.iloc[0]
    text = (f"**Refit** (`{row['fit']}`): A = {row['a']:.4e} x {row['x']} + {row['b']:.4e} activation elements "
            f"per token, {row['weighting'] or 'unweighted'} least squares "
            f"({int(row['n_models'])} models, {int(row['n_families'])} families")
    if _number(row.get("leave_one_family_out_mape")):
        text += f"; leave-one-family-out MAPE {row['leave_one_family_out_mape']:.1%}"
    text += ")."
    if not blog.empty:
        scale = BLOG_A_BYTES_PER_ELEMENT
        text += (f" The blog's line in the same unit (its fp32 bytes / {scale}): A = "
                 f"{blog.iloc[0]['a'] / scale:.4e} x parameters + {blog.iloc[0]['b'] / scale:.4e}.")
    return text + "\n"


def coefficients_markdown(frame) -> str:
    """The fits with intervals (per-length point estimates left out) as a markdown table."""
    lines = ["| fit | precision | a | 95% interval of a | b | 95% interval of b | units (a; b) | "
             "leave-one-family-out MAPE |", "|---|---|---|---|---|---|---|---|"]
    for row in frame[frame["role"] != "point estimate at this length"].itertuples():
        a_range = f"[{row.a_low:.4g}, {row.a_high:.4g}]" if _number(getattr(row, "a_low", None)) else ""
        b_range = f"[{row.b_low:.4g}, {row.b_high:.4g}]" if _number(getattr(row, "b_low", None)) else ""
        mape = getattr(row, "leave_one_family_out_mape", None)
        lines.append(f"| {row.fit} | {row.precision if isinstance(row.precision, str) else ''} | {row.a:.4g} | "
                     f"{a_range} | {row.b:.4g} | {b_range} | {row.unit_a}; {row.unit_b} | "
                     f"{f'{mape:.1%}' if _number(mape) else ''} |")
    return "\n".join(lines) + "\n"


def _number(value) -> bool:
    import math

    return isinstance(value, (int, float)) and not math.isnan(value)


def validation_markdown(frame) -> str:
    """Median, 90th percentile and worst |relative error| per estimator (ok points only)."""
    if "status" in frame.columns:
        frame = frame[frame["status"] == "ok"]
    frame = frame.dropna(subset=["relative_error"])
    if frame.empty:
        return "No validated points.\n"
    lines = ["| estimator | points | median abs. error | 90th percentile | worst |", "|---|---|---|---|---|"]
    for estimator, group in frame.groupby("estimator"):
        error = group["relative_error"].abs()
        lines.append(f"| {estimator} | {len(group)} | {error.median():.1%} | {error.quantile(0.9):.1%} | "
                     f"{error.max():.1%} |")
    return "\n".join(lines) + "\n"


def _limits_section(tables: dict) -> str:
    lines = [
        "## Known limits\n",
        "- Activation counts depend on the transformers modelling code (version in the provenance "
        "columns); a new version can change them.",
        "- Weights are random: memory does not depend on their values, but data-dependent paths "
        "(mixture-of-experts routing) can allocate differently with trained weights.",
        "- Peaks come from one GPU type and one software stack; allocator behaviour, attention "
        "kernels and fused optimizers differ across versions and devices.",
        "- Only architectures in transformers itself are built (no remote code).",
        "- Counting points whose forward time grows with the sequence length (recurrent scans "
        "without their CUDA kernels) are skipped once their estimated time passes 3 s; the "
        "reason column says so.",
        "- The hook count sums module outputs, which counts some tensors several times and misses "
        "others; the `saved` method counts what autograd really keeps.",
    ]
    failed = failures(tables)
    if len(failed):
        lines.append(f"- {len(failed)} model(s) could not be counted or measured here:")
        lines.extend(f"  - `{row.model_id}` ({row.subset}, {row.status}): {row.reason}" for row in failed.itertuples())
    return "\n".join(lines) + "\n"


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("dataset", help="build the Hugging Face dataset folder (parquet subsets + card)")
    parser.add_argument("--results", default="results", help="folder with the stage outputs")
    parser.add_argument("--out", default="results/dataset")
    parser.add_argument("--figures", default=None, help="folder of PNG figures (default: RESULTS/figures)")
    parser.add_argument("--repo", default=DEFAULT_REPO, help="repo id shown in the card's loading example")
    parser.set_defaults(handler=_dataset_command)


def _dataset_command(args) -> int:
    tables = build_dataset(args.results, args.out, args.repo, args.figures)
    sizes = ", ".join(f"{subset}: {len(frame)}" for subset, frame in tables.items())
    print(f"dataset: {len(tables)} subsets -> {args.out} ({sizes})")
    for row in failures(tables).itertuples():
        print(f"failed: {failure_line(row)}")
    return 0
