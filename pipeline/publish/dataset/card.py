"""The dataset card (README.md): YAML header that `datasets.load_dataset` reads, then the sections."""

from __future__ import annotations

from pipeline.publish.dataset.columns import column_doc
from pipeline.publish.dataset.failures import failures
from pipeline.publish.dataset.subsets import SUBSETS

BLOG_URL = "https://huggingface.co/blog/train_memory"
BLOG_TITLE = "Visualize and understand GPU memory in PyTorch"
DEFAULT_REPO = "OWNER/activations-vs-parameters"


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
        _models_section(tables),
        _subsets_section(tables),
        _method_section(tables),
        _headline_section(tables, figures, validation_summary),
        _settings_section(tables),
        _limits_section(tables),
    ]
    return "\n".join(parts)


def _models_section(tables: dict) -> str:
    """The registry's models by `model_type`; those kept out of every fit of the closed form marked."""
    from pipeline.fit.formula import HELD_OUT_MODELS

    frame = tables.get("models")
    if frame is None or "model_type" not in frame.columns:
        return ""
    lines = [f"## Models\n\n{len(frame)} models of {frame['model_type'].nunique()} model types and "
             f"{frame['family'].nunique()} families (`models`); * kept out of every fit of the closed form "
             "(held out, judged apart):\n",
             "| model_type | models |", "|---|---|"]
    for model_type, group in frame.sort_values("model_id").groupby("model_type", sort=True):
        ids = ", ".join(f"{m}{' *' if m in HELD_OUT_MODELS else ''}" for m in group["model_id"])
        lines.append(f"| {model_type} | {ids} |")
    return "\n".join(lines) + "\n"


def _settings_section(tables: dict) -> str:
    """The estimators on the training settings beyond the standard step (Trainer, LoRA, QLoRA)."""
    if "settings_validation" not in tables:
        return ""
    from pipeline.validate.settings import summary_markdown, summary_table

    frame = tables["settings_validation"]
    exact = summary_table(frame[frame["estimator"].isin(["exact", "formula"])])
    return ("## Beyond the standard step\n\n"
            "`training_settings` holds the measured points of transformers.Trainer (its optimizers, amp-fp16, "
            "accumulation), LoRA and QLoRA, TRL's SFTTrainer (full, LoRA, QLoRA, Liger) and DPOTrainer, bf16-autocast, "
            "and the 2025-26 architectures' loop and Trainer points; `settings_validation` the estimators against them "
            "(|predicted / measured - 1| of ok points; the fit verdict over ok and oom points; held-out rows are models "
            "nobody tuned on). The exact and formula estimators:\n\n" + summary_markdown(exact))


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
        "(fp32 weights and state, forward under `torch.autocast(\"cuda\", torch.bfloat16)`); `amp-fp16` (the "
        "same under fp16 autocast, with a gradient scaler); `bf16-autocast` (bf16 weights, gradients and state, "
        "the forward under bf16 autocast: `bf16=True` of the Trainer or SFTTrainer on a model loaded in bf16).",
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
    from pipeline.formulas.components import BLOG_A_BYTES_PER_ELEMENT

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
