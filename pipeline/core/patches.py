"""Attributes of other libraries set for the length of a block (a simulator's stand-ins)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def attributes_set(patches):
    """Each (owner, name, value) of `patches` set for the block; the previous values put back after it."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
