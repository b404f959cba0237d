"""`python -m pipeline <command>`: one sub-command per stage, each also a Python function.

Stage modules register their own sub-commands through `add_cli(subparsers)` and keep heavy
imports (torch, transformers) inside functions, so that `--help` and light commands start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pipeline.core.arguments import OneLineParser
from pipeline.core.errors import UserError

STAGE_MODULES = (
    "pipeline.inputs.configs",
    "pipeline.activations",
    "pipeline.measure.cli",
    "pipeline.measure.sweep",
    "pipeline.measure.distributed",
    "pipeline.simulate",
    "pipeline.fit.stage",
    "pipeline.estimate",
    "pipeline.validate.peaks",
    "pipeline.validate.settings",
    "pipeline.publish.dataset",
    "pipeline.publish.figures",
    "pipeline.publish.upload",
    "pipeline.serve",
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m pipeline", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name in STAGE_MODULES:
        importlib.import_module(name).add_cli(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # bad arguments (one line, code 2) or --help (code 0): the code is returned
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return args.handler(args) or 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
