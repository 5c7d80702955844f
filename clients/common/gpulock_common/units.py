"""Byte counts as people read them, for messages (parsing sizes stays with gpulock's edges)."""

from __future__ import annotations

__all__ = ["format_size"]


def format_size(n: int) -> str:
    """``format_size(3 * 2**30) == "3.0GiB"``; bytes below 1 KiB print as ``"512B"``."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n}B"
