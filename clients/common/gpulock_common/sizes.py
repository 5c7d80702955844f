"""Sizes as people write them, read into bytes: :func:`parse_size`, the one parser of an
amount that both sides use (gpulock at its edges: CLI flags, HTTP bodies, config; the SDK before
it sends a resize, to compare the new amount with the lease's). Binary units (KiB, MiB, GiB,
TiB) are powers of 1024; decimal units (kB, MB, GB, TB) are powers of 1000, as in IEC 80000-13;
a bare number is bytes. What :func:`gpulock_common.units.format_size` prints (``"1.4GiB"``) it
reads back: a size with a unit may end in a fraction of a byte, which counts as a whole byte.
No I/O; standard library only.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Union

from .errors import InvalidArgument
from .units import MAX_BYTES

__all__ = ["UNITS_TEXT", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "mb": 1000**2,
    "m": 1000**2,
    "gb": 1000**3,
    "g": 1000**3,
    "tb": 1000**4,
    "t": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
#: the units :func:`parse_size` reads, as its messages list them
UNITS_TEXT = (
    "B, kB, MB, GB, TB (powers of 1000; also k, m, g, t) and KiB, MiB, GiB, TiB (powers of "
    "1024), in any case"
)
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: Union[int, float, str], *, name: str = "amount") -> int:
    """Return ``value`` as a positive integer number of bytes.

    Accepts an int (bytes), an integral float, or a string such as ``"4GiB"``, ``"512 MiB"``,
    ``"1.5GB"``, ``"1.4GiB"`` or ``"1048576"``. Units are case-insensitive. A size with a unit
    of 1 kB or more that ends in a fraction of a byte counts it as a whole byte (rounds up:
    ``"1.4GiB"``, what :func:`format_size` prints for 1.35 to 1.45 GiB, is 1503238554
    bytes).

    Raises:
        InvalidArgument: for bools, NaN, infinities, zero or negative sizes, bytes with a
            fraction (``"1.5"``, ``"1.5B"``, ``1.5``), unknown units, and sizes above 2**53-1
            bytes. The message names the value.
    """
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be a size in bytes, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise InvalidArgument(f"{name} must be a whole number of bytes, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m:
            raise InvalidArgument(
                f"{name} must be a size such as 4GiB, 512MiB or 1048576 (bytes), got {value!r}"
            )
        unit = m.group(2).lower()
        if unit not in _UNITS:
            raise InvalidArgument(
                f"{name} has an unknown unit {m.group(2)!r}: the units are {UNITS_TEXT}, or "
                f"none for bytes; got {value!r}"
            )
        # Exact decimal arithmetic: a float would reject "4.1GB" (4.1 * 1e9 is not integral
        # in binary) and overflow to infinity on very long digit strings.
        n_exact = Fraction(m.group(1)) * _UNITS[unit]
        if n_exact.denominator != 1 and _UNITS[unit] == 1:
            raise InvalidArgument(f"{name} must be a whole number of bytes, got {value!r}")
        n = math.ceil(n_exact)  # a fraction of a byte (of "1.4GiB") counts as a whole byte
    else:
        raise InvalidArgument(f"{name} must be a size in bytes, got {value!r}")
    if n <= 0:
        raise InvalidArgument(f"{name} must be positive, got {value!r}")
    if n > MAX_BYTES:
        raise InvalidArgument(f"{name} must be at most {MAX_BYTES} bytes, got {value!r}")
    return n
