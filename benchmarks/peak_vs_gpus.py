"""One model's per-GPU peak against the number of GPUs under ddp, fsdp and fsdp-no-reshard (issue 27's figure):
the exact simulator and the formula at N = 1 to 64; the measured 2-GPU points are drawn beside them by the figure
stage (results/figures/several_gpus.png).

    python benchmarks/peak_vs_gpus.py [--out results/layouts/peak_vs_gpus.parquet]

The point is the loop's measured one on 2 H200s: Qwen2.5-1.5B, bf16, AdamW, B=4 per GPU, L=2048, no checkpointing.
"""

from __future__ import annotations

import argparse

MODEL, BATCH, SEQ, PRECISION = "Qwen/Qwen2.5-1.5B", 4, 2048, "bf16"
GPUS = (1, 2, 4, 8, 16, 32, 64)
SHARDINGS = ("ddp", "fsdp", "fsdp-no-reshard")


def rows() -> list[dict]:
    from pipeline.estimate import estimate

    found = []
    for sharding in SHARDINGS:
        for gpus in GPUS:
            layout = dict(num_gpus=gpus, sharding=sharding if gpus > 1 else None)
            options = dict(model=MODEL, batch=BATCH, seq=SEQ, precision=PRECISION, **layout)
            exact, formula = (estimate(**options, method=method) for method in ("exact", "formula"))
            found.append({"model_id": MODEL, "precision": PRECISION, "batch_size": BATCH, "seq_len": SEQ,
                          "num_gpus": gpus, "sharding": sharding, "exact_peak_bytes": exact["peak_bytes"],
                          "exact_reserved_bytes": exact["peak_reserved_bytes"],
                          "formula_peak_bytes": formula["peak_bytes"]})
            print(f"{sharding:16} N={gpus:3} exact {exact['peak_bytes'] / 2**30:7.2f} GiB  formula "
                  f"{formula['peak_bytes'] / 2**30:7.2f} GiB", flush=True)
    return found


def main() -> None:
    import pandas as pd

    from pipeline.core.io import write_parquet
    from pipeline.core.provenance import software

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/layouts/peak_vs_gpus.parquet")
    args = parser.parse_args()
    table = pd.DataFrame(rows())
    for name, value in software().items():
        table[name] = value
    write_parquet(table, args.out)


if __name__ == "__main__":
    main()
