"""Several GPUs, measured: every rank's peaks of the loop (the standard step under DDP or FSDP2) and of the
Trainer clients (transformers.Trainer, TRL's SFTTrainer and DPOTrainer as `torchrun` runs their scripts,
under DDP or FSDP2 through their arguments), one torchrun per point.

    python3 -m pipeline.measure.distributed --plan config/sweep_distributed_clients.yaml \
        --out results/distributed/h100/peak_memory.parquet
    python3 -m pipeline.measure.distributed --plan ... --dry-run

Modules: `plan` (the YAML plan, its groups and points), `launcher` (torchrun per point in slots of GPUs,
resumable), `rank` (what one rank measures and writes), `cli` (the command and the rank's entry point).
"""

from pipeline.measure.distributed.cli import add_cli, main

__all__ = ["add_cli", "main"]
