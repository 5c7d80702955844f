"""Kept bytes against a real server, asyncio shell (docs/SEMANTICS.md, "Kept bytes"): an
AsyncPool made with ``keep=`` keeps a released lease while nobody waits and grants its own
next request of the same kind from it without a script call (same lease id, same fencing
token); a request that does not fit, of this pool object or of another (another client, a
subprocess: tests/integration/test_keep_sync.py), gets the kept bytes back at once; a lease
in use is given back at its release; idle kept leases go back after ``keep`` seconds and at
``aclose()``; request ids, resident leases, other settings and leases asked to yield are
never granted from kept bytes; bad ``keep`` values and bad ``release.lua`` modes are refused.

Every wait is on observed state (the server's cfg hash, the pool object's counters) with a
generous deadline; "no round trip" is the server's own count of script calls
(``INFO commandstats``). Run on every server kind (Redis 7 and the embedded Valkey)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gpulock import AcquireTimeout, AsyncPool, InvalidArgument, LeaseLost, Preemption
from gpulock.protocol.keys import pool_keys
from support.keep import (
    cfg_int,
    check_kept_list,
    kept_channels,
    kept_ids,
    script_calls,
    settings_known,
    status_kept,
)
from support.pools import check_consistent
from support.waiting import async_wait_until

pytestmark = pytest.mark.timeout(120)

CAP = 100
TTL = 60.0  # renewed every 20 s: no heartbeat call falls in the windows counted here
WAIT_S = 10.0  # a generous deadline for what must happen; never a bound on its speed


async def _kept_idle(pool: AsyncPool, amount: int, **kw) -> tuple[str, int]:
    """Acquire ``amount`` and release it with nobody waiting: the lease is kept. Returns its
    id and token."""
    lease = await pool.acquire(amount, ttl=kw.pop("ttl", TTL), **kw)
    lid, token = lease.id, lease.token
    await lease.release()
    assert pool._runtime.kept.counts()["idle"] >= 1
    return lid, token


async def test_a_release_with_nobody_waiting_keeps_the_lease(make_apool, rclient, pool_name):
    pool = make_apool(keep=30)
    await pool.configure(CAP)
    await pool.status()  # the pool's settings read now, not in the background later
    lease = await pool.acquire(10, ttl=TTL)
    lid, token = lease.id, lease.token
    await lease.release()
    # the server keeps it for this pool object: used unchanged, listed with its channel
    assert cfg_int(rclient, pool_name, "used") == 10
    assert kept_ids(rclient, pool_name) == [lid]
    assert kept_channels(rclient, pool_name) == [pool._runtime.channel_id]
    assert cfg_int(rclient, pool_name, "k_kept") == 1
    assert status_kept(rclient, pool_name) == (10, 1, 1, 0)
    counts = pool._runtime.kept.counts()
    assert (counts["idle"], counts["idle_bytes"], counts["kept"]) == (1, 10, 1)
    with pytest.raises(LeaseLost):
        lease.ensure_valid()  # the released object stays released
    # the same request again: granted from the kept lease, no script call
    assert settings_known(pool._runtime)
    before = script_calls(rclient)
    again = await pool.acquire(10, ttl=TTL)
    assert script_calls(rclient) == before
    assert (again.id, again.token) == (lid, token)
    again.ensure_valid()
    assert pool._runtime.kept.counts()["idle"] == 0
    await again.release()  # put back: no call either
    assert script_calls(rclient) == before
    counts = pool._runtime.kept.counts()
    assert (counts["idle"], counts["grants"], counts["kept"]) == (1, 1, 1)
    # a context manager and a size string of the same bytes use it too
    async with pool.lease("10B", ttl=TTL) as third:
        assert (third.id, third.token) == (lid, token)
    assert script_calls(rclient) == before
    assert pool._runtime.kept.counts()["grants"] == 2
    st = await pool.status()
    assert st.used == 10 and [x.lease_id for x in st.leases] == [lid]
    check_consistent(rclient, pool_name)
    check_kept_list(rclient, pool_name)


async def test_without_keep_a_release_releases(make_apool, rclient, pool_name):
    pool = make_apool(capacity=CAP)
    lease = await pool.acquire(10, ttl=TTL)
    await lease.release()
    assert cfg_int(rclient, pool_name, "used") == 0
    assert kept_ids(rclient, pool_name) == [] and cfg_int(rclient, pool_name, "k_kept") == 0
    assert pool._runtime.kept.counts()["idle"] == 0


async def test_a_request_of_the_same_process_that_does_not_fit_gets_them_back(
    make_apool, rclient, pool_name
):
    pool = make_apool(capacity=CAP, keep=30)
    lid, _ = await _kept_idle(pool, 60)
    other = await pool.acquire(50, ttl=TTL, timeout=WAIT_S)  # 60 + 50 > 100
    assert other.id != lid
    assert cfg_int(rclient, pool_name, "used") == 50
    assert kept_ids(rclient, pool_name) == []
    assert pool._runtime.kept.counts()["given_back"] == 1
    await other.release()  # nobody waits: kept in turn
    assert kept_ids(rclient, pool_name) == [other.id]
    check_consistent(rclient, pool_name)


async def test_a_request_of_another_pool_object_gets_idle_kept_bytes_at_once(
    make_apool, rclient, pool_name
):
    """The holder does nothing after its release: the waiter's acquire tells it (a 'k'
    message) and its runtime gives the bytes back, long before its next renewal (20 s) or
    its keep time (an hour)."""
    holder = make_apool(capacity=CAP, keep=3600)
    waiter = make_apool()
    lid, token = await _kept_idle(holder, 60)
    got = await waiter.acquire(50, ttl=TTL, timeout=WAIT_S)
    assert cfg_int(rclient, pool_name, "k_told") >= 1
    counts = holder._runtime.kept.counts()
    assert (counts["idle"], counts["given_back"], counts["draining"]) == (0, 1, True)
    assert got.token > token
    st = await waiter.status()
    assert st.used == 50 and [x.lease_id for x in st.leases] == [got.id]
    # the waiter keeps nothing (keep off): its release ends its lease
    await got.release()
    assert cfg_int(rclient, pool_name, "used") == 0
    # the holder keeps again once a release finds nobody waiting
    lid2, _ = await _kept_idle(holder, 60)
    assert kept_ids(rclient, pool_name) == [lid2] and lid2 != lid
    assert holder._runtime.kept.counts()["draining"] is False
    check_consistent(rclient, pool_name)


async def test_a_kept_lease_in_use_goes_back_at_its_release(make_apool, rclient, pool_name):
    holder = make_apool(capacity=CAP, keep=30)
    waiter = make_apool()
    lid, token = await _kept_idle(holder, 60)
    in_use = await holder.acquire(60, ttl=TTL)  # from the kept lease
    assert (in_use.id, in_use.token) == (lid, token)
    task = asyncio.create_task(waiter.acquire(50, ttl=TTL, timeout=60))
    # the waiter queues and the holder is told; the lease in use stays held
    await async_wait_until(
        lambda: holder._runtime.kept.counts()["draining"], WAIT_S, "the holder told"
    )
    st = await waiter.status()
    assert st.waiter_count == 1 and st.used == 60
    assert not task.done()
    in_use.ensure_valid()
    before = script_calls(rclient)
    await in_use.release()  # to Redis: the waiter is handed the bytes
    assert script_calls(rclient) > before
    got = await asyncio.wait_for(task, WAIT_S)
    assert got.token > token
    assert kept_ids(rclient, pool_name) == []
    assert cfg_int(rclient, pool_name, "used") == 50
    await got.release()
    # keeping resumes: the holder's next release finds nobody waiting
    lease = await holder.acquire(60, ttl=TTL)
    assert lease.id != lid
    await lease.release()
    assert kept_ids(rclient, pool_name) == [lease.id]
    counts = holder._runtime.kept.counts()
    assert (counts["idle"], counts["kept"], counts["draining"]) == (1, 2, False)
    check_consistent(rclient, pool_name)


async def test_a_refused_try_tells_the_holder_and_a_retry_succeeds(make_apool, rclient, pool_name):
    holder = make_apool(capacity=CAP, keep=3600)
    other = make_apool()
    await _kept_idle(holder, 60)
    with pytest.raises(AcquireTimeout):
        await other.acquire(50, ttl=TTL, timeout=0)
    assert cfg_int(rclient, pool_name, "k_told") == 1
    got: list = []

    async def tried() -> None:
        try:
            got.append(await other.acquire(50, ttl=TTL, timeout=0))
        except AcquireTimeout:
            pass

    loop_end = asyncio.get_running_loop().time() + WAIT_S
    while not got:
        assert asyncio.get_running_loop().time() < loop_end, "no try succeeded"
        await tried()
        if not got:
            await asyncio.sleep(0.01)
    assert holder._runtime.kept.counts()["given_back"] == 1
    assert cfg_int(rclient, pool_name, "used") == 50
    await got[0].release()
    check_consistent(rclient, pool_name)


async def test_a_growth_that_queues_behind_kept_bytes_gets_them(make_apool, rclient, pool_name):
    holder = make_apool(capacity=CAP, keep=3600)
    other = make_apool(capacity=CAP)
    lease = await other.acquire(30, ttl=TTL)
    await _kept_idle(holder, 60)
    await lease.resize(70, timeout=WAIT_S)  # 30 + 60 + 40 > 100: queues, the holder is told
    assert lease.amount == 70
    assert cfg_int(rclient, pool_name, "used") == 70
    assert cfg_int(rclient, pool_name, "k_told") >= 1
    assert holder._runtime.kept.counts()["given_back"] == 1
    await lease.release()
    check_consistent(rclient, pool_name)


async def test_a_try_growth_gets_the_own_idle_kept_bytes_back_first(make_apool, rclient, pool_name):
    """A growth of a lease of the keeping pool object itself: its idle kept leases go back
    before it asks Redis, so a try that fits only without them is granted (as without keep);
    a shrink gives nothing back."""
    pool = make_apool(capacity=CAP, keep=3600)
    lease = await pool.acquire(30, ttl=TTL)
    await _kept_idle(pool, 40)
    await lease.resize(20, timeout=0)  # a shrink: the kept lease stays
    assert pool._runtime.kept.counts()["idle"] == 1
    await _kept_idle(pool, 40)  # the same kept lease, put back
    await lease.resize(70, timeout=0)  # 20 + 40 + 50 > 100 while it is kept
    assert lease.amount == 70 and cfg_int(rclient, pool_name, "used") == 70
    assert kept_ids(rclient, pool_name) == []
    assert pool._runtime.kept.counts()["given_back"] == 1
    await lease.release()
    check_consistent(rclient, pool_name)


async def test_idle_kept_leases_go_back_after_keep_seconds(make_apool, rclient, pool_name):
    pool = make_apool(capacity=CAP, keep=0.5)
    await _kept_idle(pool, 10, ttl=1.5)
    await async_wait_until(
        lambda: cfg_int(rclient, pool_name, "used") == 0, WAIT_S, "the kept lease given back"
    )
    assert kept_ids(rclient, pool_name) == []
    counts = pool._runtime.kept.counts()
    assert (counts["idle"], counts["given_back"]) == (0, 1)
    # a kept lease given back is not taken again: the next request asks Redis
    before = script_calls(rclient)
    lease = await pool.acquire(10, ttl=1.5)
    assert script_calls(rclient) > before
    await lease.release()


async def test_aclose_gives_back_idle_kept_leases(redis_proc, rclient, pool_name):
    client = aioredis.Redis.from_url(redis_proc.url)
    pool = AsyncPool(client, pool_name, capacity=CAP, keep=3600)
    try:
        a = await pool.acquire(10, ttl=TTL)
        b = await pool.acquire(20, ttl=TTL)
        await a.release()
        await b.release()  # both kept: two idle kept leases
        assert pool._runtime.kept.counts()["idle"] == 2
        held = await pool.acquire(20, ttl=TTL)  # taken from the second: held, not idle
        assert held.id == b.id
        assert cfg_int(rclient, pool_name, "used") == 30
    finally:
        await pool.aclose()
        await client.aclose()
    # the idle one went back at once; the held one expires as any held lease
    assert cfg_int(rclient, pool_name, "used") == 20
    check_consistent(rclient, pool_name)


async def test_aclose_from_url_gives_back(redis_proc, rclient, pool_name):
    async with AsyncPool.from_url(redis_proc.url, pool_name, capacity=CAP, keep=30) as pool:
        await _kept_idle(pool, 10)
        assert cfg_int(rclient, pool_name, "used") == 10
    assert cfg_int(rclient, pool_name, "used") == 0
    assert kept_ids(rclient, pool_name) == []


async def test_request_ids_and_resident_leases_are_never_kept(make_apool, rclient, pool_name):
    pool = make_apool(capacity=CAP, keep=30)
    lease = await pool.acquire(10, ttl=TTL, request_id="job-1")
    await lease.release()
    lease = await pool.acquire(10, ttl=TTL, resident=True)
    await lease.release()
    assert cfg_int(rclient, pool_name, "used") == 0
    assert kept_ids(rclient, pool_name) == [] and cfg_int(rclient, pool_name, "k_kept") == 0
    # a kept lease is not granted to a request id's or a resident request: it goes back
    # first, so that a try which fits only without it is granted (as without keep)
    lid, _ = await _kept_idle(pool, 60)
    for kw in ({"request_id": "job-2"}, {"resident": True}):
        got = await pool.acquire(50, ttl=TTL, timeout=0, **kw)
        assert got.id != lid
        assert kept_ids(rclient, pool_name) == []
        assert cfg_int(rclient, pool_name, "used") == 50
        await got.release()
        assert cfg_int(rclient, pool_name, "used") == 0
        lid, _ = await _kept_idle(pool, 60)
    check_consistent(rclient, pool_name)


@pytest.mark.parametrize(
    "kw",
    [
        {"priority": 1},
        {"tenant": "team-a"},
        {"ttl": TTL - 1},
        {"preemptible": False},
    ],
    ids=["priority", "tenant", "ttl", "preemptible"],
)
async def test_other_settings_do_not_reuse_a_kept_lease(make_apool, rclient, pool_name, kw):
    pool = make_apool(capacity=CAP, keep=30)
    lid, token = await _kept_idle(pool, 10)
    got = await pool.acquire(10, **{"ttl": TTL, **kw})
    assert got.id != lid and got.token > token
    assert cfg_int(rclient, pool_name, "used") == 10  # the kept one went back first
    assert pool._runtime.kept.counts()["given_back"] == 1
    await got.release()  # kept in turn, with its own settings
    assert kept_ids(rclient, pool_name) == [got.id]
    again = await pool.acquire(10, **{"ttl": TTL, **kw})
    assert (again.id, again.token) == (got.id, got.token)
    await again.release()
    check_consistent(rclient, pool_name)


async def test_device_pins_on_a_pool_of_two_devices(make_apool, rclient, pool_name):
    pool = make_apool(keep=30)
    await pool.configure(10, devices=2)
    await pool.status()  # the pool's settings read now, not in the background later
    first = await pool.acquire(6, ttl=TTL, device=1)
    lid = first.id
    await first.release()
    assert kept_ids(rclient, pool_name) == [lid]
    assert settings_known(pool._runtime)
    before = script_calls(rclient)
    same = await pool.acquire(6, ttl=TTL, device=1)  # pinned to its device
    assert (same.id, same.device) == (lid, 1)
    await same.release()
    anyd = await pool.acquire(6, ttl=TTL)  # any device: takes it too
    assert (anyd.id, anyd.device) == (lid, 1)
    await anyd.release()
    assert script_calls(rclient) == before
    # pinned elsewhere: the kept one goes back first, then Redis places it on device 0
    other = await pool.acquire(6, ttl=TTL, device=0)
    assert other.id != lid and other.device == 0
    st = await pool.status()
    assert [(d.index, d.used) for d in st.devices] == [(0, 6), (1, 0)]
    await other.release()
    assert kept_ids(rclient, pool_name) == [other.id]
    # a pin to the other device, of a kept lease's settings, does not take it either
    onto1 = await pool.acquire(6, ttl=TTL, device=1, timeout=0)
    assert onto1.id != other.id and onto1.device == 1
    assert [d.used for d in (await pool.status()).devices] == [0, 6]
    await onto1.release()
    check_consistent(rclient, pool_name)


@pytest.mark.parametrize("bad", [-1, "x", 10**9, float("nan"), 0.01])
async def test_bad_keep_is_refused_naming_it(redis_proc, bad):
    client = aioredis.Redis.from_url(redis_proc.url)
    try:
        with pytest.raises(InvalidArgument, match="keep"):
            AsyncPool(client, "bk", keep=bad)
        with pytest.raises(InvalidArgument, match="keep"):
            AsyncPool.from_url(redis_proc.url, "bk", keep=bad)
    finally:
        await client.aclose()


async def test_a_lease_asked_to_yield_is_not_kept(make_apool, rclient, pool_name):
    """The asker gives up after the ask (its ask stands): the holder's release finds nobody
    waiting, yet the lease asked to yield ends."""
    holder = make_apool(capacity=CAP, keep=30)
    asker = make_apool()
    await holder.configure(CAP, preemption=Preemption(1, 30.0))
    lease = await holder.acquire(80, ttl=TTL, priority=0)
    task = asyncio.create_task(asker.acquire(50, ttl=TTL, priority=5, timeout=60))
    await async_wait_until(lambda: lease.yield_requested, WAIT_S, "the holder asked")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await async_wait_until(
        lambda: (
            cfg_int(rclient, pool_name, "used") == 80
            and rclient.zcard(pool_keys(pool_name)[3]) == 0
        ),
        WAIT_S,
        "the asker gone",
    )
    await lease.release()
    assert cfg_int(rclient, pool_name, "used") == 0
    assert kept_ids(rclient, pool_name) == [] and cfg_int(rclient, pool_name, "k_kept") == 0
    assert holder._runtime.kept.counts()["idle"] == 0
    check_consistent(rclient, pool_name)
