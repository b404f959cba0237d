"""Command-line plumbing shared by every stage's sub-commands."""

from __future__ import annotations

import argparse
import math

from pipeline.core.text import short


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments get one line naming the problem and exit code 2 (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{short(text)} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{short(text)} must be positive")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{short(text)} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{short(text)} must be 0 or more")
    return value


def positive_number(text: str) -> float:
    """A positive finite number (NaN, infinities, zero and negatives refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{short(text)} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{short(text)} must be a positive finite number")
    return value
