"""What autograd saves for backward against the blog's hook count, from the committed tables.

For dense models (no routed experts), the ratio of saved-for-backward bytes per token (B=1) to
hook bytes per token at the blog point (elements x element size of the precision), as 5th
percentile / median / 95th percentile per precision and sequence length. The README quotes it.

    python benchmarks/saved_vs_hook.py [--results results] > benchmarks/results/saved_vs_hook.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "amp-bf16": 2}  # amp-bf16: the matmuls run in bf16


def ratios(activations: pd.DataFrame, models: pd.DataFrame) -> pd.DataFrame:
    ok = activations[activations["status"] == "ok"]
    dense = set(models.loc[~models["is_moe"].astype(bool), "model_id"])
    hook = ok[(ok["method"] == "hook") & (ok["dtype"] == "float32") & (ok["batch_size"] == 1) & (ok["seq_len"] == 1)]
    hook = hook.set_index("model_id")["elements_per_token"]
    saved = ok[(ok["method"] == "saved") & (ok["batch_size"] == 1) & ok["model_id"].isin(dense)].copy()
    saved["ratio"] = saved["bytes_per_token"] / (saved["model_id"].map(hook) * saved["dtype"].map(ELEMENT_BYTES))
    rows = []
    for (dtype, seq), group in saved.dropna(subset=["ratio"]).groupby(["dtype", "seq_len"]):
        q = group["ratio"].quantile([0.05, 0.5, 0.95])
        rows.append({"precision": dtype, "seq_len": seq, "models": len(group),
                     "p5": q[0.05], "median": q[0.5], "p95": q[0.95]})
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("results"))
    args = parser.parse_args()
    activations = pd.read_parquet(args.results / "activations.parquet")
    models = pd.read_parquet(args.results / "models.parquet")
    table = ratios(activations, models)
    commit = activations["git_commit"].iloc[0]
    print(f"# Saved-for-backward bytes / hook bytes per token, dense models, B=1 (activations at {commit})\n")
    print("| precision | L | models | 5th pct | median | 95th pct |\n|---|---:|---:|---:|---:|---:|")
    for row in table.itertuples():
        print(f"| {row.precision} | {row.seq_len} | {row.models} | {row.p5:.2f}x | {row.median:.2f}x | {row.p95:.2f}x |")


if __name__ == "__main__":
    main()
