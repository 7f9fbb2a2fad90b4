"""Counts and numbers as messages print them: "1 step", "2 steps", "1,048,576", "2.5 GiB", never "1 steps" or "1.04858e+06"."""

from __future__ import annotations


def number(value: float) -> str:
    """A whole number with thousands separators; other numbers in their shortest exact form."""
    if isinstance(value, bool) or not float(value).is_integer():
        return repr(value)
    return f"{int(value):,}"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun, plural unless n is 1: count(3, "process", "processes")."""
    return f"{number(n)} {noun if n == 1 else plural or noun + 's'}"


def byte_size(n: int) -> str:
    """A size in bytes in binary units, KiB to GiB: "512 B", "2.5 GiB"."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} GiB"
