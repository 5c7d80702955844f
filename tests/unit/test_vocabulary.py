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


def test_lua_checks_request_ids_by_the_vocabulary():
    """lib.lua's id_arg takes 1-128 of [A-Za-z0-9._:-]: the core's bound."""
    src = (LUA / "lib.lua").read_text()
    assert f"#v > {V.MAX_REQUEST_ID_LEN}" in src
    assert f"1-{V.MAX_REQUEST_ID_LEN} characters of {V.REQUEST_ID_CHARS}" in src


def test_pool_settings_checked():
    s = V.PoolSettings("8GiB", _Index(5), 30, "backfill", "0.5", {"a": "1GiB"}, 2, "spread")  # type: ignore[arg-type]
    c = s.checked()
    assert (type(c.max_waiters), c.max_waiters) == (int, 5)
    assert (c.max_ttl, c.backfill_window) == (30.0, 0.5) and type(c.max_ttl) is float
    assert (c.capacity, c.quotas, c.devices) == ("8GiB", {"a": "1GiB"}, 2)  # sizes: as given
    assert V.PoolSettings().checked() == V.PoolSettings()
    for bad, shown in (
        (dict(max_waiters=0), r"max_waiters must be an integer in \[1, 1000000\], got 0"),
        (dict(max_waiters=True), "max_waiters"),
        (dict(max_waiters="5"), "max_waiters"),
        (dict(max_ttl=0.01), "max_ttl must be between 0.1 and 86400 seconds, got 0.01"),
        (dict(max_ttl=float("nan")), "max_ttl must be a finite number of seconds"),
        (dict(policy="lifo"), "policy must be 'fifo' or 'backfill', got 'lifo'"),
        (dict(backfill_window=0), "backfill_window must be between 0.001 and 86400"),
        (dict(backfill_window="soon"), "backfill_window must be a number of seconds"),
        (dict(placement="nearest"), "placement must be 'bestfit' or 'spread'"),
    ):
        with pytest.raises(InvalidArgument, match=shown):
            V.PoolSettings(**bad).checked()  # type: ignore[arg-type]


def test_pool_settings_given_are_keywords_and_a_body():
    s = V.PoolSettings(capacity=10, policy="fifo", quotas={"a": 0}, devices=(5, 5))
    assert s.given() == {"capacity": 10, "policy": "fifo", "quotas": {"a": 0}, "devices": [5, 5]}
    assert V.PoolSettings().given() == {}
    assert V.PoolSettings(devices=3).given() == {"devices": 3}  # a count (the core's)


def test_pool_settings_are_every_keyword_of_configure():
    """The public configure methods take exactly PoolSettings' fields as keywords (plus the
    core's create_only), so ``configure(**settings._asdict())`` passes them on."""
    import inspect

    import gpulock
    import gpulock_client

    fields = set(V.PoolSettings._fields)
    for method in (
        gpulock.Pool.configure,
        gpulock.AsyncPool.configure,
        gpulock_client.Pool.configure,
        gpulock_client.AsyncPool.configure,
    ):
        params = set(inspect.signature(method).parameters) - {"self", "create_only", "_grace"}
        assert params == fields, method


def test_the_broker_body_is_the_pool_settings():
    from gpulock_broker.models import PoolConfigRequest

    assert set(PoolConfigRequest.model_fields) == set(V.PoolSettings._fields)
    body = PoolConfigRequest.model_validate(
        {"capacity": "2GiB", "policy": "backfill", "backfill_window": 0.5, "quotas": {"a": "1GiB"}}
    )
    assert body.settings == V.PoolSettings(
        capacity=2 * 1024**3, policy="backfill", backfill_window=0.5, quotas={"a": 1024**3}
    )


@pytest.mark.parametrize(
    "bad, shown",
    [
        (dict(holder="x"), "holder must be a dict of metadata, got 'x'"),
        (dict(holder=[1]), "holder must be a dict"),
    ],
)
def test_the_holder_is_a_dict_on_both_sides(bad, shown):
    with pytest.raises(InvalidArgument, match=shown):
        AcquireOptions(**bad).checked()
    with pytest.raises(InvalidArgument, match=shown):
        AcquireOptions(**bad).checked(remote=True)


def test_remote_acquires_take_the_brokers_bounds():
    """Over HTTP a ttl is at least MIN_REMOTE_TTL_S and a request id at most
    MAX_REMOTE_REQUEST_ID_LEN characters (the broker scopes it to the token, and the core's
    bound holds for the scoped id); the broker's model states the same bounds."""
    from gpulock_broker import models

    assert models.MIN_TTL_S == V.MIN_REMOTE_TTL_S
    assert 16 + 1 + V.MAX_REMOTE_REQUEST_ID_LEN <= V.MAX_REQUEST_ID_LEN  # token id, ":"
    assert models.REQUEST_ID_PATTERN == f"^{V.REQUEST_ID_CHARS}{{1,{V.MAX_REMOTE_REQUEST_ID_LEN}}}$"
    AcquireOptions(ttl=0.5, request_id="r" * 128).checked()  # the core's bounds
    AcquireOptions(ttl=1, request_id="r" * 96).checked(remote=True)
    with pytest.raises(InvalidArgument, match="ttl must be between 1 and 86400 seconds"):
        AcquireOptions(ttl=0.5).checked(remote=True)
    with pytest.raises(InvalidArgument, match="request_id must be 1-96 characters"):
        AcquireOptions(request_id="r" * 97).checked(remote=True)
    with pytest.raises(InvalidArgument, match="request_id must be 1-128 characters"):
        V.check_request_id("r" * 129)


def test_preemption_bounds_and_wire_form():
    p = V.Preemption(_Index(5), "2.5")  # type: ignore[arg-type]
    assert (type(p.gap), p.gap, p.yield_grace_s, p.yield_grace_ms) == (int, 5, 2.5, 2500)
    assert V.Preemption(3).yield_grace_s == V.DEFAULT_YIELD_GRACE_S
    assert p.to_wire() == "5 2500" and V.Preemption.from_wire("5 2500") == p
    assert V.Preemption.from_wire("") is None  # off
    assert V.Preemption(V.PREEMPT_GAP_MIN, V.MIN_YIELD_GRACE_S).to_wire() == "1 100"
    assert V.Preemption(V.PREEMPT_GAP_MAX, V.MAX_YIELD_GRACE_S).to_wire() == "200 86400000"
    assert p.shown() == {"gap": 5, "yield_grace_s": 2.5}
    for bad, shown in (
        (dict(gap=0), r"preemption gap must be an integer in \[1, 200\], got 0"),
        (dict(gap=201), "got 201"),
        (dict(gap=True), "got True"),
        (dict(gap=2.0), "got 2.0"),
        (dict(gap="3"), "got '3'"),
        (dict(gap=3, yield_grace_s=0.05), "yield_grace must be between 0.1 and 86400 seconds"),
        (dict(gap=3, yield_grace_s=86401), "got 86401"),
        (dict(gap=3, yield_grace_s=float("inf")), "yield_grace must be a finite number"),
    ):
        with pytest.raises(InvalidArgument, match=shown):
            V.Preemption(**bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="preemption must be '<gap> <yield_grace_ms>'"):
        V.Preemption.from_wire("5")


def test_pool_settings_check_the_preemption():
    for ok in (None, False, V.Preemption(4)):
        assert V.PoolSettings(preemption=ok).checked().preemption == ok
    for bad in (True, 5, "on", {"gap": 5}):
        with pytest.raises(InvalidArgument, match=r"preemption must be None \(unchanged\)"):
            V.PoolSettings(preemption=bad).checked()  # type: ignore[arg-type]
    body = V.PoolSettings(preemption=V.Preemption(4, 10)).given()
    assert body == {"preemption": {"gap": 4, "yield_grace_s": 10.0}}
    assert V.PoolSettings(preemption=False).given() == {"preemption": False}


def test_the_broker_body_takes_the_preemption():
    from gpulock_broker.models import PoolConfigRequest

    on = PoolConfigRequest.model_validate({"capacity": 10, "preemption": {"gap": 4}})
    assert on.settings.preemption == V.Preemption(4, V.DEFAULT_YIELD_GRACE_S)
    off = PoolConfigRequest.model_validate({"capacity": 10, "preemption": False})
    assert off.settings.preemption is False
    assert PoolConfigRequest.model_validate({"capacity": 10}).settings.preemption is None
    for bad in ({"gap": 0}, {"gap": 4, "yield_grace_s": 0.01}, True, {"gap": 4, "x": 1}):
        with pytest.raises(ValueError):
            PoolConfigRequest.model_validate({"capacity": 10, "preemption": bad})


def test_lua_preemption_bounds_are_the_vocabulary():
    """lib.lua's bounds of a pool's preemption setting: the gap's, and the yield grace's in ms
    (its constants named with YIELD, MIN before MAX)."""
    lua = _lua_constants()
    assert (lua["PREEMPT_GAP_MIN"], lua["PREEMPT_GAP_MAX"]) == (
        V.PREEMPT_GAP_MIN,
        V.PREEMPT_GAP_MAX,
    )
    grace = sorted(v for k, v in lua.items() if "YIELD" in k and ("MIN" in k or "MAX" in k))
    assert grace == [round(V.MIN_YIELD_GRACE_S * 1000), round(V.MAX_YIELD_GRACE_S * 1000)]
