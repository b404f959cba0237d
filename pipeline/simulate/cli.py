"""The simulator's sub-commands: `simulate` (one point) and `simulate-peaks` (the stage)."""

from __future__ import annotations

import json

from pipeline.core.paths import CONFIGS, PEAKS, SIMULATED
from pipeline.core.arguments import positive_int
from pipeline.simulate.predict import ATTENTIONS
from pipeline.core.vocabulary import CLIENTS, OPTIMIZERS, OPTIMS, PRECISIONS, VARIANTS


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser("simulate", help="predict the training-step peak memory without a GPU")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="model id (registry entry or the Hub)")
    source.add_argument("--config", help="a Hugging Face config.json")
    parser.add_argument("--batch", type=positive_int, required=True)
    parser.add_argument("--seq", type=positive_int, required=True)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--client", choices=CLIENTS, default="loop")
    parser.add_argument("--optim", choices=OPTIMS, default=None, help="the Trainer clients' (trainer, sft)")
    parser.add_argument("--gradient-accumulation", type=positive_int, default=1, metavar="K")
    parser.add_argument("--liger-kernel", action="store_true", help="Liger's kernels (trainer, sft)")
    parser.add_argument("--completion-share", type=float, default=1.0, metavar="S",
                        help="the share of positions with a label (sft; default 1)")
    parser.add_argument("--attn-implementation", choices=ATTENTIONS, default="default")
    parser.add_argument("--variant", choices=VARIANTS, default="standard")
    parser.add_argument("--configs", default=CONFIGS,
                        help="output of `pipeline configs`, looked up first for --model")
    parser.add_argument("--json", action="store_true")
    from pipeline.training.adapters import add_adapter_arguments

    add_adapter_arguments(parser)
    parser.set_defaults(handler=_simulate_command)

    stage = subparsers.add_parser("simulate-peaks", help="simulate every point of the measured peak table")
    stage.add_argument("--peaks", default=PEAKS)
    stage.add_argument("--configs", default=CONFIGS)
    stage.add_argument("--out", default=SIMULATED)
    stage.add_argument("--workers", type=positive_int, default=1, help="processes (models are spread over them)")
    stage.set_defaults(handler=_simulate_peaks_command)


def _simulate_command(args) -> int:
    from pipeline.simulate.api import simulate
    from pipeline.training.adapters import adapter_from_arguments
    from pipeline.training.values import Run

    adapter = adapter_from_arguments(args)
    resolved = _resolve(args.model, args.config, args.configs)
    attention = None if args.attn_implementation == "default" else args.attn_implementation
    loop = args.client == "loop"
    estimate = simulate(resolved.config, Run(args.batch, args.seq, args.precision, args.optimizer if loop else None,
                                             args.checkpointing, attention, client=args.client, optim=args.optim,
                                             gradient_accumulation=args.gradient_accumulation, adapter=adapter,
                                             variant=args.variant, liger_kernel=args.liger_kernel,
                                             completion_share=args.completion_share))
    result = {"peak_bytes": estimate.peak_bytes, "components": estimate.components,
              "peak_reserved_bytes": estimate.reserved_bytes,
              "peak_reserved_expandable_bytes": estimate.reserved_expandable_bytes, **estimate.details,
              "model_id": resolved.model_id, "config_source": resolved.source, "config_revision": resolved.revision}
    if args.json:
        print(json.dumps(result))
    else:
        lora = "" if adapter is None else (f" {adapter.method} r={adapter.r} on {adapter.targets}"
                                           f"{' (' + adapter.quantization + ')' if adapter.quantization else ''},")
        print(f"{resolved.model_id} {args.precision}{lora} B={args.batch} L={args.seq}: "
              f"peak {result['peak_bytes'] / 2**30:.3f} GiB in {result['peak_phase']} ({result['seconds']:.2f} s)")
    return 0


def _resolve(model_id, config_path, configs_path):
    """--config PATH, or --model ID from configs.json when it has it, else the registry or the Hub."""
    from pathlib import Path

    from pipeline.inputs.configs import resolve_model, resolved_from_record
    from pipeline.simulate.peaks import ok_config_records

    if model_id and not config_path and Path(configs_path).exists():
        record = ok_config_records(configs_path).get(model_id)
        if record is not None:
            return resolved_from_record(model_id, record)
    return resolve_model(model_id, config_path)


def _simulate_peaks_command(args) -> int:
    from pipeline.simulate.peaks import simulate_peaks

    frame = simulate_peaks(args.peaks, args.configs, args.out, args.workers)
    counts = frame["simulate_status"].value_counts().to_dict()
    print(f"simulate-peaks: {len(frame)} points -> {args.out} ({', '.join(f'{k}: {v}' for k, v in counts.items())})")
    return 0
