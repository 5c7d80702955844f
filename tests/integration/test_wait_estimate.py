"""The wait estimate against a real server (docs/SEMANTICS.md, "Wait estimate"): the drain rate
is unmeasured on a fresh pool and after Redis lost its data, measured once a queue drained;
every waiter's estimate (status, on_queued's QueuePlace at queueing and at a refresh that moved
it, a remote holder's NotGranted queued or not) follows the one rule of gpulock.estimates.wait.

Bounds come from lower bounds on time only (each holder keeps its lease at least a known time
before it releases), never from how fast the machine is: the measured rate is at most the
bytes of a grant over the shortest hold, and its bytes-to-grants ratio is the one amount every
grant had. Run on every server kind (Redis 7 and the embedded Valkey)."""

from __future__ import annotations

import asyncio
import time

import pytest
from gpulock_common.options import AcquireOptions
from gpulock_common.queue import QueuePlace

from gpulock.estimates import wait_seconds, wait_seconds_at_tail
from gpulock.protocol.replies import NotGranted
from gpulock.runtime.remote import RemoteHolders
from support.waiting import async_wait_until

pytestmark = pytest.mark.timeout(300)

UNIT = 1000  # bytes of every lease here; the pool holds one at a time
FIRST_HOLD = 0.3  # seconds the first holder keeps its lease after the queue formed
HOLD = 0.1  # seconds each waiter keeps its lease after its grant


async def _queue(pool, n: int, places: list[list[QueuePlace]]) -> list[asyncio.Task]:
    """Queue ``n`` acquires of UNIT bytes, each only after the previous one queued (so their
    order is known); each keeps its lease HOLD seconds, then releases it. ``places[i]``
    collects what the i-th one's on_queued received."""
    tasks = []
    for _ in range(n):
        got: list[QueuePlace] = []
        places.append(got)

        async def one(got=got):
            lease = await pool.acquire(UNIT, timeout=120, on_queued=got.append)
            await asyncio.sleep(HOLD)
            await lease.release()

        tasks.append(asyncio.create_task(one()))
        await async_wait_until(lambda got=got: got, 60, "the acquire to queue")
    return tasks


async def _drain(pool, n: int = 4) -> list[list[QueuePlace]]:
    """A queue of ``n`` waiters behind a holder, drained: the holder releases FIRST_HOLD
    seconds after the last one queued, each waiter HOLD seconds after its grant."""
    holder = await pool.acquire(UNIT)
    places: list[list[QueuePlace]] = []
    tasks = await _queue(pool, n, places)
    await asyncio.sleep(FIRST_HOLD)  # a lower bound on the busy time, not a wait for state
    await holder.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 240)
    return places


async def test_unmeasured_then_measured(make_apool):
    pool = make_apool(capacity=UNIT, poll_interval=0.2)
    for _ in range(3):  # grants without a queue say nothing of how fast one drains
        await (await pool.acquire(UNIT)).release()
    st = await pool.status()
    assert st.drain is None and st.estimated_wait_for(UNIT) is None

    places = await _drain(pool)
    # queued on a fresh pool: positions and lengths, no estimate yet
    firsts = [p[0] for p in places]
    assert [int(p) for p in firsts] == [1, 2, 3, 4]
    assert [p.queue_length for p in firsts] == [1, 2, 3, 4]
    assert all(isinstance(p, QueuePlace) and p.estimated_wait is None for p in firsts)

    st = await pool.status()
    d = st.drain
    assert d is not None
    # each queued grant was of UNIT bytes after at least HOLD seconds of busy time
    assert 0 < d.bytes_per_s <= UNIT / HOLD * 1.01
    assert 0 < d.grants_per_s <= 1 / HOLD * 1.01
    assert d.bytes_per_s / d.grants_per_s == pytest.approx(UNIT, rel=0.01)


async def test_every_waiter_gets_the_one_rule(make_apool):
    pool = make_apool(capacity=UNIT, poll_interval=0.2)
    await _drain(pool)
    holder = await pool.acquire(UNIT)  # uncontended: the rate does not change
    drain = (await pool.status()).drain
    assert drain is not None
    places: list[list[QueuePlace]] = []
    tasks = await _queue(pool, 3, places)

    st = await pool.status()
    assert st.drain == drain
    assert [w.ahead_bytes for w in st.waiters] == [0, UNIT, 2 * UNIT]
    for i, w in enumerate(st.waiters):
        want = wait_seconds(
            ahead_bytes=i * UNIT, amount=UNIT, free_bytes=0, position=i + 1, rate=drain
        )
        assert want is not None and want > 0
        assert w.estimated_wait == pytest.approx(want)
        assert places[i][0].estimated_wait == pytest.approx(want)  # as acquire answered it
        assert places[i][0].queue_length == i + 1
    ests = [w.estimated_wait for w in st.waiters]
    assert ests == sorted(ests)
    assert st.estimated_wait_for(UNIT) == pytest.approx(
        wait_seconds_at_tail(
            queued_bytes=3 * UNIT, queue_length=3, amount=UNIT, free_bytes=0, rate=drain
        )
    )

    # a remote holder's request: not queued (try), then queued, each with its estimate
    rh = RemoteHolders(pool)
    res = await rh.enqueue(UNIT // 2, AcquireOptions(request_id="probe-try"), queue=False)
    assert isinstance(res, NotGranted) and not res.queued
    assert res.ahead_bytes == 3 * UNIT and res.drain == drain
    assert res.estimated_wait == pytest.approx(
        wait_seconds_at_tail(
            queued_bytes=3 * UNIT, queue_length=3, amount=UNIT // 2, free_bytes=0, rate=drain
        )
    )
    res = await rh.enqueue(UNIT // 2, AcquireOptions(request_id="probe-wait"))
    assert isinstance(res, NotGranted) and res.queued and res.position == 4
    assert res.ahead_bytes == 3 * UNIT
    assert res.estimated_wait == pytest.approx(
        wait_seconds(ahead_bytes=3 * UNIT, amount=UNIT // 2, free_bytes=0, position=4, rate=drain)
    )
    assert res.place.estimated_wait == res.estimated_wait and res.place == 4
    await rh.cancel("probe-wait")

    # the head leaves: a refresh moves the second waiter to the head, on_queued says so
    tasks[0].cancel()
    await async_wait_until(lambda: len(places[1]) > 1, 60, "the refresh to move waiter 2")
    moved = places[1][-1]
    assert int(moved) == 1 and moved.queue_length == 2
    assert moved.estimated_wait == pytest.approx(
        wait_seconds(ahead_bytes=0, amount=UNIT, free_bytes=0, position=1, rate=drain)
    )
    await holder.release()
    await asyncio.wait_for(asyncio.gather(*tasks[1:]), 240)


async def test_unmeasured_after_redis_lost_its_data(make_apool, rclient, pool_name):
    pool = make_apool(capacity=UNIT, poll_interval=0.2)
    await _drain(pool, 2)
    assert (await pool.status()).drain is not None
    rclient.flushall()
    again = make_apool(capacity=UNIT)  # makes the pool again
    await again.acquire(1)
    assert (await again.status()).drain is None


async def test_bytes_ahead_exact_near_the_head_then_extrapolated(make_apool):
    """acquire's reply sums the amounts of the first 32 waiters ahead (lib.lua AHEAD_DEPTH);
    beyond them each waiter counts as their mean amount."""
    import math

    pool = make_apool(capacity=UNIT)
    holder = await pool.acquire(UNIT)
    rh = RemoteHolders(pool)
    amounts = [i + 1 for i in range(40)]

    def ahead(k: int) -> int:
        return sum(amounts[:k]) if k <= 32 else math.floor(sum(amounts[:32]) / 32 * k)

    for k, a in enumerate(amounts):
        res = await rh.enqueue(a, AcquireOptions(request_id=f"r{k}"))
        assert isinstance(res, NotGranted) and res.position == k + 1
        assert res.ahead_bytes == ahead(k), k
    probe = await rh.enqueue(1, AcquireOptions(request_id="probe"), queue=False)
    assert isinstance(probe, NotGranted) and probe.ahead_bytes == ahead(40)
    for k in range(len(amounts)):
        await rh.cancel(f"r{k}")
    await holder.release()


async def test_a_grace_period_is_not_counted_as_busy_time(make_apool, rclient):
    """After Redis lost the pool's data the pool is made again with a grace period in which
    nothing is granted: a waiter queued then waits for the grace period to end, not for the
    queue to drain, so that time is no busy time of the drain rate (else the first grant after
    a restart measures one grant per grace period, and every estimate after it is about that
    long). Bound from time only: the grace period began after ``t0`` (the acquire that made
    the pool again) and the grant came before ``t1``, so at most ``t1 - t0 - grace`` seconds
    of busy time may be counted for it."""
    grace = 3.0  # seconds: the pool's max_ttl, the length of its grace period
    pool = make_apool(capacity=UNIT, max_ttl=grace, default_ttl=1.0, poll_interval=0.2)
    await (await pool.acquire(UNIT)).release()  # the pool exists; this object knows it
    rclient.flushall()
    t0 = time.monotonic()
    lease = await pool.acquire(UNIT, timeout=60)  # makes the pool again, with the grace period
    t1 = time.monotonic()
    assert t1 - t0 >= grace  # it waited for the grace period
    st = await pool.status()
    assert st.grace_left == 0
    if st.drain is not None:  # unmeasured (under 200 ms of busy time) is right too
        assert 1 / st.drain.grants_per_s <= (t1 - t0 - grace) * 1.01 + 0.01, (st.drain, t1 - t0)
    await lease.release()


async def test_busy_time_counts_from_when_the_queue_went_busy(make_apool):
    """A waiter that gave up still kept the queue busy while it waited: the busy time of a
    grant counts from when the queue went from empty to not empty (lib.lua ``dr_q``), not from
    the granted waiter's own enqueue (which read the rate too fast exactly when requests time
    out). Waiter A queues and gives up (cancelled) once B has queued, 0.3 s later; the holder
    releases at least 1.3 s after ``t0``, a time A was seen queued (so its place was on the
    server before); B's grant is the pool's only queued grant, so the busy time counted is at
    least 1.3 s (from A's enqueue; B's own would give about 1 s). Only lower bounds on time:
    each sleep is at least its length. (A gave up on a 0.5 s timeout before, and ``t0`` was
    taken before it queued: a loaded run counted 1.297 s.)"""
    pool = make_apool(capacity=UNIT)
    holder = await pool.acquire(UNIT)
    gave_up = asyncio.create_task(pool.acquire(UNIT, timeout=120))
    await async_wait_until(lambda: pool.waiting == 1, 60, "A to queue")
    t0 = time.monotonic()  # A's place is on the server: the runtime counts it after the reply
    await asyncio.sleep(0.3)  # a lower bound, not a wait for state
    b_queued: list[QueuePlace] = []
    b = asyncio.create_task(pool.acquire(UNIT, timeout=120, on_queued=b_queued.append))
    await async_wait_until(lambda: b_queued, 60, "B to queue")
    gave_up.cancel()  # A leaves the queue (withdrawn before the cancellation propagates)
    with pytest.raises(asyncio.CancelledError):
        await gave_up
    await asyncio.sleep(max(0.0, t0 + 1.3 - time.monotonic()))  # a lower bound again
    await holder.release()
    lease = await asyncio.wait_for(b, 120)
    await lease.release()
    st = await pool.status()
    assert st.drain is not None
    assert 1 / st.drain.grants_per_s >= 1.3, st.drain
