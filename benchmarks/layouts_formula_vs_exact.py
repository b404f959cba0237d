"""The closed-form formula against the exact simulator on layouts beyond one node (issue 28): FSDP2, HSDP and tensor
parallelism at 8 to 1,024 GPUs, per-GPU peaks of a full fine-tune in bf16 with checkpointing, from configs alone
(no GPU measures these sizes here: both are simulations; the measured rows are in results/settings_validation.md).

    python benchmarks/layouts_formula_vs_exact.py [--out results/layouts/formula_vs_exact]

Writes OUT.parquet (one row per model x layout: both peaks, the formula's relative error, the split; with --reuse-exact
the exact peaks of an earlier table, each with the commit that simulated it) and OUT.md
(the rows and the median / worst error), each with the software's versions and the commit.
"""

from __future__ import annotations

import argparse
from pipeline.training.layout import Layout

MODELS = ("meta-llama/Llama-3.2-3B", "Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-70B", "mistralai/Mixtral-8x7B-v0.1")
LAYOUTS = (Layout(8, "fsdp"), Layout(64, "fsdp"), Layout(1024, "fsdp"), Layout(64, "hsdp", 8), Layout(1024, "hsdp", 8),
           Layout(64, "fsdp", tensor_parallel=2), Layout(1024, "fsdp", tensor_parallel=8),
           Layout(1024, "hsdp", 8, tensor_parallel=4))
# Kept out of what the formula's layout terms were shaped on: other models (two more MoE, 64 and 128 experts)
# and other layouts; reported apart.
HELDOUT_MODELS = ("Qwen/Qwen3-8B", "google/gemma-2-9b", "Qwen/Qwen2.5-72B", "allenai/OLMoE-1B-7B-0924",
                  "Qwen/Qwen3-30B-A3B")
HELDOUT_LAYOUTS = (Layout(16, "fsdp"), Layout(256, "fsdp"), Layout(256, "hsdp", 16), Layout(32, "fsdp", tensor_parallel=4),
                   Layout(512, "hsdp", 8, tensor_parallel=2), Layout(8, "ddp"), Layout(4, "fsdp-no-reshard"))
# The first held-out run showed fsdp-no-reshard 10-14% low (the gathered model was counted in place of its shards,
# not beside them); after that fix, a second held-out part of models and layouts not run before.
HELDOUT_AFTER_FIX_MODELS = ("meta-llama/Llama-3.1-8B", "microsoft/phi-4", "deepseek-ai/DeepSeek-V2-Lite")
HELDOUT_AFTER_FIX_LAYOUTS = (Layout(2, "fsdp-no-reshard"), Layout(8, "fsdp-no-reshard"), Layout(32, "fsdp"),
                             Layout(128, "hsdp", 8))
BATCH, SEQ = 1, 4096


def rows(models=MODELS, layouts=LAYOUTS, split: str = "tuned", part: str = "tuned", reuse=None) -> list[dict]:
    """One row per model x layout; `reuse` ({(model, layout): (exact peak, its commit)}) spares the exact runs of an
    earlier table made by the same simulator."""
    from pipeline.core.errors import UserError
    from pipeline.core.provenance import software
    from pipeline.estimate import estimate

    found = []
    for model in models:
        for layout in layouts:
            options = dict(model=model, batch=BATCH, seq=SEQ, precision="bf16", checkpointing=True, **layout.columns())
            row = {"split": split, "part": part, "model_id": model, "layout": layout.describe(), **layout.columns()}
            try:
                exact_peak, commit = (reuse or {}).get((model, layout.describe())) or (
                    estimate(**options, method="exact")["peak_bytes"], software()["git_commit"])
                formula = estimate(**options, method="formula")
            except UserError as exc:
                found.append({**row, "reason": str(exc)})
                continue
            row.update(exact_peak_bytes=exact_peak, exact_git_commit=commit, formula_peak_bytes=formula["peak_bytes"],
                       relative_error=formula["peak_bytes"] / exact_peak - 1)
            found.append(row)
            print(f"{model:32} {layout.describe():56} formula {row['relative_error']:+.3f}", flush=True)
    return found


def markdown(table) -> str:
    lines = ["# The formula against the exact simulator, layouts beyond one node", "",
             f"Full fine-tuning in bf16 with checkpointing, B={BATCH} per data-parallel rank, L={SEQ}; per-GPU peak "
             "allocated bytes, both simulated (no GPU here measures these sizes; the measured rows are in "
             "results/settings_validation.md). The tuned part shaped the formula's layout terms; the held-out part "
             "(other models, other layouts) was run after them and showed fsdp-no-reshard 10-14% low: the gathered "
             "model had been counted in place of its shards, not beside them (worst 13.8%, median 0.4%). After that "
             "fix (and one the measured Trainer rows showed: DDP's buckets held in every phase), the last part is "
             "models and layouts run for the first time.", ""]
    for part, rows_ in table.groupby("part", sort=False):
        ok = rows_.dropna(subset=["relative_error"])
        errors = ok["relative_error"].abs()
        lines += [f"## {part}", "", f"|formula / exact - 1|: median {100 * errors.median():.1f}%, worst "
                  f"{100 * errors.max():.1f}% over {len(ok)} layouts.", "",
                  "| model | layout | exact GiB | formula GiB | error |", "|---|---|---:|---:|---:|"]
        for r in rows_.itertuples(index=False):
            if r.relative_error != r.relative_error:
                lines.append(f"| {r.model_id} | {r.layout} | | | {r.reason} |")
                continue
            lines.append(f"| {r.model_id} | {r.layout} | {r.exact_peak_bytes / 2**30:.2f} | "
                         f"{r.formula_peak_bytes / 2**30:.2f} | {100 * r.relative_error:+.1f}% |")
        lines.append("")
    return "\n".join(lines)


def exact_peaks(path) -> dict:
    """{(model, layout): (exact peak bytes, the commit that simulated it)} of an earlier table."""
    import pandas as pd

    table = pd.read_parquet(path).dropna(subset=["exact_peak_bytes"])
    commits = table["exact_git_commit"] if "exact_git_commit" in table else table["git_commit"]
    return {(r.model_id, r.layout): (float(r.exact_peak_bytes), commit)
            for r, commit in zip(table.itertuples(index=False), commits)}


def main() -> None:
    import pandas as pd

    from pipeline.core.io import write_parquet, write_text
    from pipeline.core.provenance import software

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/layouts/formula_vs_exact")
    parser.add_argument("--reuse-exact", metavar="PARQUET",
                        help="an earlier table of this script: its exact peaks are kept (the formula is rerun)")
    args = parser.parse_args()
    reuse = exact_peaks(args.reuse_exact) if args.reuse_exact else None
    table = pd.DataFrame(rows(reuse=reuse) + rows(HELDOUT_MODELS, HELDOUT_LAYOUTS, "held-out", "held-out", reuse)
                         + rows(HELDOUT_AFTER_FIX_MODELS, HELDOUT_AFTER_FIX_LAYOUTS, "held-out", "held-out after the fix",
                                reuse))
    for name, value in software().items():
        table[name] = value
    write_parquet(table, f"{args.out}.parquet")
    write_text(markdown(table), f"{args.out}.md")
    print(markdown(table))


if __name__ == "__main__":
    main()
