"""Sizes and durations at the edges of the API.

Amounts are integers of bytes everywhere inside gpulock. At the edges (CLI flags, HTTP
bodies, config) people write sizes: ``parse_size("4GiB") == 4 * 2**30``. Binary units
(KiB, MiB, GiB, TiB) are powers of 1024; decimal units (kB, MB, GB, TB) are powers of 1000, as
in IEC 80000-13; a bare number is bytes. What gpulock prints (:func:`format_size`, e.g.
``"1.4GiB"``) it reads back: a size with a unit may end in a fraction of a byte, which counts as
a whole byte (``"1.4GiB"`` is 1503238554 bytes). Sizes are at most :data:`MAX_BYTES`.
:func:`parse_size` is :mod:`gpulock_common.sizes`' (the SDK reads sizes with it too),
re-exported here.
"""

from __future__ import annotations

import math
import re
from typing import Literal, overload

from gpulock_common.options import check_seconds
from gpulock_common.sizes import UNITS_TEXT, parse_size
from gpulock_common.units import MAX_BYTES, format_size

from gpulock.errors import InvalidArgument

__all__ = [
    "MAX_BYTES",
    "SIZE_TEXT_MAX_LENGTH",
    "SIZE_TEXT_PATTERN",
    "format_size",
    "parse_duration",
    "parse_fraction",
    "parse_seconds",
    "parse_size",
    "parse_size_text",
]


def is_index(text: str) -> bool:
    """Whether ``text`` is a non-negative decimal integer in ASCII digits, as ``int()`` reads
    it: ``str.isdigit`` alone also passes characters such as "²" that ``int()`` refuses."""
    return text.isascii() and text.isdigit()


@overload
def parse_seconds(
    value: int | float | str | None,
    *,
    name: str,
    minimum: float = ...,
    maximum: float = ...,
    allow_none: Literal[False] = ...,
    allow_zero: bool = ...,
) -> float: ...


@overload
def parse_seconds(
    value: int | float | str | None,
    *,
    name: str,
    minimum: float = ...,
    maximum: float = ...,
    allow_none: bool,
    allow_zero: bool = ...,
) -> float | None: ...


def parse_seconds(
    value: int | float | str | None,
    *,
    name: str,
    minimum: float = 0.0,
    maximum: float = 86400.0,
    allow_none: bool = False,
    allow_zero: bool = False,
) -> float | None:
    """Validate a duration in seconds (float). ``None`` passes only with ``allow_none``;
    zero only with ``allow_zero``; otherwise the value must lie in [minimum, maximum].

    Raises:
        InvalidArgument: naming the value, for NaN, infinities, bools, non-numbers, and
            values out of range.
    """
    if value is None:
        if allow_none:
            return None
        raise InvalidArgument(f"{name} must be a number of seconds, got None")
    if allow_zero and not isinstance(value, bool):
        try:
            if float(value) == 0:
                return 0.0
        except (TypeError, ValueError):
            pass  # named by the check below
    return check_seconds(value, name=name, minimum=minimum, maximum=maximum)


def _size_text_pattern() -> str:
    """The regular expression of :data:`SIZE_TEXT_PATTERN` (built here, once)."""
    sp = " *"
    # a fraction of up to 3 decimals, never all zeros before a zero whole part; with a binary
    # unit it may end in a fraction of a byte, which counts as a whole byte (parse_size)
    nonzero = r"0\.(?:[1-9][0-9]{0,2}|0[1-9][0-9]?|00[1-9])"
    # integer digits per unit keep every value below 2**53 - 1 (about 9.007e15 bytes)
    forms = [rf"[1-9][0-9]{{0,14}}{sp}[bB]?"]
    for letter, digits in (("kK", 12), ("mM", 9), ("gG", 6), ("tT", 3)):
        whole = rf"[1-9][0-9]{{0,{digits - 1}}}"
        forms.append(rf"(?:{whole}(?:\.[0-9]{{1,3}})?|{nonzero}){sp}[{letter}](?:[iI]?[bB])?")
    return rf"^{sp}(?:{'|'.join(forms)}){sp}$"


#: The sizes an HTTP body may carry as text (the broker's ``amount`` and ``capacity``): a
#: number of bytes (``"1048576"``, ``"512B"``) or a number and a unit (any case): ``k``/``kB``
#: up to ``T``/``TB``, or ``KiB`` up to ``TiB``, with at most 3 decimals (``"0.5GiB"``,
#: ``"1.4GiB"``: a fraction of a byte counts as a whole one); spaces around and between. Never
#: zero, at most 15 digits of bytes (12 of kB, 9 of MB, 6 of GB, 3 of TB, and the same for the
#: binary units), so always below 2**53 - 1: every string it matches :func:`parse_size`
#: accepts, which is what lets an OpenAPI schema carry it as the exact rule
#: (:func:`parse_size_text` refuses what it does not match). Every size :func:`format_size`
#: prints up to ``999.9TiB`` matches it.
SIZE_TEXT_PATTERN = _size_text_pattern()
SIZE_TEXT_MAX_LENGTH = 40
_SIZE_TEXT_RE = re.compile(SIZE_TEXT_PATTERN)


def parse_size_text(value: int | float | str, *, name: str = "amount") -> int:
    """:func:`parse_size` for an HTTP body: a string must also match
    :data:`SIZE_TEXT_PATTERN` (and be at most :data:`SIZE_TEXT_MAX_LENGTH` characters), so that
    what a schema built from the pattern allows is exactly what is accepted. Numbers are read as
    :func:`parse_size` reads them.

    Raises: InvalidArgument naming the value."""
    if isinstance(value, str) and (
        len(value) > SIZE_TEXT_MAX_LENGTH or not _SIZE_TEXT_RE.fullmatch(value)
    ):
        raise InvalidArgument(
            f"{name} must be a size such as 4GiB, 0.5GiB, 1.5GB, 512MiB or 1048576 (bytes): "
            f"not zero, at most 3 decimals (bytes: none), below 2**53 bytes; units: "
            f"{UNITS_TEXT}; got {value!r}"
        )
    return parse_size(value, name=name)


_DURATION_RE = re.compile(r"^\s*([0-9]{1,12}(?:\.[0-9]{1,6})?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: str, *, name: str, minimum: float, maximum: float) -> float:
    """A duration as a person writes it: a number of seconds (``"30"``, ``"1.5"``) or a number
    with a unit, ms, s, m or h (``"30s"``, ``"500ms"``, ``"2m"``), as seconds in [minimum,
    maximum].

    Raises: InvalidArgument naming the value."""
    m = _DURATION_RE.match(value)
    if not m:
        raise InvalidArgument(
            f"{name} must be a duration such as 30s, 500ms, 2m or 1h (a bare number: "
            f"seconds), got {value!r:.80}"
        )
    seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if not minimum <= seconds <= maximum:
        raise InvalidArgument(
            f"{name} must be between {minimum:g} and {maximum:g} seconds, got {value!r:.80}"
        )
    return seconds


_FRACTION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(%?)\s*$")


def parse_fraction(value: int | float | str, *, name: str, maximum: float = 10.0) -> float:
    """A non-negative fraction: ``"10%"`` or ``0.1`` -> 0.1 (a percent sign divides by 100). A
    number without ``%`` is a fraction of 1, so it is at most 1: ``10`` is refused (it would
    read as 1000%), with a hint; ``"1000%"`` says that on purpose.

    Raises:
        InvalidArgument: naming the value, for anything else, a bare number above 1, or a
            value above ``maximum``.
    """
    if isinstance(value, bool):
        raise InvalidArgument(f"{name} must be a fraction such as 10% or 0.1, got {value!r}")
    percent = False
    if isinstance(value, (int, float)):
        f = float(value)
    else:
        m = _FRACTION_RE.match(str(value))
        if not m:
            raise InvalidArgument(f"{name} must be a fraction such as 10% or 0.1, got {value!r}")
        percent = bool(m.group(2))
        f = float(m.group(1)) / (100.0 if percent else 1.0)
    if not math.isfinite(f) or f < 0 or f > maximum:
        raise InvalidArgument(
            f"{name} must be between 0 and {maximum:g} (0% and {maximum * 100:g}%), got {value!r}"
        )
    if not percent and f > 1:
        raise InvalidArgument(
            f"{name} must be a fraction such as 10% or 0.1 (a number without % is a fraction "
            f"of 1), got {value!r}: did you mean {value}%?"
        )
    return f
