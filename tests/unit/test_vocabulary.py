"""One vocabulary: the bounds, defaults and choices of an acquire and of a pool's settings are
``gpulock_common.options``'s, and the Lua scripts (``lua/lib.lua``) enforce the same ones; the
core, the SDK, the broker's request models and the CLI take theirs from it; the priority check
is one function for the core and the SDK."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest

import gpulock_common.options as V
from gpulock_common.errors import InvalidArgument
from gpulock_common.options import AcquireOptions, check_priority, parse_priority

LUA = Path(__file__).resolve().parents[2] / "lua"


def _lua_constants() -> dict[str, object]:
    """lib.lua's top-level ``local A, B = 1, 2`` and ``local A = {'x', 'y'}`` constants."""
    out: dict[str, object] = {}
    for line in (LUA / "lib.lua").read_text().splitlines():
        m = re.match(r"local ([A-Z_][A-Z0-9_, ]*) = (.+?)\s*(?:--.*)?$", line)
        if not m:
            continue
        names = [n.strip() for n in m.group(1).split(",")]
        value = m.group(2)
        if value.startswith("{"):
            out[names[0]] = tuple(re.findall(r"'([^']*)'", value))
            continue
        values = [v.strip() for v in value.split(",")]
        if len(values) == len(names) and all(re.fullmatch(r"-?[0-9]+", v) for v in values):
            out.update({n: int(v) for n, v in zip(names, values)})
    return out


def test_lua_bounds_and_choices_are_the_vocabulary():
    lua = _lua_constants()
    assert (lua["PRIO_MIN"], lua["PRIO_MAX"]) == (V.PRIORITY_MIN, V.PRIORITY_MAX)
    assert lua["AGING_US"] == round(V.AGING_S * 1_000_000)
    assert (lua["MIN_TTL_MS"], lua["MAX_TTL_MS"]) == (
        round(V.MIN_TTL_S * 1000),
        round(V.MAX_TTL_S * 1000),
    )
    assert lua["MAX_META"] == V.MAX_META_BYTES
    assert lua["MAX_DEVICES"] == V.MAX_DEVICES
    assert (lua["MIN_WAITERS"], lua["MAX_WAITERS"]) == (V.MIN_MAX_WAITERS, V.MAX_MAX_WAITERS)
    assert (lua["MIN_BACKFILL_MS"], lua["MAX_BACKFILL_MS"]) == (
        round(V.MIN_BACKFILL_WINDOW_S * 1000),
        round(V.MAX_BACKFILL_WINDOW_S * 1000),
    )
    assert lua["DEFAULT_BACKFILL_MS"] == round(V.DEFAULT_BACKFILL_WINDOW_S * 1000)
    # the choices, in order: the first is a new pool's
    assert lua["POLICIES"] == V.POLICIES == get_args(V.Policy)
    assert lua["PLACEMENTS"] == V.PLACEMENTS == get_args(V.Placement)
    assert V.POLICIES[0] == V.DEFAULT_POLICY and V.PLACEMENTS[0] == V.DEFAULT_PLACEMENT


def test_the_scripts_use_the_constants_not_copies():
    """configure.lua names the choices and bounds through lib.lua's constants, so a change
    there is one change."""
    src = (LUA / "configure.lua").read_text()
    code = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith("--"))
    for literal in ("'fifo'", "'backfill'", "'bestfit'", "'spread'", "1000000"):
        assert literal not in code, literal


def test_the_core_and_the_broker_take_the_vocabulary():
    from gpulock.protocol import args
    from gpulock_broker import models

    assert args.validate_device is V.check_device and args.validate_placement is V.check_placement
    assert (args.PRIORITY_MIN, args.PRIORITY_MAX) == (V.PRIORITY_MIN, V.PRIORITY_MAX)
    assert (args.MIN_TTL_S, args.MAX_TTL_S, args.DEFAULT_TTL_S) == (
        V.MIN_TTL_S,
        V.MAX_TTL_S,
        V.DEFAULT_TTL_S,
    )
    schema = models.PoolConfigRequest.model_json_schema()["properties"]
    assert tuple(schema["policy"]["anyOf"][0]["enum"]) == V.POLICIES
    assert tuple(schema["placement"]["anyOf"][0]["enum"]) == V.PLACEMENTS
    lease = models.LeaseRequest.model_json_schema()["properties"]
    assert (lease["priority"]["minimum"], lease["priority"]["maximum"]) == (
        V.PRIORITY_MIN,
        V.PRIORITY_MAX,
    )
    assert lease["ttl"]["default"] == V.DEFAULT_TTL_S


class _Index:
    """An integer type of another library (numpy's int64 behaves so)."""

    def __init__(self, v: int):
        self.v = v

    def __index__(self) -> int:
        return self.v


@pytest.mark.parametrize("good", [0, -100, 100, 7, _Index(7), _Index(-100)])
def test_priority_takes_integers_of_any_integer_type(good):
    p = check_priority(good)
    assert type(p) is int and p == int(good.__index__() if isinstance(good, _Index) else good)


@pytest.mark.parametrize(
    "bad", ["5", "-5", " 5", 5.0, 1.5, True, False, None, b"5", 101, -101, _Index(101), object()]
)
def test_priority_refuses_text_floats_bools_and_out_of_range(bad):
    """Text is the edges' to parse (parse_priority: a command line, a header): the core's
    ``acquire`` and the SDK's refuse it alike."""
    with pytest.raises(InvalidArgument, match=r"priority must be an integer in \[-100, 100\]"):
        check_priority(bad)


@pytest.mark.parametrize("text,value", [("5", 5), ("-100", -100), ("+7", 7), (" 3 ", 3)])
def test_the_edges_parse_priority_text(text, value):
    assert parse_priority(text) == value


@pytest.mark.parametrize("bad", ["101", "x", "", "1e3", "--5", "1.5", "999999999"])
def test_the_edges_refuse_bad_priority_text(bad):
    with pytest.raises(InvalidArgument, match="priority must be an integer"):
        parse_priority(bad)


def test_acquire_options_checked():
    assert AcquireOptions() == AcquireOptions().checked()
    o = AcquireOptions(priority=_Index(5)).checked()  # type: ignore[arg-type]
    assert type(o.priority) is int and o.priority == 5
    for bad in (
        dict(priority="5"),
        dict(device=64),
        dict(device=True),
        dict(tenant="a b"),
        dict(resident="yes"),
    ):
        with pytest.raises(InvalidArgument, match=next(iter(bad))):
            AcquireOptions(**bad).checked()  # type: ignore[arg-type]
