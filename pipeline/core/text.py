"""Values shown in one-line messages: never longer than a line, never more than one line."""

from __future__ import annotations


def short(value, limit: int = 80, quote: bool = True) -> str:
    """`value` as it appears in a message: its repr (a text unquoted when `quote` is false: a path, a
    label), control characters escaped, cut to `limit` characters with the length said."""
    text = value if isinstance(value, str) and not quote else repr(value)
    text = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    if len(text) > limit:
        return f"{text[:limit]}... ({len(text):,} characters)"
    return text


def first_line(exc: BaseException, limit: int = 300) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = (str(exc).strip().splitlines() or [""])[0]
    return short(f"{type(exc).__name__}: {text}" if text else type(exc).__name__, limit, quote=False)
