"""Preemption on the core's side against a real server (issue 33): a holder asked to yield
learns it (``on_yield``, ``yield_requested``, ``yield_deadline``; sync and asyncio), a
cooperative one releases and the waiter is granted; an uncooperative one loses the lease at
the deadline; a lease acquired ``preemptible=False``, or a waiter within the priority gap,
never asks; a lease is asked once. Short ttls and yield graces; every wait is on observed
state with a generous deadline, never a wall-clock upper bound."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gpulock import LeaseLost, Preemption
from gpulock.protocol.keys import pool_key

from support.background import acquire_in_thread

CAP = 1000
WAIT_S = 30.0  # a generous deadline for what must happen; never a bound on its speed


def _preempt(pool, gap: int, grace_ms: int) -> None:
    """Turn preemption on in ``pool``'s pool (a sync Pool), through the API."""
    pool.configure(CAP, preemption=Preemption(gap, grace_ms / 1000))


def _until(cond, what: str, timeout: float = WAIT_S) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"not within {timeout}s: {what}")
        time.sleep(0.02)


def _cfg(rclient, pool: str, field: str) -> int:
    v = rclient.hget(pool_key(pool, "cfg"), field)
    return int(v) if v else 0


def _queued(pool) -> bool:
    return len(pool.status().waiters) > 0


def _renewals(lease, n: int) -> None:
    """Wait until the heartbeat renewed ``lease`` ``n`` more times (its next_renew moves)."""
    seen = [lease._state.next_renew]

    def moved() -> bool:
        cur = lease._state.next_renew
        if cur != seen[-1]:
            seen.append(cur)
        return len(seen) > n

    _until(moved, f"{n} renewals")


def test_holder_asked_yields_and_the_waiter_is_granted(make_pool, pool_name, rclient):
    holder_pool = make_pool(capacity=CAP)
    _preempt(holder_pool, 1, 1000)
    waiter_pool = make_pool(capacity=CAP, poll_interval=0.2)
    lease = holder_pool.acquire(800, ttl=2, priority=0)
    asked = threading.Event()
    lease.on_yield(lambda l: asked.set())
    assert not lease.yield_requested and lease.yield_deadline is None
    t, out = acquire_in_thread(waiter_pool, 500, priority=5, timeout=WAIT_S)
    _until(asked.is_set, "the holder's on_yield")
    assert lease.yield_requested and isinstance(lease.yield_deadline, float)
    late = []
    lease.on_yield(late.append)  # registered after the fact: at once
    assert late == [lease]
    lease.release()
    t.join(WAIT_S)
    got = out["lease"]
    assert got.token > lease.token
    assert _cfg(rclient, pool_name, "y_asked") == 1 and _cfg(rclient, pool_name, "y_done") == 1
    got.release()


def test_the_hand_off_message_tells_the_holder(make_pool, pool_name):
    """With a long ttl (no renewal for a long while) the message on the holder's channel is
    what tells it: the runtime's listener hands it to the lease."""
    holder_pool = make_pool(capacity=CAP)
    _preempt(holder_pool, 1, 5000)
    waiter_pool = make_pool(capacity=CAP)
    lease = holder_pool.acquire(800, ttl=60, timeout=0)  # a try: no subscription of its own
    rt = holder_pool._bg.rt
    _until(lambda: rt.listener.subscribed, "the holder's listener subscribed")
    by_message = []
    ask = rt.leases.ask
    rt.leases.ask = lambda asks: (by_message.extend(asks), ask(asks))  # type: ignore[method-assign]
    t, out = acquire_in_thread(waiter_pool, 500, priority=5, timeout=WAIT_S)
    _until(lambda: by_message, "the yield message")
    assert by_message[0].lease_id == lease.id
    _until(lambda: lease.yield_requested, "yield_requested")
    lease.release()
    t.join(WAIT_S)
    out["lease"].release()


async def test_async_holder_on_yield_sync_and_coroutine(make_apool, pool_name):
    holder_pool = make_apool(capacity=CAP)
    waiter_pool = make_apool(capacity=CAP, poll_interval=0.2)
    await holder_pool.configure(CAP, preemption=Preemption(1, 1.0))
    lease = await holder_pool.acquire(800, ttl=2)
    plain, coro = asyncio.Event(), asyncio.Event()
    lease.on_yield(lambda l: plain.set())

    async def on_yield(l):
        await asyncio.sleep(0)
        coro.set()

    lease.on_yield(on_yield)
    task = asyncio.create_task(waiter_pool.acquire(500, priority=5, timeout=WAIT_S))
    await asyncio.wait_for(asyncio.gather(plain.wait(), coro.wait()), WAIT_S)
    assert lease.yield_requested and lease.yield_deadline is not None
    await lease.release()
    got = await asyncio.wait_for(task, WAIT_S)
    assert got.token > lease.token
    await got.release()


def test_uncooperative_holder_loses_the_lease_at_the_deadline(make_pool, pool_name, rclient):
    holder_pool = make_pool(capacity=CAP)
    _preempt(holder_pool, 1, 500)
    waiter_pool = make_pool(capacity=CAP, poll_interval=0.2)
    lease = holder_pool.acquire(800, ttl=1)
    lost = threading.Event()
    lease.on_lost(lambda l: lost.set())
    t, out = acquire_in_thread(waiter_pool, 500, priority=5, timeout=WAIT_S)
    _until(lost.is_set, "the holder's on_lost")  # it keeps heartbeating, never releases
    assert lease.yield_requested
    with pytest.raises(LeaseLost):
        lease.ensure_valid()
    t.join(WAIT_S)
    got = out["lease"]
    assert got.token > lease.token
    with pytest.raises(LeaseLost):
        lease.release()  # late: frees nothing of the new holder's
    st = waiter_pool.status()
    assert st.used == 500 and [x.lease_id for x in st.leases] == [got.id]
    got.ensure_valid()
    _until(lambda: _cfg(rclient, pool_name, "y_taken") == 1, "y_taken counted")
    got.release()


@pytest.mark.parametrize(
    "holder_kw, waiter_priority, gap",
    [({"preemptible": False}, 5, 1), ({}, 3, 5)],
    ids=["not-preemptible", "gap-not-met"],
)
def test_never_asked(make_pool, pool_name, rclient, holder_kw, waiter_priority, gap):
    holder_pool = make_pool(capacity=CAP)
    _preempt(holder_pool, gap, 500)
    waiter_pool = make_pool(capacity=CAP, poll_interval=0.2)
    lease = holder_pool.acquire(800, ttl=1, **holder_kw)
    t, out = acquire_in_thread(waiter_pool, 500, priority=waiter_priority, timeout=WAIT_S)
    _until(lambda: _queued(waiter_pool), "the waiter queued")
    _renewals(lease, 3)  # renewals and the waiter's refreshes ran the ask meanwhile
    assert not lease.yield_requested and lease.yield_deadline is None
    assert _cfg(rclient, pool_name, "y_asked") == 0
    lease.ensure_valid()
    lease.release()
    t.join(WAIT_S)
    out["lease"].release()


def test_asked_once(make_pool, pool_name, rclient):
    holder_pool = make_pool(capacity=CAP)
    _preempt(holder_pool, 1, 5000)
    waiter_pool = make_pool(capacity=CAP, poll_interval=0.2)
    lease = holder_pool.acquire(800, ttl=1)
    calls = []
    lease.on_yield(calls.append)
    t, out = acquire_in_thread(waiter_pool, 500, priority=5, timeout=WAIT_S)
    _until(lambda: calls, "on_yield")
    _renewals(lease, 3)
    assert calls == [lease] and _cfg(rclient, pool_name, "y_asked") == 1
    lease.release()
    t.join(WAIT_S)
    out["lease"].release()


def test_an_asked_lease_may_shrink_not_grow_and_is_never_renewed_past_its_deadline(
    make_pool, pool_name, rclient
):
    """resize.lua: a growth of a lease asked to yield is refused, naming the lease; a shrink is
    granted, its bytes go to the waiter, and its renewal stops at the yield deadline."""
    from gpulock import InvalidArgument
    from gpulock.protocol.keys import pool_keys

    holder_pool = make_pool(capacity=CAP)
    _preempt(holder_pool, 1, 500)  # a grace below the ttl: the deadline is the expiry at the ask
    waiter_pool = make_pool(capacity=CAP, poll_interval=0.2)
    lease = holder_pool.acquire(800, ttl=30)
    t, out = acquire_in_thread(waiter_pool, 500, priority=5, timeout=WAIT_S)
    _until(lambda: lease.yield_requested, "the holder asked to yield")
    with pytest.raises(InvalidArgument, match=f"{lease.id} was asked to yield"):
        lease.resize(900)
    lease.resize(300)
    t.join(WAIT_S)
    got = out["lease"]
    keys = pool_keys(pool_name)
    raw = rclient.hget(keys.tickets, f"y:{lease.id}")
    deadline = int(raw.decode().split("|")[1])
    assert int(rclient.zscore(keys.leases, lease.id)) <= deadline
    got.release()
    lease.release()


def test_an_ask_right_after_the_grant_comes_by_message(make_pool, pool_name):
    """The acquire listens on the channel before it is sent (flow LISTEN), so an ask made the
    moment after the grant reaches the holder by the message, not at its next renewal (ttl 60:
    the first one 20 s later)."""
    holder_pool = make_pool(capacity=CAP)
    _preempt(holder_pool, 1, 5000)
    waiter_pool = make_pool(capacity=CAP)
    for attempt in range(3):  # the first acquire of the pool object subscribes, later ones not
        lease = holder_pool.acquire(800, ttl=60, timeout=0)
        rt = holder_pool._bg.rt
        assert rt.listening
        by_message: list = []
        ask = rt.leases.ask
        rt.leases.ask = lambda asks: (by_message.extend(asks), ask(asks))  # type: ignore[method-assign]
        t, out = acquire_in_thread(waiter_pool, 500, priority=5, timeout=WAIT_S)
        _until(lambda: lease.yield_requested, "yield_requested")
        assert [a.lease_id for a in by_message] == [lease.id], attempt
        rt.leases.ask = ask  # type: ignore[method-assign]
        lease.release()
        t.join(WAIT_S)
        out["lease"].release()


async def test_an_async_ask_right_after_the_grant_comes_by_message(make_apool, pool_name):
    holder_pool = make_apool(capacity=CAP)
    await holder_pool.configure(CAP, preemption=Preemption(1, 5.0))
    waiter_pool = make_apool(capacity=CAP)
    lease = await holder_pool.acquire(800, ttl=60, timeout=0)
    rt = holder_pool._runtime
    assert rt.listening
    by_message: list = []
    ask = rt.leases.ask
    rt.leases.ask = lambda asks: (by_message.extend(asks), ask(asks))  # type: ignore[method-assign]
    asked = asyncio.Event()
    lease.on_yield(lambda _: asked.set())
    w = asyncio.create_task(waiter_pool.acquire(500, priority=5, timeout=WAIT_S))
    await asyncio.wait_for(asked.wait(), WAIT_S)
    assert [a.lease_id for a in by_message] == [lease.id]  # not a renewal's reply
    await lease.release()
    await (await w).release()
