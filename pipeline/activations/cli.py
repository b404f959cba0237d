"""The command line: `activations` (the stage) and `count` (one model)."""

from __future__ import annotations

import os
import time

from pipeline.activations.points import DEFAULT_POINTS, POINT_SETS, PRECISION_BYTES
from pipeline.core.arguments import positive_int
from pipeline.inputs.configs import CONFIG_SOURCES
from pipeline.core.paths import ACTIVATIONS, CONFIGS, DEFAULT_REGISTRY, MODELS


def add_cli(subparsers) -> None:
    stage = subparsers.add_parser("activations", help="count parameters and activations of every registry model")
    stage.add_argument("--registry", default=DEFAULT_REGISTRY)
    stage.add_argument("--configs", default=CONFIGS, help="the configs stage's output")
    stage.add_argument("--models-out", default=MODELS)
    stage.add_argument("--activations-out", default=ACTIVATIONS)
    stage.add_argument("--workers", type=positive_int, default=min(2, os.cpu_count() or 1),
                       help="processes forked after the imports (default: 2)")
    stage.add_argument("--model", action="append", dest="models", metavar="ID", help="only these models (repeat)")
    stage.add_argument("--points", default=DEFAULT_POINTS, choices=list(POINT_SETS),
                       help="blog: the hook method at (1, 1) only; standard: hook at 4 points and saved-for-backward "
                            "at L=128..8192 in 3 precisions; full: saved at every power of 2 from 128 to 8192")
    stage.set_defaults(handler=_stage_command)

    one = subparsers.add_parser("count", help="parameters and activations per token of one model")
    source = one.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="registry or Hub model id")
    source.add_argument("--config", help="path of a Hugging Face config.json")
    one.add_argument("--dtype", default="float32", choices=list(PRECISION_BYTES))
    one.add_argument("--batch", type=positive_int)
    one.add_argument("--seq", type=positive_int)
    one.add_argument("--config-source", default="auto", choices=CONFIG_SOURCES)
    one.add_argument("--registry", default=None, help="registry file (default: models.yaml of the project)")
    one.add_argument("--json", action="store_true", help="print JSON")
    one.set_defaults(handler=_count_command)


def _stage_command(args) -> int:
    from pipeline.activations.stage import write_activations

    start = time.perf_counter()
    models, activations = write_activations(args.registry, args.configs, args.models_out, args.activations_out,
                                            args.workers, args.models, args.points)
    status = models["status"].value_counts().to_dict()
    print(f"activations: {len(models)} models ({', '.join(f'{k}: {v}' for k, v in sorted(status.items()))}), "
          f"{len(activations)} rows -> {args.models_out}, {args.activations_out} "
          f"in {time.perf_counter() - start:.1f} s")
    return 0


def _count_command(args) -> int:
    import json

    from pipeline.activations.one_model import count

    result = count(args.model, args.config, args.dtype, args.batch, args.seq, args.config_source, args.registry)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        width = max(map(len, result))
        for key, value in result.items():
            print(f"{key:<{width}}  {value:,}" if isinstance(value, int) and not isinstance(value, bool)
                  else f"{key:<{width}}  {value}")
    return 0
