"""`python -m pipeline measure-distributed` (the plan's driver) and `python -m pipeline.measure.distributed rank`
(one rank of one point, started by torchrun)."""

from __future__ import annotations

import argparse
import sys

from pipeline.core.errors import UserError
from pipeline.core.paths import CONFIGS, REPO_ROOT, RESULTS
from pipeline.core.vocabulary import CLIENTS, PRECISIONS, SHARDINGS, SPLITS
from pipeline.measure.distributed.plan import ADAPTERS


def add_cli(subparsers) -> None:
    """`python -m pipeline measure-distributed`: a several-GPU plan, one torchrun per point."""
    from pipeline.core.arguments import positive_int

    parser = subparsers.add_parser("measure-distributed",
                                   help="measure the loop and the Trainer clients on several GPUs (torchrun)")
    parser.add_argument("--plan", default=REPO_ROOT / "config" / "sweep_distributed_clients.yaml")
    parser.add_argument("--out", default=RESULTS / "distributed" / "peak_memory.parquet")
    parser.add_argument("--config", help="a config.json instead of the plan's model ids (tests)")
    parser.add_argument("--devices", type=positive_int, help="GPUs to use (default: all; ranks on the CPU without)")
    parser.add_argument("--deadline", type=positive_int, metavar="SECONDS", help="start no point after this")
    parser.add_argument("--dry-run", action="store_true")
    parser.set_defaults(handler=_measure_command)


def _measure_command(args) -> int:
    from pipeline.measure.distributed.launcher import run_plan

    rows = run_plan(args.plan, args.out, args.dry_run, args.config, args.devices, args.deadline)
    if not args.dry_run:
        print(f"measure-distributed: {len(rows)} rows -> {args.out}")
    return 0


def rank_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipeline.measure.distributed rank")
    parser.add_argument("--model", required=True)
    parser.add_argument("--config")
    parser.add_argument("--configs", default=CONFIGS)
    parser.add_argument("--client", choices=CLIENTS, default="loop")
    parser.add_argument("--precision", choices=PRECISIONS, required=True)
    parser.add_argument("--sharding", choices=SHARDINGS, help="none: tensor parallelism alone")
    parser.add_argument("--shard-group", type=int, help="hsdp: GPUs a model is sharded over")
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--deepspeed", help="zero1-3: the DeepSpeed config's JSON text (training.zero)")
    parser.add_argument("--hyperparameters", help="TrainingArguments' optimizer and schedule numbers, JSON")
    parser.add_argument("--memory-history", help="rank 0 records the allocator's events to this file (.npz)")
    parser.add_argument("--rollout", help="grpo, rloo: the rollout's GRPOConfig keys (training.rollout), JSON")
    parser.add_argument("--packing", help="sft: packed or padding-free batches (training.packing), JSON")
    parser.add_argument("--adapter", choices=ADAPTERS, default="full")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--split", choices=SPLITS, default="tuned")
    parser.add_argument("--out", required=True, help="the point's folder: rank{r}.json per rank")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rank"]:
        from pipeline.measure.distributed.rank import measure_rank, write_row

        args = rank_parser().parse_args(argv[1:])
        row = measure_rank(args)
        write_row(row, args.out)
        # a rank that failed leaves the others in their collectives: torchrun ends them when this one exits
        return 0 if row["status"] == "ok" else 1
    parser = argparse.ArgumentParser(prog="python -m pipeline.measure.distributed")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["measure-distributed", *argv])
    try:
        return args.handler(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
