"""Waiter expiry and re-polling: live waiters keep their place, dead ones leave the queue,
a waiter the queue forgot enqueues again, a grant whose message is missed is still found."""

from __future__ import annotations

import asyncio
import time

from gpulock.protocol.keys import pool_keys
from support.pools import assert_empty, raw, raw_acquire
from support.waiting import async_wait_until


async def test_live_waiter_survives_many_waiter_ttls(make_apool, rclient, pool_name):
    # Refreshed every 0.1 s, a place lasts 0.75 s: a loaded machine may delay a refresh by a
    # few hundred ms without the test failing by chance (it did at waiter_ttl 0.3).
    pool = make_apool(capacity=1, waiter_ttl=0.75, poll_interval=0.1)
    holder = await pool.acquire(1)
    task = asyncio.create_task(pool.acquire(1))
    await asyncio.sleep(2.4)  # three waiter ttls
    st = await pool.status()
    assert st.waiter_count == 1 and st.reaped_waiters == 0
    await holder.release()
    lease = await asyncio.wait_for(task, 1)
    await lease.release()
    assert_empty(rclient, pool_name)


async def test_dead_waiter_leaves_the_queue(make_apool, rclient, pool_name):
    pool = make_apool(capacity=1)
    holder = await pool.acquire(1, ttl=30)
    # A waiter whose process died: queued with a 0.3 s waiter ttl and never refreshed.
    raw_acquire(rclient, pool_name, 1, ticket="dead", waiter_ttl_ms=300)
    task = asyncio.create_task(pool.acquire(1))
    await async_wait_until(lambda: rclient.zcard(pool_keys(pool_name)[3]) == 2)
    await asyncio.sleep(0.4)
    t0 = time.monotonic()
    await holder.release()  # the dead head is reaped, the live waiter granted at once
    lease = await asyncio.wait_for(task, 1)
    assert time.monotonic() - t0 < 0.8  # at the release, not at the next poll (1 s)
    assert (await pool.status()).reaped_waiters == 1
    await lease.release()
    assert_empty(rclient, pool_name)


async def test_forgotten_waiter_enqueues_again(make_apool, rclient, pool_name):
    pool = make_apool(capacity=1, poll_interval=0.1)
    holder = await pool.acquire(1)
    task = asyncio.create_task(pool.acquire(1, request_id="forgotten"))
    await async_wait_until(lambda: rclient.zcard(pool_keys(pool_name)[3]) == 1)
    raw(rclient, pool_name, "cancel", "forgotten")  # the server forgets it (as after a pause)
    assert rclient.zcard(pool_keys(pool_name)[3]) == 0
    await async_wait_until(lambda: rclient.zcard(pool_keys(pool_name)[3]) == 1, timeout=2)
    await holder.release()
    lease = await asyncio.wait_for(task, 2)
    await lease.release()
    assert_empty(rclient, pool_name)


async def test_missed_grant_message_found_by_poll(make_apool, rclient, pool_name, monkeypatch):
    """Every grant message is lost: waiters still get their grants from the backstop poll,
    within about one poll interval."""
    import gpulock.runtime.listener as rt_mod

    monkeypatch.setattr(rt_mod, "decode_events", lambda data: [])
    pool = make_apool(capacity=1, poll_interval=0.2)
    holder = await pool.acquire(1)
    task = asyncio.create_task(pool.acquire(1))
    await async_wait_until(lambda: rclient.zcard(pool_keys(pool_name)[3]) == 1)
    t0 = time.monotonic()
    await holder.release()
    lease = await asyncio.wait_for(task, 1.5)
    assert time.monotonic() - t0 < 0.5
    await lease.release()
    assert_empty(rclient, pool_name)


async def test_sync_waiter_gets_handoff_fast(make_pool, rclient, pool_name):
    """The sync shell registers its waiter after the acquire reply; a grant published in
    between must not wait for a poll. The poll is 60 s away and the wait's timeout 20 s, so
    only the hand-off can deliver each grant (no timing is asserted)."""
    pool = make_pool(capacity=1, poll_interval=60)
    other = make_pool(capacity=1)
    for _ in range(20):
        holder = other.acquire(1)
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, lambda: pool.acquire(1, timeout=20))
        await async_wait_until(lambda: rclient.zcard(pool_keys(pool_name)[3]) == 1)
        await loop.run_in_executor(None, holder.release)
        lease = await fut
        await loop.run_in_executor(None, lease.release)
    assert_empty(rclient, pool_name)
