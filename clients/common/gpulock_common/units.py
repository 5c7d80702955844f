"""Byte counts as people read them, for messages (parsing sizes stays with gpulock's edges)."""

from __future__ import annotations

__all__ = ["MAX_BYTES", "format_size"]

#: The most bytes gpulock counts: the largest integer the Lua scripts hold exactly (a double's
#: mantissa). ``gpulock.units.parse_size`` refuses more; :func:`format_size` never names more.
MAX_BYTES = 2**53 - 1


_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def _scaled(m: int) -> tuple[str, int, int]:
    """``(unit, its bytes, tenths of it)`` for ``m`` >= 1024 bytes: the largest unit of which
    ``m`` is 1.0 or more once rounded to a tenth (1 TiB - 1 byte is 1.0 TiB), in exact integers
    (no float rounding)."""
    for unit, size in _UNITS:
        tenths = (m * 10 + size // 2) // size
        if tenths >= 10 or unit == "KiB":
            return unit, size, tenths
    raise AssertionError("unreachable: KiB ends the loop")


def format_size(n: int) -> str:
    """``format_size(3 * 2**30) == "3.0GiB"``: one decimal, to the nearest tenth of the unit
    (never past :data:`MAX_BYTES`); bytes below 1 KiB print as ``"512B"``. What it prints,
    ``gpulock.units.parse_size`` reads back (``"1.4GiB"``: 1503238554 bytes, a fraction of a
    byte counting as a whole one) as a size within half a tenth of the unit of ``n`` that
    prints the same again."""
    n = int(n)
    sign, m = ("-" if n < 0 else ""), abs(n)
    if m < 1024:
        return f"{n}B"
    unit, size, tenths = _scaled(m)
    if tenths * size > MAX_BYTES * 10:
        tenths = m * 10 // size  # 8191.96TiB: "8192.0TiB" would be 2**53, too many
    return f"{sign}{tenths // 10}.{tenths % 10}{unit}"
