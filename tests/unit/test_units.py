"""units.parse_size / parse_seconds / format_size: no Redis."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulock.errors import InvalidArgument
from gpulock.units import (
    MAX_BYTES,
    SIZE_TEXT_PATTERN,
    format_size,
    parse_seconds,
    parse_size,
    parse_size_text,
)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("8GiB", 8 << 30),
        ("512MiB", 512 << 20),
        ("1KiB", 1024),
        ("2TiB", 2 << 40),
        ("1048576", 1 << 20),
        ("1.5GB", 1_500_000_000),
        ("4.1GB", 4_100_000_000),
        ("1.1MB", 1_100_000),
        (" 4 gib ", 4 << 30),
        ("3kb", 3000),
        ("1b", 1),
        ("0.5KiB", 512),
        ("1.4GiB", 1_503_238_554),  # 1503238553.6: a fraction of a byte counts as a byte
        ("1.1kb", 1100),
        ("0.001KiB", 2),
        ("7", 7),
        (1, 1),
        (4096, 4096),
        (1024.0, 1024),
        (MAX_BYTES, MAX_BYTES),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected
    assert type(parse_size(text)) is int


@pytest.mark.parametrize(
    "bad",
    [
        0,
        -1,
        -4096,
        "0",
        "-1",
        "0GiB",
        "abc",
        "4XB",
        "GiB",
        "",
        " ",
        "1e3",
        "1,5GB",
        "0.5",
        "1.3B",
        "nan",
        "inf",
        float("nan"),
        float("inf"),
        float("-inf"),
        1.5,
        True,
        False,
        None,
        [1],
        {},
        b"1",
        MAX_BYTES + 1,
        str(MAX_BYTES + 1),
        "9" * 400,
        "9" * 400 + ".0",
        "1" + "0" * 30 + "GiB",
        "\u0663",  # ARABIC-INDIC DIGIT THREE: not an ASCII digit
    ],
)
def test_parse_size_rejects_and_names_value(bad):
    with pytest.raises(InvalidArgument) as ei:
        parse_size(bad)
    assert repr(bad)[:40] in str(ei.value)
    assert "amount" in str(ei.value)


def test_an_unknown_unit_is_named_with_the_units_accepted():
    for parse in (parse_size, parse_size_text):
        with pytest.raises(InvalidArgument) as ei:
            parse("1PiB")
        msg = str(ei.value)
        assert "'1PiB'" in msg and "KiB, MiB, GiB, TiB" in msg and "kB, MB, GB, TB" in msg, msg
    with pytest.raises(InvalidArgument, match="unknown unit 'PiB'"):
        parse_size("1PiB")


def test_parse_size_names_the_parameter():
    with pytest.raises(InvalidArgument, match="capacity"):
        parse_size("lots", name="capacity")


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.text(max_size=30),
        st.from_regex(r"\A\s*[0-9]{1,25}(\.[0-9]{1,25})?\s*[A-Za-z]{0,4}\s*\Z"),
        st.integers(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.booleans(),
        st.none(),
    )
)
def test_parse_size_fuzz_never_crashes(value):
    """Any input either parses to an int in [1, 2**53-1] or raises InvalidArgument (never
    another exception type, never a non-int; a fraction of a byte only from a size with a
    unit, rounded up)."""
    try:
        n = parse_size(value)
    except InvalidArgument:
        return
    assert type(n) is int and 1 <= n <= MAX_BYTES


@settings(max_examples=100, deadline=None)
@given(st.integers(min_value=1, max_value=MAX_BYTES))
def test_parse_size_int_roundtrip(n):
    assert parse_size(n) == n
    assert parse_size(str(n)) == n


@pytest.mark.parametrize("value,expected", [(0.1, 0.1), (1, 1.0), ("2.5", 2.5), (86400, 86400.0)])
def test_parse_seconds_accepts(value, expected):
    assert parse_seconds(value, name="ttl", minimum=0.1, maximum=86400) == expected


@pytest.mark.parametrize(
    "bad", [0, -1, 0.05, 86401, 1e300, float("nan"), float("inf"), "abc", True, None, "", [1]]
)
def test_parse_seconds_rejects_and_names_value(bad):
    with pytest.raises(InvalidArgument) as ei:
        parse_seconds(bad, name="ttl", minimum=0.1, maximum=86400)
    assert "ttl" in str(ei.value) and repr(bad) in str(ei.value)


def test_parse_seconds_none_and_zero():
    assert parse_seconds(None, name="timeout", allow_none=True) is None
    assert parse_seconds(0, name="timeout", minimum=0.0) == 0.0
    assert parse_seconds(0, name="x", minimum=1.0, allow_zero=True) == 0.0
    with pytest.raises(InvalidArgument):
        parse_seconds(0, name="x", minimum=1.0)


def test_format_size():
    assert format_size(3 << 30) == "3.0GiB"
    assert format_size(512) == "512B"
    assert format_size(1536) == "1.5KiB"
    assert format_size(2047) == "2.0KiB" and format_size(1075) == "1.0KiB"
    assert format_size(MAX_BYTES) == "8191.9TiB"  # not 8192.0TiB: 2**53, over the bound
    assert format_size(-1536) == "-1.5KiB"
    assert math.isclose(parse_size(format_size(8 << 30)), 8 << 30)


_UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@settings(max_examples=1000, deadline=None, derandomize=True)
@given(
    st.one_of(
        st.integers(min_value=1, max_value=MAX_BYTES),
        st.integers(min_value=0, max_value=52).map(lambda k: 2**k),
        st.integers(min_value=1, max_value=53).map(lambda k: 2**k - 1),
        st.integers(min_value=1, max_value=8191).map(lambda t: t * 2**40 // 10 * 10 - 1),
    )
)
def test_every_size_printed_is_read_back(n):
    """What gpulock prints it accepts: the service's "no GPU memory for 1.4GiB" was refused
    by the CLI ("must be a whole number of bytes"). For every size, the printed text parses
    (the CLI's parse_size, and below "1000.0TiB" the HTTP bodies' parse_size_text) to a size
    within half a tenth of the unit (a tenth at the very top), which prints the same text."""
    text = format_size(n)
    unit = _UNIT[text.lstrip("0123456789.")]
    back = parse_size(text)
    assert 1 <= back <= MAX_BYTES, (n, text, back)
    if n < 8000 * 2**40:
        assert 20 * abs(n - back) <= unit + 20, (n, text, back)
    else:
        assert 10 * abs(n - back) <= unit, (n, text, back)
    assert format_size(back) == text
    if not text.endswith("TiB") or float(text[:-3]) < 1000:
        assert parse_size_text(text) == back


@settings(max_examples=2000, deadline=None, derandomize=True)
@given(st.from_regex(SIZE_TEXT_PATTERN, fullmatch=True).filter(lambda s: len(s) <= 40))
def test_every_size_text_the_pattern_allows_is_accepted(text):
    """The HTTP schemas carry SIZE_TEXT_PATTERN: a string it matches is a positive whole number
    of bytes below 2**53 (the broker once allowed "0" by its pattern and refused it)."""
    assert 1 <= parse_size_text(text) <= 2**53 - 1


@pytest.mark.parametrize(
    "text",
    [
        "0",
        "0.0GiB",
        "00",
        "0kb",
        "0.5",
        "1.0",
        "1.5B",
        "1.0625GiB",
        "007",
        "1000TiB",
        "1e3",
        "",
        "4GiB\n",
        "1.5 GiBs",
        "9" * 16,
    ],
)
def test_size_text_outside_the_pattern_is_refused(text):
    with pytest.raises(InvalidArgument, match="size such as"):
        parse_size_text(text)


@pytest.mark.parametrize(
    "text,n",
    [
        ("4GiB", 4 * 2**30),
        ("0.5GiB", 2**29),
        ("1.5GB", 1_500_000_000),
        ("1.125 KiB", 1152),
        ("1.1KiB", 1127),  # 1126.4: a fraction of a byte counts as a byte
        ("1.4GiB", 1_503_238_554),
        ("8.0GiB", 8 * 2**30),
        (" 7 kib ", 7168),
        ("999TiB", 999 * 2**40),
    ],
)
def test_size_text_in_the_pattern(text, n):
    assert parse_size_text(text) == n
