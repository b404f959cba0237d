"""`python -m pipeline measure`: one point of one model, in this process; and `python -m pipeline.measure`,
the GPU machine's light entry point (measure and sweep only, without the other stages' imports)."""

from __future__ import annotations

import json
import sys

from pipeline.core.errors import UserError
from pipeline.core.paths import CONFIGS
from pipeline.core.vocabulary import ATTENTIONS, CLIENTS, OPTIMIZERS, OPTIMS, PRECISIONS, ROLLOUT_CLIENTS, VARIANTS
from pipeline.inputs.records import model_record
from pipeline.measure.device import cuda_device
from pipeline.measure.point import measure
from pipeline.training.step import TRAINER_DEFAULT_OPTIM, Setting


def add_cli(subparsers) -> None:
    from pipeline.core.arguments import positive_int

    parser = subparsers.add_parser("measure", help="peak memory of one training point (CUDA; --device cpu to debug)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model id (looked up in --configs, else the registry or the Hub)")
    source.add_argument("--config", help="a Hugging Face config.json")
    parser.add_argument("--configs", default=CONFIGS, help="output of `pipeline configs`")
    parser.add_argument("--batch", type=positive_int, required=True)
    parser.add_argument("--seq", type=positive_int, required=True)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--client", choices=CLIENTS, default="loop")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, help="the loop's optimizer (default adamw)")
    parser.add_argument("--optim", choices=OPTIMS, help=f"the trainer's, by transformers name (default {TRAINER_DEFAULT_OPTIM})")
    parser.add_argument("--gradient-accumulation", type=positive_int, default=1, metavar="K",
                        help="micro-batches per optimizer step (trainer)")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--liger-kernel", action="store_true", help="Liger's kernels (trainer, sft)")
    parser.add_argument("--completion-share", type=float, default=1.0, metavar="S",
                        help="the share of positions with a label (sft; default 1)")
    parser.add_argument("--rollout", default=None, metavar="JSON",
                        help="grpo, rloo: the rollout's GRPOConfig keys as JSON (num_generations, "
                             "max_completion_length, beta, ...); default TRL's")
    parser.add_argument("--packing", default=None, metavar="JSON",
                        help='sft: packed or padding-free batches as a table\'s packing cell ({"packing": true}, '
                             '{"padding_free": true}, with "documents": token counts of each row\'s documents)')
    parser.add_argument("--memory-history", default=None, metavar="PATH",
                        help="record the allocator's events of the point into PATH (.npz; training.memory_history)")
    parser.add_argument("--attn", choices=ATTENTIONS, default="default")
    parser.add_argument("--variant", choices=VARIANTS, default="standard")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--no-tf32", action="store_true", help="keep fp32 matmuls in full fp32 (slower)")
    parser.add_argument("--json", action="store_true", help="print the whole row as JSON")
    from pipeline.training.adapters import add_adapter_arguments

    add_adapter_arguments(parser)
    parser.set_defaults(handler=_measure_command)


def _measure_command(args) -> int:
    device = cuda_device(args.device)
    if device is None:
        raise UserError("no CUDA device here; use --device cpu for a (peak-less) CPU debug run")
    record = model_record(args.model, args.config, args.configs)
    from pipeline.training.adapters import adapter_from_arguments

    from pipeline.training.rollout import Rollout

    rollout = None
    if args.rollout is not None:
        from pipeline.core.io import parse_json

        keys = parse_json(args.rollout, "--rollout", "not JSON")
        if not isinstance(keys, dict):
            raise UserError("--rollout must be a JSON object of GRPOConfig keys")
        rollout = Rollout.of(keys, "--rollout", args.client)
    elif args.client in ROLLOUT_CLIENTS:  # TRL's defaults, the KV cache written in the row's rollout
        rollout = Rollout.of({}, "--rollout", args.client)
    packing = None
    if args.packing is not None:
        from pipeline.core.io import parse_json
        from pipeline.training.packing import Packing

        packing = Packing.from_keys(parse_json(args.packing, "--packing", "not JSON"), "--packing")
    setting = Setting(args.variant, args.optimizer, args.checkpointing, args.client, args.optim,
                      args.gradient_accumulation, adapter_from_arguments(args), args.liger_kernel, args.completion_share,
                      rollout=rollout, packing=packing)
    if args.memory_history and device == "cuda":
        from pipeline.training import memory_history

        memory_history.start()
    row = measure(record, args.batch, args.seq, args.precision, setting, args.attn, device, not args.no_tf32)
    if args.memory_history and device == "cuda":
        memory_history.save(args.memory_history, {key: row.get(key) for key in (
            "status", "peak_reserved_bytes", "peak_allocated_bytes", "alloc_conf")})
    if args.json:
        print(json.dumps(row, default=str))
    else:
        peak = row["peak_allocated_bytes"]
        print(f"{row['model_id']} {args.precision} B={args.batch} L={args.seq}: {row['status']}"
              + (f", peak {peak / 2**30:.2f} GiB" if peak else "") + (f" ({row['reason']})" if row["reason"] else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m pipeline.measure measure|sweep ...`: only the measuring commands, so that the GPU
    machine does not depend on the other stages' imports."""
    from pipeline.core.arguments import OneLineParser
    from pipeline.measure.sweep.cli import add_cli as add_sweep_cli

    parser = OneLineParser(prog="python -m pipeline.measure")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for add in (add_cli, add_sweep_cli):
        add(subparsers)
    args = parser.parse_args(argv)
    try:
        return args.handler(args) or 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

