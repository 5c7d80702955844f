"""Leases that resize (docs/SEMANTICS.md, "Resizing a lease"): a shrink hands its bytes on in
queue order; a growth is granted now or queues at its lease's place in the queue (ahead of the
new requests its lease's request was ahead of: under FIFO every new request queued; behind a
new request of higher effective priority), at its tenant and device; its timeout and
cancellation leave the lease at its old amount; an amount that can never fit is refused at
once; the deadlock rule refuses the last growth of a cycle; a stuck device's growths are
granted ahead of a higher-priority head; the lease keeps its id and token; after Redis lost
the pool the growth is queued again. Every step checks the pool's raw keys
(check_consistent)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gpulock import (
    AcquireTimeout,
    CapacityExceeded,
    InvalidArgument,
    LeaseLost,
    QuotaExceeded,
    ResizeRefused,
)
from support.pools import check_consistent, used
from support.waiting import async_wait_until, wait_until


def _queued(rclient, pool_name) -> int:
    return rclient.zcard(f"gpulock:{{{pool_name}}}:queue")


async def test_shrink_hands_bytes_to_waiters_in_queue_order(make_apool, rclient, pool_name):
    pool = make_apool(capacity=100)
    a = await pool.acquire(100)
    got: list[int] = []

    async def take(n):
        lease = await pool.acquire(n)
        got.append(n)
        return lease

    t1 = asyncio.create_task(take(30))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 1)
    t2 = asyncio.create_task(take(20))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 2)
    await a.resize(60)  # frees 40: the first (30) fits, the second (20) does not yet
    assert a.amount == 60
    l1 = await asyncio.wait_for(t1, 5)
    assert got == [30] and not t2.done()
    await a.resize(50)
    l2 = await asyncio.wait_for(t2, 5)
    assert got == [30, 20]
    assert used(rclient, pool_name) == 100
    check_consistent(rclient, pool_name)
    for x in (a, l1, l2):
        await x.release()
    assert used(rclient, pool_name) == 0


async def test_grow_now_keeps_id_and_token_and_shows_in_status(make_apool, rclient, pool_name):
    pool = make_apool(capacity=100)
    a = await pool.acquire(10)
    lid, tok = a.id, a.token
    await a.resize("40B")
    assert (a.amount, a.id, a.token) == (40, lid, tok)
    st = await pool.status()
    assert st.used == 40
    assert [h.amount for h in st.leases] == [40]
    await a.resize(40)  # the same amount: nothing to do
    assert a.amount == 40
    check_consistent(rclient, pool_name)
    await a.release()
    assert used(rclient, pool_name) == 0


async def test_grow_queued_granted_on_release_then_timeout_and_cancel(
    make_apool, rclient, pool_name
):
    pool = make_apool(capacity=100)
    a, b = await pool.acquire(50), await pool.acquire(50)
    t = asyncio.create_task(a.resize(70))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 1)
    assert a.amount == 50 and used(rclient, pool_name) == 100
    await b.release()
    await asyncio.wait_for(t, 5)
    assert a.amount == 70 and used(rclient, pool_name) == 70
    # timeout: the lease keeps its amount, the growth leaves the queue
    b = await pool.acquire(30)
    with pytest.raises(AcquireTimeout):
        await a.resize(90, timeout=0.2)
    assert a.amount == 70 and _queued(rclient, pool_name) == 0
    assert used(rclient, pool_name) == 100
    with pytest.raises(AcquireTimeout):
        await a.resize(90, timeout=0)
    # cancellation likewise
    t = asyncio.create_task(a.resize(90))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 1)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert _queued(rclient, pool_name) == 0
    assert a.amount == 70 and used(rclient, pool_name) == 100
    check_consistent(rclient, pool_name)
    await a.release()
    await b.release()
    assert used(rclient, pool_name) == 0


async def test_never_fits_and_lost_and_bad_input(make_apool, rclient, pool_name):
    pool = make_apool(capacity=100)
    a = await pool.acquire(10)
    with pytest.raises(CapacityExceeded):
        await a.resize(101)
    for bad in (0, -1, "lots"):
        with pytest.raises(InvalidArgument):
            await a.resize(bad)
    with pytest.raises(InvalidArgument):
        await a.resize(20, timeout=-1)
    assert a.amount == 10 and used(rclient, pool_name) == 10
    await a.release()
    with pytest.raises(LeaseLost):
        await a.resize(20)
    b = await pool.acquire(10, ttl=0.3)
    pool._runtime.untrack(b.id)  # no heartbeat: it expires on the server
    await async_wait_until(lambda: b.lost, 5)
    with pytest.raises(LeaseLost):
        await b.resize(5)
    assert used(rclient, pool_name) in (0, 10)  # expired, reaped by the next script
    check_consistent(rclient, pool_name)


async def test_quota_refuses_never_and_waits_for_the_tenant(make_apool, rclient, pool_name):
    pool = make_apool(capacity=100)
    await pool.configure(quotas={"t1": 50})
    a = await pool.acquire(20, tenant="t1")
    with pytest.raises(QuotaExceeded):
        await a.resize(60)
    b = await pool.acquire(30, tenant="t1")
    other = await pool.acquire(10)  # keeps the growth from being refused as a deadlock
    t = asyncio.create_task(a.resize(40))  # the tenant's quota: waits for b
    await async_wait_until(lambda: _queued(rclient, pool_name) == 1)
    await b.release()
    await asyncio.wait_for(t, 5)
    assert a.amount == 40
    check_consistent(rclient, pool_name)
    await a.release()
    await other.release()


async def test_deadlock_rule_refuses_the_second_growth(make_apool, rclient, pool_name):
    """Two holders of half each both grow: the first waits (the other may release), the
    second is refused at once (both waiting could never end); the first is granted when the
    second releases."""
    pool = make_apool(capacity=100)
    a, b = await pool.acquire(50), await pool.acquire(50)
    t = asyncio.create_task(a.resize(60))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 1)
    with pytest.raises(ResizeRefused) as ei:
        await b.resize(60)
    assert (ei.value.lease_id, ei.value.amount, ei.value.current) == (b.id, 60, 50)
    assert b.amount == 50 and not t.done()
    await b.release()
    await asyncio.wait_for(t, 5)
    assert a.amount == 60
    await a.resize(100)  # alone, with the bytes free: granted now
    assert a.amount == 100
    check_consistent(rclient, pool_name)
    await a.release()


def _queue(rclient, pool_name) -> list[str]:
    return [t.decode() for t in rclient.zrange(f"gpulock:{{{pool_name}}}:queue", 0, -1)]


@pytest.mark.parametrize("c_first", [True, False], ids=["c-first", "c-after"])
async def test_growth_behind_a_head_that_needs_its_bytes_is_granted_once_all_holders_grow(
    make_apool, rclient, pool_name, c_first
):
    """Capacity 100: A holds 60, B 40; C, at a higher priority than A's (50 against 0), waits
    for 50 (queued before A's growth, or arriving after it; either way ahead of it). A's growth
    by 10 queues behind C (B may free bytes: not refused). B releases: 40 free, C cannot be
    granted, and A, the only holder left, waits to grow, so nothing could ever free bytes for
    C: A's growth is granted ahead of C (docs/SEMANTICS.md, "Resizing a lease"). C is granted
    once A releases."""
    pool = make_apool(capacity=100)
    a, b = await pool.acquire(60), await pool.acquire(40)
    c = None
    if c_first:
        c = asyncio.create_task(pool.acquire(50, request_id="c", priority=50))
        await async_wait_until(lambda: _queued(rclient, pool_name) == 1)
    grow = asyncio.create_task(a.resize(70))
    await async_wait_until(lambda: f"grow:{a.id}" in _queue(rclient, pool_name))
    if c is None:
        c = asyncio.create_task(pool.acquire(50, request_id="c", priority=50))
        await async_wait_until(lambda: _queued(rclient, pool_name) == 2)
    assert _queue(rclient, pool_name) == ["c", f"grow:{a.id}"]  # C heads the queue
    assert a.amount == 60 and not grow.done()
    await b.release()
    await asyncio.wait_for(grow, 5)
    assert a.amount == 70 and used(rclient, pool_name) == 70
    assert _queue(rclient, pool_name) == ["c"] and not c.done()
    check_consistent(rclient, pool_name)
    await a.release()
    lc = await asyncio.wait_for(c, 5)
    assert lc.amount == 50 and used(rclient, pool_name) == 50
    check_consistent(rclient, pool_name)
    await lc.release()
    assert used(rclient, pool_name) == 0


async def test_a_growth_that_makes_every_holder_wait_grants_the_growths_that_fit(
    make_apool, rclient, pool_name
):
    """Capacity 100: A holds 50, B 30 (20 free); C, of a higher priority, waits for 50. A's
    growth by 10 queues behind C (B may free bytes). B's growth by 5 would leave every holder
    waiting to grow: the growths that fit are granted at once in queue order, A's (by the
    hand-off) and B's (in its own reply). With no byte free, a growth that would make every
    holder wait is still refused."""
    pool = make_apool(capacity=100)
    a, b = await pool.acquire(50), await pool.acquire(30)
    c = asyncio.create_task(pool.acquire(50, request_id="c", priority=50))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 1)
    grow_a = asyncio.create_task(a.resize(60))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 2)
    await b.resize(35)  # answered granted at once
    assert b.amount == 35
    await asyncio.wait_for(grow_a, 5)
    assert a.amount == 60 and used(rclient, pool_name) == 95
    assert _queue(rclient, pool_name) == ["c"]
    # 5 free: A's growth by 10 queues (B may free bytes); B's by 10 fits neither: refused
    grow_a = asyncio.create_task(a.resize(70))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 2)
    with pytest.raises(ResizeRefused):
        await b.resize(45)
    assert b.amount == 35 and _queue(rclient, pool_name) == ["c", f"grow:{a.id}"]
    check_consistent(rclient, pool_name)
    await b.release()  # 45 free, C cannot be granted, A alone waits to grow: granted
    await asyncio.wait_for(grow_a, 5)
    assert a.amount == 70 and _queue(rclient, pool_name) == ["c"]
    await a.release()
    lc = await asyncio.wait_for(c, 5)
    check_consistent(rclient, pool_name)
    await lc.release()
    assert used(rclient, pool_name) == 0


async def test_a_stuck_device_is_judged_by_its_own_leases(make_apool, rclient, pool_name):
    """Devices of 100 and 100. Device 0: A 60, B 40; device 1: X 90. C, of a higher priority,
    waits for 50 on device 0 (it heads the queue and blocks it). X's growth by 10 would queue
    behind C, and X is alone on device 1: granted in its own reply. A's growth by 10 queues (B
    may free bytes); when B releases, device 0 is stuck (A alone, waiting to grow) though X,
    on device 1, does not grow: A's growth is granted ahead of C."""
    pool = make_apool()
    await pool.configure(devices=[100, 100])
    a, b = await pool.acquire(60, device=0), await pool.acquire(40, device=0)
    x = await pool.acquire(90, device=1)
    c = asyncio.create_task(pool.acquire(50, device=0, request_id="c", priority=50))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 1)
    await x.resize(100)
    assert x.amount == 100 and _queue(rclient, pool_name) == ["c"]
    grow = asyncio.create_task(a.resize(70))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 2)
    await b.release()
    await asyncio.wait_for(grow, 5)
    assert a.amount == 70 and _queue(rclient, pool_name) == ["c"]
    check_consistent(rclient, pool_name)
    await a.release()
    lc = await asyncio.wait_for(c, 5)
    assert lc.device == 0
    for lease in (lc, x):
        await lease.release()
    assert used(rclient, pool_name) == 0


def test_sync_growth_behind_a_blocked_head(make_pool, rclient, pool_name):
    """The example of the async test above through ``Pool``: A's growth, queued behind C (of
    a higher priority), is granted when B releases; C after A releases."""
    pool = make_pool(capacity=100)
    a, b = pool.acquire(60), pool.acquire(40)
    got: list = []
    th_c = threading.Thread(
        target=lambda: got.append(pool.acquire(50, request_id="c", priority=50))
    )
    th_c.start()
    wait_until(lambda: _queued(rclient, pool_name) == 1)
    done: list[BaseException | None] = []

    def grow():
        try:
            a.resize(70)
            done.append(None)
        except BaseException as e:  # noqa: BLE001
            done.append(e)

    th = threading.Thread(target=grow)
    th.start()
    wait_until(lambda: _queued(rclient, pool_name) == 2)
    assert _queue(rclient, pool_name) == ["c", f"grow:{a.id}"]  # C heads the queue
    b.release()
    th.join(5)
    assert done == [None] and a.amount == 70
    assert _queue(rclient, pool_name) == ["c"] and not got
    a.release()
    th_c.join(5)
    assert [x.amount for x in got] == [50]
    check_consistent(rclient, pool_name)
    got[0].release()
    assert used(rclient, pool_name) == 0


async def test_growth_goes_before_new_requests_queued_earlier(make_apool, rclient, pool_name):
    """Every priority 0 (FIFO), capacity 100: A holds 60, B 30 (10 free); C, a new request,
    waits for 35. A's growth by 10 fits: granted at once although C queued before it
    (admitted work grows first). A's growth by 20 more does not fit: it queues ahead of C
    (status: the growth at 1, C at 2; C's own on_queued reports 2 at its next refresh). B
    releases: 30 free, A's growth is granted, C (35) waits for A, and is granted when A
    releases."""
    pool = make_apool(capacity=100, poll_interval=0.2)
    a, b = await pool.acquire(60), await pool.acquire(30)
    positions: list[int] = []
    c = asyncio.create_task(pool.acquire(35, request_id="c", on_queued=positions.append))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 1)
    await a.resize(70)  # at once, past C
    assert a.amount == 70 and used(rclient, pool_name) == 100
    assert _queue(rclient, pool_name) == ["c"] and positions == [1]
    grow = asyncio.create_task(a.resize(90))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 2)
    assert _queue(rclient, pool_name) == [f"grow:{a.id}", "c"]
    st = await pool.status()
    assert [(w.growth_of, w.amount, w.position) for w in st.waiters] == [
        (a.id, 20, 1),
        (None, 35, 2),
    ]
    await async_wait_until(lambda: positions[-1] == 2, what="C's refresh reporting position 2")
    check_consistent(rclient, pool_name)
    await b.release()
    await asyncio.wait_for(grow, 5)
    assert a.amount == 90 and used(rclient, pool_name) == 90
    assert _queue(rclient, pool_name) == ["c"] and not c.done()
    await a.release()
    lc = await asyncio.wait_for(c, 5)
    assert lc.amount == 35
    check_consistent(rclient, pool_name)
    await lc.release()
    assert used(rclient, pool_name) == 0


async def test_a_higher_priority_new_request_goes_before_a_growth(make_apool, rclient, pool_name):
    """Capacity 100: A (priority 0) holds 60, B 30 (10 free); C, a new request of priority 50,
    waits for 35: ahead of A's place. A's growth by 10 fits but would not be ahead of C: it
    queues behind it (B may free bytes: not refused). B releases: 40 free, C is granted first
    and A's growth (10) waits for the 5 bytes more it needs, until C releases."""
    pool = make_apool(capacity=100)
    a, b = await pool.acquire(60), await pool.acquire(30)
    c = asyncio.create_task(pool.acquire(35, request_id="c", priority=50))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 1)
    grow = asyncio.create_task(a.resize(70))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 2)
    assert _queue(rclient, pool_name) == ["c", f"grow:{a.id}"]
    st = await pool.status()
    assert [(w.growth_of, w.position) for w in st.waiters] == [(None, 1), (a.id, 2)]
    assert a.amount == 60 and used(rclient, pool_name) == 90
    await b.release()
    lc = await asyncio.wait_for(c, 5)
    assert used(rclient, pool_name) == 95 and not grow.done()
    assert _queue(rclient, pool_name) == [f"grow:{a.id}"]
    check_consistent(rclient, pool_name)
    await lc.release()
    await asyncio.wait_for(grow, 5)
    assert a.amount == 70 and used(rclient, pool_name) == 70
    check_consistent(rclient, pool_name)
    await a.release()
    assert used(rclient, pool_name) == 0


async def test_growth_of_a_higher_priority_lease_passes_a_lower_waiter(
    make_apool, rclient, pool_name
):
    pool = make_apool(capacity=100)
    hi = await pool.acquire(20, priority=50)
    blocker = await pool.acquire(80)
    low = asyncio.create_task(pool.acquire(20, priority=0))
    await async_wait_until(lambda: _queued(rclient, pool_name) == 1)
    grow = asyncio.create_task(hi.resize(40))  # priority 50: ahead of the waiter of 0
    await async_wait_until(lambda: _queued(rclient, pool_name) == 2)
    await blocker.resize(60)  # frees 20: the growth takes them, not the earlier waiter
    await asyncio.wait_for(grow, 5)
    assert hi.amount == 40 and not low.done()
    await blocker.release()
    lw = await asyncio.wait_for(low, 5)
    check_consistent(rclient, pool_name)
    await lw.release()
    await hi.release()


async def test_device_of_a_multi_device_pool(make_apool, rclient, pool_name):
    pool = make_apool()
    await pool.configure(devices=[100, 100])
    a = await pool.acquire(60, device=0)
    b = await pool.acquire(60, device=1)
    with pytest.raises(CapacityExceeded):
        await a.resize(101)  # a lease stays on its device: 200 in the pool is not for it
    await a.resize(100)
    assert a.amount == 100 and a.device == 0
    c = await pool.acquire(30, device=1)
    t = asyncio.create_task(b.resize(80))  # device 1 has 10 free
    await async_wait_until(lambda: _queued(rclient, pool_name) == 1)
    await a.release()  # device 0's bytes do not help it
    assert not t.done()
    await c.release()
    await asyncio.wait_for(t, 5)
    assert b.amount == 80 and b.device == 1
    assert rclient.hget(f"gpulock:{{{pool_name}}}:cfg", "dused:1") == b"80"
    check_consistent(rclient, pool_name)
    await b.release()


def test_sync_shrink_grow_deadlock_and_interrupt(make_pool, rclient, pool_name):
    pool = make_pool(capacity=100)
    a, b = pool.acquire(50), pool.acquire(50)
    lid, tok = a.id, a.token
    done: list[BaseException | None] = []

    def grow():
        try:
            a.resize(70)
            done.append(None)
        except BaseException as e:  # noqa: BLE001
            done.append(e)

    th = threading.Thread(target=grow)
    th.start()
    wait_until(lambda: _queued(rclient, pool_name) == 1)
    with pytest.raises(ResizeRefused):
        b.resize(60)
    b.resize(20)  # a shrink: 30 free, the growth of 20 is granted
    th.join(5)
    assert done == [None] and a.amount == 70 and (a.id, a.token) == (lid, tok)
    with pytest.raises(AcquireTimeout):
        a.resize(90, timeout=0.2)
    assert a.amount == 70 and _queued(rclient, pool_name) == 0
    check_consistent(rclient, pool_name)
    a.release()
    b.release()
    assert used(rclient, pool_name) == 0


@pytest.mark.timeout(60)
async def test_restart_reasserts_the_current_amount_and_requeues_the_growth(redis_proc1, pool_name):
    """Redis restarted empty while a growth waits: the leases are put back at their current
    amounts, the growth is queued again (its place was lost with the pool) and granted once
    the other holder releases after the grace period."""
    import redis as sync_redis

    from gpulock import AsyncPool

    rp = redis_proc1
    pool = AsyncPool.from_url(
        rp.url, pool_name, capacity=100, default_ttl=1.0, max_ttl=1.0, poll_interval=0.2
    )
    rc = sync_redis.Redis.from_url(rp.url)
    try:
        a, b = await pool.acquire(30), await pool.acquire(50)
        await a.resize(40)  # current amount 40 before the restart
        t = asyncio.create_task(a.resize(70))  # needs 30, 10 free: waits for b
        await async_wait_until(lambda: _queued(rc, pool_name) == 1)
        rp.restart()
        rc.close()
        rc = sync_redis.Redis.from_url(rp.url)

        def back():
            try:
                return used(rc, pool_name) == 90 and _queued(rc, pool_name) == 1
            except sync_redis.ConnectionError:
                return False

        await async_wait_until(back, 15, "leases put back (40 + 50) and the growth re-queued")
        assert not t.done() and a.amount == 40
        await b.release()
        await asyncio.wait_for(t, 15)
        assert a.amount == 70 and used(rc, pool_name) == 70
        check_consistent(rc, pool_name)
        await a.release()
    finally:
        await pool.aclose()
        rc.close()


def _per_device(rc, pool_name) -> dict[str, int]:
    """Bytes of the holder records per device, read from the raw keys."""
    out: dict[str, int] = {}
    for rec in rc.hvals(f"gpulock:{{{pool_name}}}:holders"):
        f = rec.decode().split("|")
        dev = f[6].rstrip("r")
        out[dev] = out.get(dev, 0) + int(f[0])
    return out


def test_random_resizes_keep_the_safety_invariant(make_pool, rclient, pool_name):
    """Random histories of acquires, releases, shrinks and growths (at once, refused, or queued
    and withdrawn by their timeout) on a pool of two devices, with a waiter queued behind:
    after every step each device's leases add up to at most its capacity, the counters equal
    the records (check_consistent) and every lease object's amount is the server's."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    pool = make_pool(poll_interval=0.2)
    pool.configure(devices=[64, 32])
    caps = {"0": 64, "1": 32}
    ops = st.lists(
        st.tuples(st.sampled_from(["acq", "rel", "resize"]), st.integers(0, 7), st.integers(1, 64)),
        max_size=25,
    )

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ops)
    def run(history):
        held: list = []
        try:
            for op, i, n in history:
                if op == "acq":
                    try:
                        held.append(pool.acquire(n, timeout=0, device=i % 2))
                    except (AcquireTimeout, CapacityExceeded):
                        pass
                elif held and op == "rel":
                    held.pop(i % len(held)).release()
                elif held:
                    lease = held[i % len(held)]
                    try:
                        lease.resize(n, timeout=0.05 if i % 3 == 0 else 0)
                    except (AcquireTimeout, CapacityExceeded, ResizeRefused):
                        pass
                per = _per_device(rclient, pool_name)
                assert all(per[d] <= caps[d] for d in per), per
                cfg = rclient.hgetall(f"gpulock:{{{pool_name}}}:cfg")
                for d in caps:
                    assert int(cfg.get(f"dused:{d}".encode(), 0)) == per.get(d, 0)
                check_consistent(rclient, pool_name)
                recs = rclient.hgetall(f"gpulock:{{{pool_name}}}:holders")
                for x in held:
                    assert int(recs[x.id.encode()].decode().split("|")[0]) == x.amount
                assert _queued(rclient, pool_name) == 0
        finally:
            for x in held:
                x.release()
        assert used(rclient, pool_name) == 0

    run()
