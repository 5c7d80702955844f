"""Bad input changes nothing (SEMANTICS.md invariant 6): each bad value raises InvalidArgument (or
CapacityExceeded) naming the value, and every gpulock key is byte-for-byte the same after.
The Lua scripts are also called directly with bad ARGV (bypassing the Python checks)."""

from __future__ import annotations

import asyncio

import pytest
import redis

from hypothesis import HealthCheck, given, settings

from hypothesis import strategies as st

from gpulock import AsyncPool, CapacityExceeded, InvalidArgument, Pool
from gpulock.protocol.args import new_id
from support.pools import GiB, raw, raw_acquire, raw_configure, snapshot

CAP = 8 * GiB


def _setup(rclient, pool_name):
    """A pool with a holder and two waiters, all with long expiries (nothing moves by itself)."""
    raw_configure(rclient, pool_name, CAP)
    g = raw_acquire(rclient, pool_name, 6 * GiB, ticket="holder")
    raw_acquire(rclient, pool_name, 4 * GiB, ticket="w1")
    raw_acquire(rclient, pool_name, GiB, ticket="w2")
    return g[1].decode(), int(g[2])


BAD_AMOUNTS = [
    0,
    -1,
    -GiB,
    float("nan"),
    float("inf"),
    float("-inf"),
    "abc",
    "4XB",
    "",
    "-1GiB",
    "1e9",
    True,
    False,
    None,
    1.5,
    "0.5B",
    [GiB],
    2**53,
]
BAD_TTLS = [0, -1, 0.0, float("nan"), float("inf"), 86401, 1e12, "soon", True, 0.01]
BAD_POOLS = ["a{b", "a}b", "{gpu0}", "gpu:0", "gpu 0", "", "x" * 65, " gpu0", "gpu0\n", None]
BAD_REQUEST_IDS = ["a b", "", "x" * 129, "a|b", "a\nb", "ü", 7]


@pytest.mark.parametrize("amount", BAD_AMOUNTS, ids=repr)
def test_bad_amount_sync(make_pool, rclient, pool_name, amount):
    _setup(rclient, pool_name)
    before = snapshot(rclient)
    pool = make_pool(capacity=CAP)
    with pytest.raises(InvalidArgument) as ei:
        pool.acquire(amount, timeout=1)
    assert repr(amount)[:30] in str(ei.value)
    assert snapshot(rclient) == before


async def test_bad_values_async(make_apool, rclient, pool_name):
    _setup(rclient, pool_name)
    before = snapshot(rclient)
    pool = make_apool(capacity=CAP)
    for amount in BAD_AMOUNTS:
        with pytest.raises(InvalidArgument) as ei:
            await pool.acquire(amount, timeout=1)
        assert repr(amount)[:30] in str(ei.value), (amount, str(ei.value))
    for ttl in BAD_TTLS:
        with pytest.raises(InvalidArgument) as ei:
            await pool.acquire(GiB, ttl=ttl, timeout=1)
        assert "ttl" in str(ei.value) and repr(ttl) in str(ei.value)
    for timeout in (-1, float("nan"), "x"):
        with pytest.raises(InvalidArgument, match="timeout"):
            await pool.acquire(GiB, timeout=timeout)
    for rid in BAD_REQUEST_IDS:
        with pytest.raises(InvalidArgument) as ei:
            await pool.acquire(GiB, request_id=rid, timeout=1)
        assert repr(rid) in str(ei.value)
    with pytest.raises(InvalidArgument, match="512"):
        await pool.acquire(GiB, holder={"note": "x" * 1000}, timeout=1)
    with pytest.raises(InvalidArgument, match="dict"):
        await pool.acquire(GiB, holder="me", timeout=1)
    # amount > capacity: CapacityExceeded at once, naming both numbers.
    with pytest.raises(CapacityExceeded) as ei:
        await pool.acquire(CAP + 1, timeout=None)
    assert str(CAP + 1) in str(ei.value) and str(CAP) in str(ei.value)
    for cap in (0, -1, "big", float("nan"), 2**53):
        with pytest.raises(InvalidArgument) as ei:
            await pool.configure(cap)
        assert "capacity" in str(ei.value) and repr(cap) in str(ei.value)
    with pytest.raises(InvalidArgument, match="max_waiters"):
        await pool.configure(CAP, max_waiters=0)
    assert snapshot(rclient) == before


@pytest.mark.parametrize("name", BAD_POOLS, ids=repr)
def test_bad_pool_names(redis_proc, rclient, pool_name, name):
    _setup(rclient, pool_name)
    before = snapshot(rclient)
    with pytest.raises(InvalidArgument) as ei:
        Pool(rclient, name, capacity=CAP)
    assert repr(name) in str(ei.value)
    with pytest.raises(InvalidArgument):
        AsyncPool(redis.asyncio.Redis.from_url(redis_proc.url), name)
    assert snapshot(rclient) == before


def test_bad_capacity_at_construction(rclient):
    with pytest.raises(InvalidArgument, match="capacity"):
        Pool(rclient, "gpu0", capacity="lots")


# ---- the scripts themselves, with bad ARGV ---------------------------------------------------


def _expect_badarg(rclient, pool_name, op, *argv, word=None):
    before = snapshot(rclient)
    with pytest.raises(redis.ResponseError) as ei:
        raw(rclient, pool_name, op, *argv)
    msg = str(ei.value)
    assert msg.startswith("GPULOCK_BADARG"), msg
    if word:
        assert word in msg, msg
    assert snapshot(rclient) == before
    return msg


def test_lua_acquire_bad_argv(rclient, pool_name):
    _setup(rclient, pool_name)
    L = new_id()
    ok = ["t-new", L, str(GiB), "5000", "5000", "wait", "{}", "test"]

    def with_(i, v):
        a = list(ok)
        a[i] = v
        return a

    cases = [
        (0, "a b"),
        (0, ""),
        (0, "x" * 129),
        (0, "a|b"),
        (1, "nothex" + "0" * 26),
        (1, "abc"),
        (1, "0" * 33),
        (1, ""),
        (2, "0"),
        (2, "-1"),
        (2, "abc"),
        (2, "1.5"),
        (2, "1e9"),
        (2, "nan"),
        (2, "inf"),
        (2, " 1"),
        (2, "99999999999999999"),
        (2, "9007199254740992"),
        (3, "0"),
        (3, "99"),
        (3, "86400001"),
        (3, "-5"),
        (3, "nan"),
        (4, "0"),
        (4, "x"),
        (5, "maybe"),
        (5, ""),
        (6, "x" * 513),
        (7, ""),
        (7, "a:b"),
        (7, "x" * 33),
    ]
    for i, v in cases:
        _expect_badarg(
            rclient, pool_name, "acquire", *with_(i, v), word=v[:20] if i not in (6,) else "512"
        )
    # Missing arguments.
    _expect_badarg(rclient, pool_name, "acquire", "t-new", L)
    _expect_badarg(rclient, pool_name, "acquire")


def test_lua_other_scripts_bad_argv(rclient, pool_name):
    lid, token = _setup(rclient, pool_name)
    _expect_badarg(rclient, pool_name, "release", "zz" * 16, token, word="lease id")
    _expect_badarg(rclient, pool_name, "release", lid, "-1", word="token")
    _expect_badarg(rclient, pool_name, "release", lid, "abc", word="token")
    _expect_badarg(rclient, pool_name, "release", lid)
    _expect_badarg(rclient, pool_name, "cancel", "a b", word="ticket")
    _expect_badarg(rclient, pool_name, "cancel")
    _expect_badarg(rclient, pool_name, "status", "-1", word="limit")
    _expect_badarg(rclient, pool_name, "status", "x", word="limit")
    _expect_badarg(rclient, pool_name, "configure", "0", "10", "set", word="capacity")
    _expect_badarg(rclient, pool_name, "configure", "abc", "10", "set", word="capacity")
    _expect_badarg(rclient, pool_name, "configure", str(GiB), "0", "set", word="max_waiters")
    _expect_badarg(rclient, pool_name, "configure", str(GiB), "10", "replace", word="mode")
    # renew validates every triple before the first write: a bad last one changes nothing,
    # not even the valid leases before it.
    _expect_badarg(
        rclient, pool_name, "renew", 2, lid, token, 60000, lid, token, 0, 0, word="ttl_ms"
    )
    _expect_badarg(
        rclient, pool_name, "renew", 1, lid, token, 60000, 1, "w1", "abc", word="waiter_ttl_ms"
    )
    _expect_badarg(rclient, pool_name, "renew", 1, lid, token, 60000, 1, "a b", 5000, word="ticket")
    _expect_badarg(rclient, pool_name, "renew", 3, lid, token, 60000)  # fewer triples than said
    _expect_badarg(rclient, pool_name, "renew", "x", word="n_leases")
    _expect_badarg(rclient, pool_name, "renew", 1, lid, token, 60000)  # n_tickets missing


def test_lua_conflicts_change_nothing(rclient, pool_name):
    lid, token = _setup(rclient, pool_name)
    before = snapshot(rclient)
    for argv in (
        ["holder", new_id(), str(GiB), "5000", "5000", "wait", "{}", "test"],  # another amount
        ["w1", new_id(), str(GiB), "5000", "5000", "wait", "{}", "test"],  # queued, other amount
        ["fresh", lid, str(GiB), "5000", "5000", "wait", "{}", "test"],
    ):  # lease id in use
        with pytest.raises(redis.ResponseError, match="GPULOCK_CONFLICT"):
            raw(rclient, pool_name, "acquire", *argv)
        assert snapshot(rclient) == before
    with pytest.raises(redis.ResponseError, match="GPULOCK_CAPACITY"):
        raw(
            rclient,
            pool_name,
            "acquire",
            "big",
            new_id(),
            str(CAP + 1),
            "5000",
            "5000",
            "wait",
            "{}",
            "test",
        )
    with pytest.raises(redis.ResponseError, match="GPULOCK_NOPOOL"):
        raw(rclient, "other", "acquire", "t", new_id(), "1", "5000", "5000", "wait", "{}", "test")
    assert snapshot(rclient) == before


_ARG = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8"), max_size=20),
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", " ", "1 ", "0x10", "1e3", "+1", "01", "wait", "try", new_id()]),
)


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(amount=_ARG, ttl=_ARG, mode=st.sampled_from(["wait", "try", "x"]), ticket=_ARG)
def test_lua_acquire_fuzz(rclient, pool_name, amount, ttl, mode, ticket):
    """Random ARGV straight into acquire: either a well-formed reply, or an error with
    nothing written."""
    if not rclient.exists(f"gpulock:{{{pool_name}}}:cfg"):
        _setup(rclient, pool_name)
    before = snapshot(rclient)
    try:
        r = raw(
            rclient, pool_name, "acquire", ticket, new_id(), amount, ttl, "5000", mode, "{}", "test"
        )
    except redis.ResponseError as e:
        assert str(e).split()[0] in ("GPULOCK_BADARG", "GPULOCK_CAPACITY", "GPULOCK_CONFLICT"), str(
            e
        )
        assert snapshot(rclient) == before
        return
    # Accepted: only when every argument was well-formed.
    assert (
        amount.isdigit()
        and 1 <= int(amount) <= CAP
        and ttl.isdigit()
        and 100 <= int(ttl) <= 86400000
    )
    assert int(r[0]) in (0, 1, 2)
    raw(rclient, pool_name, "cancel", ticket)  # withdraw it again


_POOLS: dict = {}


@settings(
    max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    amount=st.one_of(st.text(max_size=12), st.floats(allow_nan=True), st.integers(-5, 0)),
    ttl=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**6), 10**6)),
)
def test_python_edge_fuzz(make_pool, rclient, pool_name, amount, ttl):
    """Bad amounts/ttls at the Python edge: InvalidArgument (or a grant when both are valid),
    never another exception, and nothing left in Redis."""
    if not rclient.exists(f"gpulock:{{{pool_name}}}:cfg"):
        raw_configure(rclient, pool_name, CAP)
    key = (id(make_pool), rclient.connection_pool.connection_kwargs["port"])
    if key not in _POOLS:  # one pool per test run, not one per example
        _POOLS.clear()
        _POOLS[key] = make_pool(capacity=CAP)
    pool = _POOLS[key]
    before = snapshot(rclient)
    try:
        lease = pool.acquire(amount, ttl=ttl, timeout=0)
    except (InvalidArgument, CapacityExceeded):
        assert snapshot(rclient) == before
        return
    lease.release()
    assert snapshot(rclient, f"gpulock:{{{pool_name}}}:leases") == {}


@pytest.mark.parametrize("contended", [False, True], ids=["free", "full"])
async def test_a_non_callable_on_queued_is_refused_at_once(
    make_pool, make_apool, rclient, pool_name, contended
):
    """``on_queued`` runs only once a request queues: a bad one must be refused before
    anything is sent, the same whether the pool is free or full (it was a bare TypeError
    under contention, and accepted on a free pool), and it changes nothing."""
    p = make_pool(capacity=10)
    held = p.acquire(10) if contended else None
    before = snapshot(rclient)
    with pytest.raises(InvalidArgument, match="on_queued"):
        await asyncio.to_thread(p.acquire, 1, timeout=1, on_queued=5)
    ap = make_apool(capacity=10)
    with pytest.raises(InvalidArgument, match="on_queued"):
        await ap.acquire(1, timeout=1, on_queued="x")
    assert snapshot(rclient) == before
    if held is not None:
        held.release()
