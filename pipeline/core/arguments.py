"""Command-line plumbing shared by every stage's sub-commands."""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments get one line naming the problem and exit code 2 (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value
