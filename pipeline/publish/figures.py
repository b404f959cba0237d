"""Stage: the figures (PNG, matplotlib Agg) under `results/figures/`.

Each figure needs some tables; a figure whose table is absent is skipped with a note, one whose
table has no usable rows is drawn with a note in place of the data (so the set of files depends
only on which tables exist: see `expected_figures`, which the Snakefile uses too).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.core.paths import FIGURES as FIGURES_DIR
from pipeline.core.paths import RESULTS
from pipeline.core.errors import UserError

GIB = 2**30
# figure -> the tables (files under results/) it needs
FIGURES = {
    "activations_vs_parameters": ("coefficients.json",),
    "residuals_by_family": ("coefficients.json",),
    "predicted_vs_measured": ("validation.parquet",),
    "peak_vs_tokens": ("peak_memory.parquet",),
    "saved_bytes_vs_seq_len": ("activations.parquet",),
    "formula_vs_counted": ("coefficients.json",),
    "formula_residuals_by_family": ("coefficients.json",),
    "full_vs_lora_vs_qlora": ("peak_memory.parquet", "lora/h100/peak_memory.parquet"),
    "trainer_vs_sft": ("sft/h100/peak_memory.parquet",),
    "several_gpus": ("settings_validation.parquet", "layouts/formula_vs_exact.parquet", "layouts/peak_vs_gpus.parquet"),
    "edge": ("settings_validation.parquet",),
}
SFT_MODELS = ("Qwen/Qwen2.5-0.5B", "meta-llama/Llama-3.2-1B")  # the Trainer and SFTTrainer of config/sweep_sft.yaml
ADAPTER_MODELS = ("Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B", "google/gemma-2-2b", "meta-llama/Llama-3.2-3B")
BAND_RESAMPLES = 1000


def expected_figures(available) -> list[str]:
    """The figures that can be drawn when the files in `available` (names under results/) exist."""
    available = set(available)
    return [name for name, needs in FIGURES.items() if set(needs) <= available]


def draw_figures(results_dir="results", out_dir="results/figures", only=None) -> dict[str, str]:
    """Draw every figure whose tables exist; returns {figure: path or the reason it was skipped}."""
    import matplotlib

    matplotlib.use("Agg")
    results_dir, out_dir = Path(results_dir), Path(out_dir)
    if not results_dir.is_dir():
        raise UserError(f"{results_dir}: no such results folder")
    unknown = sorted(set(only or ()) - set(FIGURES))
    if unknown:
        raise UserError(f"unknown figure {unknown[0]!r} (one of {', '.join(FIGURES)})")
    present = {name for needs in FIGURES.values() for name in needs if (results_dir / name).exists()}
    drawn = {}
    for name, needs in FIGURES.items():
        if only and name not in only:
            continue
        missing = [n for n in needs if n not in present]
        if missing:
            drawn[name] = f"skipped: {results_dir / missing[0]} absent"
            continue
        figure = DRAWERS[name](results_dir)
        path = out_dir / f"{name}.png"
        save(figure, path)
        drawn[name] = str(path)
    return drawn


def save(figure, path: Path) -> None:
    import matplotlib.pyplot as plt

    from pipeline.core.io import atomic_path

    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    plt.close(figure)


def read(results_dir: Path, name: str):
    from pipeline.core.io import read_json_object, read_table

    if name.endswith(".json"):
        return read_json_object(results_dir / name, "not found", "not a readable JSON file", "not a JSON object")
    return read_table(results_dir / name, name.removesuffix(".parquet"))


def no_data(ax, note: str) -> None:
    ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def family_colours(families) -> dict:
    import matplotlib.pyplot as plt

    names = sorted(set(families))
    cmap = plt.get_cmap("tab20")
    return {name: cmap(i % 20) for i, name in enumerate(names)}


def marker(i: int) -> str:
    return "osD^v<>ph*"[(i // 20) % 10]


# ----------------------------------------------------------------------------- activations vs N


def hook_points(results_dir: Path, coefficients: dict):
    """The rows the heuristic was fitted on (hook counts at B=1, L=1 of the ok models, as the
    coefficient file keeps them), with `x`: the fit's x column."""
    import pandas as pd

    points = pd.DataFrame(coefficients["data"]["rows"])
    if points.empty:
        return points.assign(x=[], elements_per_token=[], family=[], model_id=[])
    x_column = coefficients.get("x", "parameters")
    x = points[x_column] if x_column in points.columns else points["parameters"]
    return points.assign(x=x.fillna(points["parameters"]).astype(float))  # unknown active count: dense


def x_label(coefficients: dict) -> str:
    if coefficients.get("x") == "active_parameters":
        return "parameters N active per token (all of them for dense models)"
    return f"{coefficients.get('x', 'parameters')} N"


def bootstrap_band(x, y, ids, grid, weighting: str = "none", resamples: int = BAND_RESAMPLES, seed: int = 0):
    """Pointwise 95% percentile band of the fitted line over `grid`, resampling models (the fit's
    own least squares: weighted 1/y^2 when `weighting` is relative)."""
    import numpy as np

    from pipeline.fit.regression import bootstrap, line, relative_weights

    weights = relative_weights(y) if weighting == "relative" else None
    draws = bootstrap(line(), x[:, None], y, ids, weights, resamples, seed)
    lines = draws[:, :1] * grid + draws[:, 1:]
    return np.percentile(lines, 2.5, axis=0), np.percentile(lines, 97.5, axis=0)


def draw_activations_vs_parameters(results_dir: Path):
    import matplotlib.pyplot as plt
    import numpy as np

    from pipeline.formulas.components import BLOG_A_BYTES_PER_ELEMENT, BLOG_INTERCEPT, BLOG_SLOPE

    coefficients = read(results_dir, "coefficients.json")
    points = hook_points(results_dir, coefficients)
    figure, ax = plt.subplots(figsize=(10, 6.5))
    if points.empty:
        no_data(ax, "no ok hook counts at B=1, L=1")
        return figure
    colours = family_colours(points["family"])
    for family, group in points.groupby("family"):
        ax.scatter(group["x"], group["elements_per_token"], s=22, color=colours[family],
                   marker=marker(sorted(colours).index(family)), label=family, zorder=3)
    x = points["x"].to_numpy(float)
    grid = np.logspace(np.log10(x.min() / 1.5), np.log10(x.max() * 1.5), 200)
    a, b, weighting = coefficients["a"], coefficients["b"], coefficients.get("weighting", "none")
    if len(points) >= 3:
        low, high = bootstrap_band(x, points["elements_per_token"].to_numpy(float), points["model_id"].to_numpy(), grid,
                                   weighting)
        ax.fill_between(grid, low, high, color="black", alpha=0.12, label="refit, 95% bootstrap band")
    fitted = "relative-error least squares" if weighting == "relative" else "least squares"
    ax.plot(grid, a * grid + b, color="black", lw=1.6, label=f"refit ({fitted}): A = {a:.3e}·N + {b:.3e} elements")
    blog = (BLOG_SLOPE * grid + BLOG_INTERCEPT) / BLOG_A_BYTES_PER_ELEMENT
    ax.plot(grid, blog, color="crimson", lw=1.4, ls="--",
            label=f"blog: ({BLOG_SLOPE:.4e}·N + {BLOG_INTERCEPT:.4e}) fp32 bytes ÷ 4 = elements")
    ax.set(xscale="log", yscale="log", xlabel=x_label(coefficients),
           ylabel="activation elements per token (hook method, B=1, L=1)",
           title=f"Activations vs parameters: {len(points)} models, {points['family'].nunique()} families")
    ax.grid(True, which="both", alpha=0.25)
    handles, labels = ax.get_legend_handles_labels()
    families = len(colours)
    lines = ax.legend(handles[families:], labels[families:], fontsize=7, loc="upper left")
    ax.add_artist(lines)
    ax.legend(handles[:families], labels[:families], fontsize=6, ncol=1 + families // 30, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), frameon=False, title="family", title_fontsize=7)
    return figure


def draw_residuals_by_family(results_dir: Path):
    import matplotlib.pyplot as plt
    import numpy as np

    coefficients = read(results_dir, "coefficients.json")
    points = hook_points(results_dir, coefficients)
    figure, ax = plt.subplots(figsize=(max(6.0, 0.28 * points["family"].nunique() + 2), 5))
    if points.empty:
        no_data(ax, "no ok hook counts at B=1, L=1")
        return figure
    fitted = coefficients["a"] * points["x"] + coefficients["b"]
    points = points.assign(residual=(points["elements_per_token"] - fitted) / fitted)
    order = points.groupby("family")["residual"].median().sort_values().index.tolist()
    colours = family_colours(points["family"])
    rng = np.random.default_rng(0)
    for i, family in enumerate(order):
        values = points.loc[points["family"] == family, "residual"]
        ax.scatter(i + rng.uniform(-0.18, 0.18, len(values)), values, s=16, color=colours[family], zorder=3)
    ax.axhline(0, color="black", lw=1)
    ax.set_xticks(range(len(order)), order, rotation=90, fontsize=7)
    ax.yaxis.set_major_formatter(plt.matplotlib.ticker.PercentFormatter(1.0))
    ax.set(ylabel="(hook elements per token − refit) / refit",
           title=f"Residuals of the refit line ({coefficients.get('fit', 'refit')}), by family")
    ax.grid(True, axis="y", alpha=0.25)
    return figure


# ----------------------------------------------------------------------------- the closed-form formula

# (column of activation_formula.hook_predictions, panel title): leave-one-family-out where the fit is ours
FORMULA_PANELS = (("blog", "blog's line (fp32 bytes ÷ 4), not fitted"),
                  ("line_lofo", "A = a·N + b, leave one family out"),
                  ("formula_lofo", "closed form, leave one family out"))


def formula_points(results_dir: Path):
    """The fit's per-model hook counts and predictions (coefficients.json, activation_formula.hook_predictions)."""
    import pandas as pd

    section = read(results_dir, "coefficients.json").get("activation_formula", {})
    points = pd.DataFrame.from_records(section.get("hook_predictions") or [],
                                       columns=["model_id", "family", "counted", "formula", "formula_lofo", "line",
                                                "line_lofo", "blog", "held_out"])
    return points.assign(held_out=points["held_out"].eq(True))  # kept out of the fit (fit.formula.HELD_OUT_MODELS)


def relative_errors(points, column: str):
    return (points[column] - points["counted"]) / points["counted"]


def draw_formula_vs_counted(results_dir: Path):
    import matplotlib.pyplot as plt

    points = formula_points(results_dir)
    figure, axes = plt.subplots(1, len(FORMULA_PANELS), figsize=(5.2 * len(FORMULA_PANELS), 5.2), squeeze=False,
                                layout="constrained")
    if points.empty:
        no_data(axes[0, 0], "no hook predictions in coefficients.json")
        return figure
    colours = family_colours(points["family"])
    values = points[["counted"] + [c for c, _ in FORMULA_PANELS]].to_numpy(float)
    low, high = values[values > 0].min() / 1.5, values.max() * 1.5
    for ax, (column, title) in zip(axes[0], FORMULA_PANELS):
        for i, (family, group) in enumerate(points.groupby("family")):
            ax.scatter(group["counted"], group[column], s=14, color=colours[family],
                       marker=marker(sorted(colours).index(family)), zorder=3)
        held = points[points["held_out"]]
        ax.scatter(held["counted"], held[column], s=70, facecolors="none", edgecolors="black", zorder=4,
                   label="held out of the fit")
        ax.plot([low, high], [low, high], color="black", lw=1, label="y = x")
        ax.fill_between([low, high], [low / 1.1, high / 1.1], [low * 1.1, high * 1.1], color="grey", alpha=0.15,
                        label="±10%")
        error = relative_errors(points, column).abs()
        ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high),
               xlabel="counted hook elements per token (B=L=1)", ylabel="predicted",
               title=f"{title}\nmedian |error| {error.median():.1%}, worst {error.max():.0%}")
        ax.grid(True, which="both", alpha=0.25)
    axes[0, 0].legend(fontsize=7, loc="upper left")
    figure.suptitle(f"Predicted vs counted activations: {len(points)} models, {points['family'].nunique()} families "
                    "(one colour per family)")
    return figure


def draw_formula_residuals_by_family(results_dir: Path):
    import matplotlib.pyplot as plt
    import numpy as np

    points = formula_points(results_dir)
    figure, ax = plt.subplots(figsize=(max(6.0, 0.28 * points["family"].nunique() + 2), 5))
    if points.empty:
        no_data(ax, "no hook predictions in coefficients.json")
        return figure
    points = points.assign(inside=relative_errors(points, "formula"), outside=relative_errors(points, "formula_lofo"))
    order = points.groupby("family")["outside"].median().sort_values().index.tolist()
    rng = np.random.default_rng(0)
    for sample, offset, style in (("inside", -0.17, dict(color="tab:blue", marker="o")),
                                  ("outside", 0.17, dict(color="tab:red", marker="x"))):
        for i, family in enumerate(order):
            values = points.loc[points["family"] == family, sample]
            label = {"inside": "in sample", "outside": "leave one family out"}[sample] if i == 0 else None
            ax.scatter(i + offset + rng.uniform(-0.08, 0.08, len(values)), values, s=14, label=label, zorder=3, **style)
    ax.axhline(0, color="black", lw=1)
    ax.set_xticks(range(len(order)), order, rotation=90, fontsize=7)
    ax.yaxis.set_major_formatter(plt.matplotlib.ticker.PercentFormatter(1.0))
    ax.set(ylabel="(closed form − counted) / counted",
           title="Residuals of the closed-form hook count by family (sorted by the out-of-sample median)")
    ax.grid(True, axis="y", alpha=0.25)
    ax.legend(fontsize=7)
    return figure


# ----------------------------------------------------------------------------- peaks


def draw_predicted_vs_measured(results_dir: Path):
    import matplotlib.pyplot as plt
    import numpy as np

    rows = read(results_dir, "validation.parquet")
    rows = rows.dropna(subset=["predicted_peak_bytes", "measured_peak_bytes"])
    estimators = sorted(rows["estimator"].unique()) or ["(none)"]
    figure, axes = plt.subplots(1, len(estimators), figsize=(4.8 * len(estimators), 4.6), squeeze=False,
                             layout="constrained")
    if rows.empty:
        no_data(axes[0, 0], "no validated points")
        return figure
    precisions = sorted(rows["precision"].unique(), key=precision_order) if "precision" in rows.columns else [None]
    colours = dict(zip(precisions, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))
    low = min(rows["predicted_peak_bytes"].min(), rows["measured_peak_bytes"].min()) / GIB / 1.3
    high = max(rows["predicted_peak_bytes"].max(), rows["measured_peak_bytes"].max()) / GIB * 1.3
    for ax, estimator in zip(axes[0], estimators):
        group = rows[rows["estimator"] == estimator]
        for precision in precisions:
            part = group if precision is None else group[group["precision"] == precision]
            oom = part["status"] == "oom" if "status" in part.columns else np.zeros(len(part), bool)
            ax.scatter(part.loc[~oom, "measured_peak_bytes"] / GIB, part.loc[~oom, "predicted_peak_bytes"] / GIB,
                       s=14, alpha=0.7, color=colours[precision], label=precision or "points")
            if oom.any():
                ax.scatter(part.loc[oom, "measured_peak_bytes"] / GIB, part.loc[oom, "predicted_peak_bytes"] / GIB,
                           s=22, marker="x", color=colours[precision], label=f"{precision} (oom: GPU size)")
        ax.plot([low, high], [low, high], color="black", lw=1)
        ax.fill_between([low, high], [low * 0.75, high * 0.75], [low * 1.25, high * 1.25], color="grey", alpha=0.15,
                        label="±25%")
        error = group["relative_error"].abs() if "relative_error" in group.columns else None
        median = f", median |error| {error.median():.0%}" if error is not None and len(error) else ""
        ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel="measured peak (GiB)",
               ylabel="predicted peak (GiB)", title=f"{estimator}{median}")
        ax.grid(True, which="both", alpha=0.25)
    axes[0, -1].legend(fontsize=7, loc="lower right")
    figure.suptitle("Predicted vs measured peak of the standard training step")
    return figure


def precision_order(name: str):
    order = ("fp32", "float32", "bf16", "bfloat16", "amp-bf16")
    return (order.index(name) if name in order else len(order), name)


def standard_peaks(rows):
    keep = rows["status"] == "ok"
    if "variant" in rows.columns:
        keep &= rows["variant"].fillna("standard") == "standard"
    if "gradient_checkpointing" in rows.columns:
        keep &= ~rows["gradient_checkpointing"].fillna(False).astype(bool)
    if "optimizer" in rows.columns:
        keep &= rows["optimizer"].fillna("adamw") == "adamw"
    return rows[keep]


def spread_models(rows, count: int = 4) -> list[str]:
    """Up to `count` models spread over the parameter range, preferring ones with many points."""
    import numpy as np

    per_model = rows.groupby("model_id").agg(parameters=("parameters", "first"), points=("parameters", "size"))
    per_model = per_model.sort_values("parameters")
    if len(per_model) <= count:
        return per_model.index.tolist()
    many = per_model[per_model["points"] >= per_model["points"].median()]
    per_model = many if len(many) >= count else per_model
    picks = np.unique(np.linspace(0, len(per_model) - 1, count).round().astype(int))
    return per_model.index[picks].tolist()


def draw_peak_vs_tokens(results_dir: Path):
    import matplotlib.pyplot as plt

    rows = standard_peaks(read(results_dir, "peak_memory.parquet"))
    precisions = sorted(rows["precision"].unique(), key=precision_order) or ["(none)"]
    chosen = spread_models(rows)  # the same models in every panel
    figure, axes = plt.subplots(1, len(precisions), figsize=(4.8 * len(precisions), 4.4), squeeze=False,
                             layout="constrained")
    if rows.empty:
        no_data(axes[0, 0], "no ok peak measurements")
        return figure
    for ax, precision in zip(axes[0], precisions):
        part = rows[rows["precision"] == precision].assign(tokens=lambda f: f["batch_size"] * f["seq_len"])
        for colour, model_id in enumerate(chosen):
            model = part[part["model_id"] == model_id]
            for i, (batch, line) in enumerate(model.sort_values("seq_len").groupby("batch_size")):
                # one line per batch size B, along L
                label = f"{model_id} ({line['parameters'].iloc[0] / 1e9:.2g}B)" if i == 0 else None
                ax.plot(line["tokens"], line["peak_allocated_bytes"] / GIB, marker="o", ms=3, lw=1,
                        color=f"C{colour}", label=label)
        ax.set(xscale="log", yscale="log", xlabel="tokens per step B×L", ylabel="peak allocated (GiB)",
               title=precision)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=6)
    figure.suptitle("Measured peak vs tokens per step (AdamW, no checkpointing; one line per batch size)")
    return figure


def adapter_series(full, lora, model_id: str) -> dict:
    """Measured ok peaks of one model in bf16 without checkpointing: full fine-tuning (AdamW, the
    standard step), LoRA r=16 on all linears, QLoRA (nf4 base) r=16 on all linears."""
    def ok(frame):
        return frame[(frame["model_id"] == model_id) & (frame["status"] == "ok") & (frame["precision"] == "bf16")
                     & ~frame["gradient_checkpointing"].fillna(False).astype(bool)]

    full = ok(full)
    full = full[(full["optimizer"] == "adamw") & (full.get("variant", "standard") == "standard")]
    lora = ok(lora)
    lora = lora[(lora["lora_r"] == 16) & (lora["lora_targets"] == "all-linear") & (lora["client"] == "loop")]
    return {"full fine-tuning": full, "LoRA r=16": lora[lora["quantization"].isna()],
            "QLoRA nf4 r=16": lora[lora["quantization"].notna()]}


def plot_peaks_against_tokens(ax, series: dict, title: str) -> None:
    """Each {label: measured rows} series as its peak allocated GiB against B x L tokens, log x."""
    for colour, (label, rows) in enumerate(series.items()):
        rows = rows.assign(tokens=rows["batch_size"] * rows["seq_len"]).sort_values("tokens")
        ax.plot(rows["tokens"], rows["peak_allocated_bytes"] / GIB, "o-", ms=4, lw=1, color=f"C{colour}",
                label=label)
    ax.set(xscale="log", xlabel="tokens per step B×L", ylabel="peak allocated (GiB)", title=title)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7)


def draw_full_vs_lora_vs_qlora(results_dir: Path):
    import matplotlib.pyplot as plt

    full, lora = read(results_dir, "peak_memory.parquet"), read(results_dir, "lora/h100/peak_memory.parquet")
    figure, axes = plt.subplots(1, len(ADAPTER_MODELS), figsize=(4.2 * len(ADAPTER_MODELS), 4), squeeze=False,
                                layout="constrained")
    for ax, model_id in zip(axes[0], ADAPTER_MODELS):
        plot_peaks_against_tokens(ax, adapter_series(full, lora, model_id), model_id)
    figure.suptitle("Full fine-tuning vs LoRA vs QLoRA, bf16, no checkpointing (measured; QLoRA's fp32 upcasts "
                    "of prepare_model_for_kbit_training make it the largest at long sequences)")
    return figure


def sft_series(rows, model_id: str) -> dict:
    """Measured ok peaks of one model in bf16-autocast, without Liger, every position labelled, K=1: the
    Trainer with its defaults (no checkpointing), SFTTrainer with its defaults (checkpointing), and
    SFTTrainer with LoRA r=16 on all linears (checkpointing)."""
    rows = rows[(rows["model_id"] == model_id) & (rows["status"] == "ok") & (rows["precision"] == "bf16-autocast")
                & ~rows["liger_kernel"].fillna(False).astype(bool) & (rows["completion_share"].fillna(1.0) == 1.0)
                & (rows["gradient_accumulation"].fillna(1) == 1)]
    checkpointing = rows["gradient_checkpointing"].fillna(False).astype(bool)
    full = rows["lora_r"].isna()
    lora = (rows["lora_r"].fillna(0) == 16) & (rows["lora_targets"].fillna("") == "all-linear")  # nullable columns
    return {"Trainer (no checkpointing)": rows[(rows["client"] == "trainer") & full & ~checkpointing],
            "SFTTrainer (its defaults)": rows[(rows["client"] == "sft") & full & checkpointing],
            "SFTTrainer + LoRA r=16": rows[(rows["client"] == "sft") & lora & checkpointing]}


def draw_trainer_vs_sft(results_dir: Path):
    import matplotlib.pyplot as plt

    rows = read(results_dir, "sft/h100/peak_memory.parquet")
    figure, axes = plt.subplots(1, len(SFT_MODELS), figsize=(4.6 * len(SFT_MODELS), 4), squeeze=False,
                                layout="constrained")
    for ax, model_id in zip(axes[0], SFT_MODELS):
        series = sft_series(rows, model_id)
        if all(part.empty for part in series.values()):
            no_data(ax, f"no ok rows of {model_id}")
            continue
        plot_peaks_against_tokens(ax, series, model_id)
    figure.suptitle("transformers.Trainer vs TRL's SFTTrainer (fused LM head, checkpointing) vs SFTTrainer + LoRA, "
                    "bf16 weights under bf16 autocast (measured, H100)")
    return figure


def draw_saved_bytes_vs_seq_len(results_dir: Path):
    import matplotlib.pyplot as plt

    rows = read(results_dir, "activations.parquet")
    rows = rows[(rows["method"] == "saved") & (rows["status"] == "ok")]
    dtypes = sorted(rows["dtype"].unique(), key=precision_order) or ["(none)"]
    figure, axes = plt.subplots(1, len(dtypes), figsize=(4.8 * len(dtypes), 4.4), squeeze=False,
                             layout="constrained")
    if rows.empty:
        no_data(axes[0, 0], "no ok saved-for-backward counts")
        return figure
    for ax, dtype in zip(axes[0], dtypes):
        part = rows[rows["dtype"] == dtype]
        part = part[part["batch_size"] == part["batch_size"].min()]
        for model_id in spread_models(part, count=6):
            model = part[part["model_id"] == model_id].sort_values("seq_len")
            ax.plot(model["seq_len"], model["bytes_per_token"] / 2**20, marker="o", ms=3, lw=1,
                    label=f"{model_id} ({model['parameters'].iloc[0] / 1e9:.2g}B)")
        lengths = sorted(part["seq_len"].unique())
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="sequence length L (tokens)", ylabel="saved for backward (MiB per token)",
               title=f"{dtype}, B={int(part['batch_size'].min())}")
        ax.set_xticks(lengths, [str(length) for length in lengths], fontsize=7)
        ax.xaxis.set_minor_locator(plt.matplotlib.ticker.NullLocator())
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=6)
    figure.suptitle("Saved-for-backward bytes per token vs L (flat = linear in L)")
    return figure


LAYOUT_COLOURS = {"ddp": "tab:blue", "fsdp": "tab:orange", "fsdp-no-reshard": "tab:red", "hsdp": "tab:green",
                  "fsdp+tp": "tab:purple", "tp": "tab:brown", "zero1": "tab:pink", "zero2": "tab:olive",
                  "zero3": "tab:cyan"}
LAYOUT_MODEL = "meta-llama/Llama-3.1-70B"


def draw_several_gpus(results_dir: Path):
    """Measured several-GPU peaks against the exact simulator and the formula (per GPU, every rank a point), and
    one model's per-GPU peak on layouts beyond one node (both simulated)."""
    import matplotlib.pyplot as plt

    rows = read(results_dir, "settings_validation.parquet")
    rows = rows[(rows["layout"] != "1 GPU") & (rows["status"] == "ok") & rows["predicted_peak_bytes"].notna()]
    figure, grid = plt.subplots(2, 2, figsize=(14, 10), layout="constrained")
    axes = grid.ravel()
    for ax, estimator in zip(axes[:2], ("exact", "formula")):
        part = rows[rows["estimator"] == estimator]
        if part.empty:
            no_data(ax, f"no several-GPU rows for {estimator}")
            continue
        for layout, group in part.groupby("layout"):
            for split, filled in (("tuned", True), ("held-out", False)):
                points = group[group["split"] == split]
                colour = LAYOUT_COLOURS.get(layout, "grey")
                ax.scatter(points["measured_peak_bytes"] / 2**30, points["predicted_peak_bytes"] / 2**30, s=18,
                           facecolors=colour if filled else "none", edgecolors=colour,
                           label=f"{layout} ({split})" if len(points) else None)
        top = max(part["measured_peak_bytes"].max(), part["predicted_peak_bytes"].max()) / 2**30 * 1.05
        ax.plot([0, top], [0, top], color="black", lw=0.8)
        errors = part["relative_error"].abs()
        ax.set(xlabel="measured peak allocated per GPU (GiB)", ylabel="predicted (GiB)",
               title=f"{estimator}: median |error| {100 * errors.median():.2f}%,\nworst {100 * errors.max():.1f}%")
        ax.grid(True, alpha=0.25)
        ax.legend(fontsize=6)
    draw_peak_vs_gpus_panel(axes[2], read(results_dir, "layouts/peak_vs_gpus.parquet"), rows)
    draw_layouts_panel(axes[3], read(results_dir, "layouts/formula_vs_exact.parquet"))
    figure.suptitle("Several GPUs: the Trainer, SFT, DPO and the loop under DDP, FSDP2, HSDP, tensor parallelism and "
                    "DeepSpeed ZeRO "
                    "(measured on 2 and 4 H200s; filled: tuned, open: held-out)")
    return figure


def draw_peak_vs_gpus_panel(ax, curve, validation) -> None:
    """One model's per-GPU peak against N under ddp, fsdp and fsdp-no-reshard: the exact simulator's line, the
    formula's dashes, the measured points (every rank) of the same setting."""
    if curve.empty:
        no_data(ax, "no simulated curve (benchmarks/peak_vs_gpus.py)")
        return
    first = curve.iloc[0]
    measured = validation[(validation["estimator"] == "exact") & (validation["client"] == "loop")
                          & (validation["model_id"] == first["model_id"]) & (validation["batch_size"] == first["batch_size"])
                          & (validation["seq_len"] == first["seq_len"]) & (validation["precision"] == first["precision"])]
    for sharding, points in curve.groupby("sharding", sort=False):
        colour = LAYOUT_COLOURS.get(sharding, "grey")
        ax.plot(points["num_gpus"], points["exact_peak_bytes"] / 2**30, color=colour, marker="o", ms=3,
                label=f"{sharding}: exact")
        ax.plot(points["num_gpus"], points["formula_peak_bytes"] / 2**30, color=colour, ls="--", lw=0.8,
                label=f"{sharding}: formula")
        ran = measured[measured["layout"] == sharding]
        ax.scatter(ran["num_gpus"], ran["measured_peak_bytes"] / 2**30, color=colour, marker="*", s=120, zorder=3,
                   label=f"{sharding}: measured (H200)" if len(ran) else None)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="GPUs (N)", ylabel="peak allocated per GPU (GiB)",
           title=f"{first['model_id']}, {first['precision']}, AdamW, B={first['batch_size']} per GPU, "
                 f"L={first['seq_len']}:\nthe activations do not shard")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7)


def draw_layouts_panel(ax, table) -> None:
    """Per-GPU peak of LAYOUT_MODEL on each simulated layout: the exact simulator's bar, the formula's mark."""
    rows = table[(table["model_id"] == LAYOUT_MODEL)].dropna(subset=["exact_peak_bytes"])
    if rows.empty:
        no_data(ax, f"no simulated layouts of {LAYOUT_MODEL}")
        return
    labels = [label.replace(" GPUs, ", "\n").replace("replicas x", "x") for label in rows["layout"]]
    positions = range(len(rows))
    ax.bar(positions, rows["exact_peak_bytes"] / 2**30, color="tab:grey", label="exact simulator")
    ax.scatter(positions, rows["formula_peak_bytes"] / 2**30, color="tab:red", marker="_", s=200, label="formula")
    ax.axhline(80e9 / 2**30, color="black", lw=0.8, ls="--", label="80 GB")
    ax.set_xticks(list(positions), labels, fontsize=6, rotation=60, ha="right")
    ax.set(ylabel="peak allocated per GPU (GiB)", title=f"{LAYOUT_MODEL.split('/')[-1]}: full fine-tune, bf16,\n"
           "B=1, L=4096, checkpointing (simulated)")
    ax.legend(fontsize=7)


def draw_edge(results_dir: Path):
    """The points measured within a few GiB of the GPU's total (several GPUs, rank 0): the headroom each left on its
    GPU (its total less reserved and the memory outside PyTorch) against the exact estimator's; a point that ran out
    of memory is crossed at the line, where its estimate should be above."""
    import matplotlib.pyplot as plt

    rows = read(results_dir, "settings_validation.parquet")
    rows = rows[(rows["estimator"] == "exact") & (rows["rank"] == 0) & (rows["layout"] != "1 GPU")
                & rows["device"].str.contains("H100", na=False)].copy()
    figure, ax = plt.subplots(figsize=(11, 5), layout="constrained")
    rows["predicted_headroom"] = (rows["gpu_memory_bytes"] - rows["predicted_reserved_bytes"] - rows["outside_bytes"]) / GIB
    rows["measured_headroom"] = (rows["gpu_memory_bytes"] - rows["measured_reserved_bytes"] - rows["outside_bytes"]) / GIB
    near = (rows["status"] == "oom") | (rows["measured_headroom"] < EDGE_GIB)
    rows = rows[near].sort_values(["split", "layout", "model_id", "batch_size"]).reset_index(drop=True)
    if rows.empty:
        no_data(ax, "no several-GPU point measured near an H100's edge")
        return figure
    labels = [f"{r.model_id.split('/')[-1]} {r.client} {r.layout} B={r.batch_size}"
              + (" (expandable)" if isinstance(getattr(r, "alloc_conf", None), str) else "")
              + (" held out" if r.split == "held-out" else "") for r in rows.itertuples()]
    oom = rows["status"] == "oom"
    ax.axhline(0, color="grey", lw=1, ls="--", label="the GPU's total")
    ax.scatter(rows.index[~oom], rows["measured_headroom"][~oom], marker="o", s=45, color="tab:blue",
               label="measured headroom (trained)")
    ax.scatter(rows.index[oom], [0] * int(oom.sum()), marker="X", s=70, color="tab:red", label="ran out of memory")
    ax.scatter(rows.index, rows["predicted_headroom"].clip(lower=-EDGE_GIB), marker="_", s=250, color="black",
               label="exact estimate (below the line: does not fit)")
    ax.set_xticks(rows.index, labels, rotation=65, ha="right", fontsize=7)
    ax.set(ylabel="headroom on the GPU (GiB)", ylim=(-EDGE_GIB - 0.5, EDGE_GIB),
           title="The last GiB of an 80 GB H100 (2 GPUs, rank 0): estimated and measured headroom")
    ax.grid(True, axis="y", alpha=0.25)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return figure


EDGE_GIB = 4  # points within this of the GPU's total are the edge's


DRAWERS = {
    "activations_vs_parameters": draw_activations_vs_parameters,
    "residuals_by_family": draw_residuals_by_family,
    "predicted_vs_measured": draw_predicted_vs_measured,
    "peak_vs_tokens": draw_peak_vs_tokens,
    "saved_bytes_vs_seq_len": draw_saved_bytes_vs_seq_len,
    "formula_vs_counted": draw_formula_vs_counted,
    "formula_residuals_by_family": draw_formula_residuals_by_family,
    "full_vs_lora_vs_qlora": draw_full_vs_lora_vs_qlora,
    "trainer_vs_sft": draw_trainer_vs_sft,
    "several_gpus": draw_several_gpus,
    "edge": draw_edge,
}


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("figures", help="draw the figures (PNG) from the result tables")
    parser.add_argument("--results", default=RESULTS, help="folder with the stage outputs")
    parser.add_argument("--out", default=FIGURES_DIR)
    parser.add_argument("--only", nargs="+", default=None, metavar="FIGURE", help=f"some of: {', '.join(FIGURES)}")
    parser.set_defaults(handler=_figures_command)


def _figures_command(args) -> int:
    for name, where in draw_figures(args.results, args.out, args.only).items():
        print(f"figures: {name}: {where}")
    return 0
