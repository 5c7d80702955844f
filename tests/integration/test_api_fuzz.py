"""Every user input at the Python API edge, fuzzed (issue 5 item 6): pool names, amounts,
ttls, timeouts, holder metadata, request ids, the pool object's settings, configure's
arguments, and the remote-holder methods the HTTP broker uses (lease ids, tokens).

For each input: the call either works or raises a GpuLockError subclass — never another
exception type; a refusal changes nothing in Redis (every gpulock key compared before and
after); and no key outside the ``gpulock:`` prefix is ever written (SCAN after each example).
The HTTP edge is fuzzed by tests/broker/.
"""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpulock import (
    AcquireTimeout,
    AsyncPool,
    CapacityExceeded,
    GpuLockError,
    InvalidArgument,
    Pool,
    PoolNotFound,
)
from gpulock_common.options import AcquireOptions

from gpulock.protocol.args import new_id
from gpulock.runtime.remote import RemoteHolders
from support.servers import RedisProcess
from support.pools import check_consistent, raw, raw_acquire, raw_configure, snapshot


pytestmark = pytest.mark.timeout(300)

CAP = 1 << 30
TEXT = st.text(max_size=70)
ANY_SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
    st.binary(max_size=12),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(TEXT, st.integers(), max_size=2),
)
NAMES = st.one_of(
    TEXT,
    st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True),
    st.sampled_from(
        [
            "base",
            "capped",
            "capped",
            "gpu0",
            "a{b}",
            "{x}",
            "a:b",
            "x" * 65,
            "",
            " gpu",
            "gpu\n",
            "ünï",
        ]
    ),
)
AMOUNTS = st.one_of(
    ANY_SCALAR,
    st.integers(-5, 2 * CAP),
    st.sampled_from(
        [
            "1",
            "1GiB",
            "0.5GiB",
            "100MB",
            "1e3",
            " 5 ",
            "5B",
            "-1KiB",
            "1 KiB",
            "1.5",
            "0x10",
            "9" * 30,
            "1TiB",
            "nan",
        ]
    ),
)
SECONDS = st.one_of(
    ANY_SCALAR,
    st.floats(0, 100),
    st.integers(50, 90_000),
    st.sampled_from(["1", "1.5", "10s", "-1", "inf", "nan", "1e9", 61, 86400]),
)
TIMEOUTS = st.one_of(
    st.sampled_from([0, 0.0, 0.01, -1, float("nan"), float("inf"), "0", "x", True, 1e10, [0]]),
    st.floats(-1, 0.02),
    TEXT,
)
METAS = st.one_of(
    st.none(),
    TEXT,
    st.integers(),
    st.lists(TEXT, max_size=2),
    st.dictionaries(
        st.one_of(TEXT, st.integers(), st.none()),
        st.recursive(
            st.one_of(
                st.none(),
                st.booleans(),
                st.floats(allow_nan=True),
                st.integers(),
                TEXT,
                st.binary(max_size=8),
            ),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3),
            max_leaves=8,
        ),
        max_size=6,
    ),
)
RIDS = st.one_of(
    st.none(), TEXT, st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True), ANY_SCALAR
)

EXPECTED = (InvalidArgument, CapacityExceeded, PoolNotFound, AcquireTimeout)


@pytest.fixture(scope="module")
def fz():
    """One server for the whole module (hypothesis runs many examples per test), with a pool
    "base" that has a holder and two waiters whose expiries are far away (nothing moves by
    itself, so a refusal can be checked against a byte-for-byte snapshot)."""
    with RedisProcess() as rp:
        c = redis.Redis.from_url(rp.url)
        raw_configure(c, "base", CAP)
        raw_acquire(c, "base", CAP - 100, ticket="holder", ttl_ms=3_600_000)
        raw_acquire(c, "base", CAP // 2, ticket="w1", ttl_ms=3_600_000, waiter_ttl_ms=3_600_000)
        raw_acquire(c, "base", 50, ticket="w2", ttl_ms=3_600_000, waiter_ttl_ms=3_600_000)
        raw(c, "capped", "configure", CAP, 1000, "create", 60_000)  # leases of at most 60 s
        yield rp, c
        c.close()


def _outside_prefix(c: redis.Redis) -> list[bytes]:
    return [k for k in c.scan_iter(count=1000) if not k.startswith(b"gpulock:")]


@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=NAMES,
    capacity=st.one_of(st.none(), AMOUNTS),
    amount=AMOUNTS,
    ttl=SECONDS,
    timeout=TIMEOUTS,
    holder=METAS,
    request_id=RIDS,
)
@example(
    name="capped", capacity=None, amount=1, ttl=61, timeout=0, holder=None, request_id=None
)  # refused in Lua
@example(
    name="base",
    capacity=None,
    amount=1,
    ttl=1,
    timeout=0.01,
    holder={"k": [1, None]},
    request_id="r-1",
)
def test_acquire_edge(fz, name, capacity, amount, ttl, timeout, holder, request_id):
    rp, c = fz
    before = snapshot(c)
    try:
        pool = Pool(c, name, capacity=capacity, default_ttl=5, max_ttl=3600)
    except GpuLockError as e:
        assert isinstance(e, InvalidArgument), repr(e)
        assert snapshot(c) == before
        return
    try:
        lease = pool.acquire(amount, ttl=ttl, timeout=timeout, holder=holder, request_id=request_id)
    except GpuLockError as e:
        assert isinstance(e, EXPECTED), repr(e)
        if isinstance(e, AcquireTimeout):  # it may have queued for a moment: nothing is left
            check_consistent(c, name)
            assert c.zcard(f"gpulock:{{{name}}}:queue") == (2 if name == "base" else 0)
        else:
            assert snapshot(c) == before, f"refused with {e!r} but Redis changed"
    else:
        assert isinstance(lease.token, int) and lease.amount >= 1
        lease.release()
    finally:
        pool.close()
    assert not _outside_prefix(c)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    capacity=AMOUNTS,
    max_waiters=st.one_of(ANY_SCALAR, st.integers(-2, 2_000_000)),
    max_ttl=SECONDS,
    default_ttl=SECONDS,
    sync_replicas=ANY_SCALAR,
    create_only=st.booleans(),
)
def test_configure_and_settings_edge(
    fz, capacity, max_waiters, max_ttl, default_ttl, sync_replicas, create_only
):
    rp, c = fz
    before = snapshot(c)
    try:
        pool = Pool(
            c,
            "scratch",
            default_ttl=default_ttl if default_ttl is not None else 5,
            sync_replicas=sync_replicas if sync_replicas is not None else 0,
        )
    except GpuLockError as e:
        assert isinstance(e, InvalidArgument), repr(e)
        assert snapshot(c) == before
        return
    try:
        pool.configure(capacity, max_waiters=max_waiters, max_ttl=max_ttl, create_only=create_only)
    except GpuLockError as e:
        assert isinstance(e, InvalidArgument), repr(e)
        assert snapshot(c) == before, f"refused with {e!r} but Redis changed"
    finally:
        pool.close()
    assert not _outside_prefix(c)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    lease_id=st.one_of(TEXT, st.sampled_from([new_id(), "0" * 32, "g" * 32])),
    token=ANY_SCALAR,
    ttl=SECONDS,
    request_id=RIDS,
    amount=AMOUNTS,
)
def test_remote_methods_edge(fz, lease_id, token, ttl, request_id, amount):
    """The methods a proxy (the HTTP broker) calls for remote holders take lease ids and
    tokens from outside."""
    rp, c = fz
    before = snapshot(c)

    async def go() -> None:
        client = aioredis.Redis.from_url(rp.url)
        pool = AsyncPool(client, "base")
        p = RemoteHolders(pool)
        try:
            for call in (
                lambda: p.renew(lease_id, token, ttl),
                lambda: p.release(lease_id, token),
                lambda: p.cancel(request_id),
                lambda: p.wait(request_id, 0.0),
            ):
                try:
                    await call()
                except GpuLockError as e:
                    assert (
                        isinstance(e, (InvalidArgument, *EXPECTED))
                        or type(e).__name__ == "LeaseLost"
                    ), repr(e)
            try:  # try-mode: never queues, so nothing is left behind either way
                rid = request_id if isinstance(request_id, str) else new_id()
                res = await p.enqueue(amount, AcquireOptions(ttl=ttl, request_id=rid), queue=False)
            except GpuLockError as e:
                assert isinstance(e, EXPECTED), repr(e)
            else:
                if getattr(res, "lease_id", None):
                    await p.release(res.lease_id, res.token)
        finally:
            await pool.aclose()
            await client.aclose()

    asyncio.run(go())
    # The holder, the waiters and the counters are untouched (a refused call wrote nothing,
    # and a try-mode grant was released again).
    after = snapshot(c)
    for k in (
        "gpulock:{base}:holders",
        "gpulock:{base}:queue",
        "gpulock:{base}:waiters",
        "gpulock:{base}:wexp",
    ):
        assert after.get(k) == before.get(k), k
    assert not _outside_prefix(c)


def test_fuzz_left_the_base_pool_as_it_was(fz):
    rp, c = fz
    counts = check_consistent(c, "base")
    assert counts == {"used": CAP - 100, "leases": 1, "queued": 2}
    assert not _outside_prefix(c)
