"""`python -m pipeline <command>`: one sub-command per stage, each also a Python function.

Stage modules register their own sub-commands through `add_cli(subparsers)` and keep heavy
imports (torch, transformers) inside functions, so that `--help` and light commands start fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
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


# Commands that hold nothing open once they have printed: run as the interpreter's own `python -m pipeline`,
# their process ends without tearing down the ~4,000 modules torch and transformers load (1.5-2 s on 2 cores,
# longer than the exact answer takes).
QUICK_END_COMMANDS = ("estimate",)


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


def end(code: int):
    """Exit with `code`: at once after the exit handlers for a quick-end command run as `python -m pipeline`
    (never inside another program that runs the command line, such as a test or a server)."""
    if sys.orig_argv[1:3] == ["-m", "pipeline"] and sys.argv[1:2] and sys.argv[1] in QUICK_END_COMMANDS:
        import atexit

        atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter runs first when it exits
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    raise SystemExit(code)
