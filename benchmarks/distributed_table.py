"""Per-GPU peak of the standard step under DDP and FSDP2, simulated (pipeline.simulate.distributed.peak),
for a few large registry models: the README's several-GPU table.

    python benchmarks/distributed_table.py     # -> benchmarks/results/distributed_table.md
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODELS = ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-2-13b-hf", "codellama/CodeLlama-34b-hf")
SHARDINGS = ("ddp", "fsdp", "fsdp-no-reshard")
GPUS = (2, 4, 8)
GIB = 2**30


def main() -> None:
    from pipeline.inputs.configs import read_config_records
    from pipeline.core.io import write_text
    from pipeline.simulate import loop_peak
    from pipeline.simulate.distributed.peak import distributed_peak
    from pipeline.training.values import Run

    records = read_config_records(ROOT / "results/configs.json")
    lines = ["| model | one GPU | N | ddp | fsdp | fsdp-no-reshard |", "|---|---:|---:|---:|---:|---:|"]
    for model_id in MODELS:
        config = records[model_id]["config"]
        one = loop_peak(config, Run(1, 2048, "bf16")).peak_bytes / GIB
        for n in GPUS:
            cells = [f"{distributed_peak(config, Run(1, 2048, 'bf16', num_gpus=n, sharding=s)).peak_bytes / GIB:.1f}"
                     for s in SHARDINGS]
            lines.append(f"| {model_id if n == GPUS[0] else ''} | {f'{one:.1f}' if n == GPUS[0] else ''} | {n} | "
                         + " | ".join(cells) + " |")
    table = ("Simulated peak allocated per GPU (GiB; rank 0), standard step, bf16, AdamW, B=1 per GPU, "
             "L=2048\n\n" + "\n".join(lines) + "\n")
    write_text(table, ROOT / "benchmarks/results/distributed_table.md")
    print(table)


if __name__ == "__main__":
    main()
