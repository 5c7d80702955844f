"""Idempotency by request id: never two places in the queue, never two grants."""

from __future__ import annotations

import asyncio

import pytest

from gpulock import AcquireTimeout, InvalidArgument, LeaseLost
from gpulock.protocol.keys import pool_keys
from support.pools import assert_empty, raw_acquire, snapshot, used
from support.waiting import async_wait_until


async def test_sequential_same_request_id_gets_the_same_grant(make_apool, rclient, pool_name):
    pool = make_apool(capacity="4GiB")
    a = await pool.acquire("1GiB", request_id="job-1")
    b = await pool.acquire("1GiB", request_id="job-1")
    assert (b.id, b.token) == (a.id, a.token)
    assert used(rclient, pool_name) == 1 << 30
    assert rclient.zcard(pool_keys(pool_name)[1]) == 1
    await b.release()
    assert_empty(rclient, pool_name)
    await a.release()  # the same lease, already released: a no-op (it was ours)
    assert_empty(rclient, pool_name)
    # After the grant ended, the id may be used again: a fresh grant.
    c = await pool.acquire("1GiB", request_id="job-1")
    assert c.token > a.token
    await c.release()
    assert_empty(rclient, pool_name)


def test_sync_same_request_id_twice(make_pool, rclient, pool_name):
    pool = make_pool(capacity="4GiB")
    a = pool.acquire("1GiB", request_id="job-2")
    b = pool.acquire("1GiB", request_id="job-2")
    assert (a.id, a.token) == (b.id, b.token)
    assert used(rclient, pool_name) == 1 << 30
    a.release()
    b.release()
    assert_empty(rclient, pool_name)


async def test_retry_while_queued_keeps_its_position(make_apool, rclient, pool_name):
    pool = make_apool(capacity=1)
    holder = await pool.acquire(1)
    keys = pool_keys(pool_name)
    raw_acquire(rclient, pool_name, 1, ticket="first")
    r1 = raw_acquire(rclient, pool_name, 1, ticket="mine")
    raw_acquire(rclient, pool_name, 1, ticket="third")
    assert r1[0] == 0 and r1[1] == 2
    before = rclient.zrange(keys[3], 0, -1, withscores=True)
    # The retry (another lease id, as a new client process would send) keeps place 2.
    r2 = raw_acquire(rclient, pool_name, 1, ticket="mine")
    assert r2[0] == 0 and r2[1] == 2 and r2[3] == 3
    assert rclient.zrange(keys[3], 0, -1, withscores=True) == before
    # Through the API as well: position 2, no new place.
    positions = []
    with pytest.raises(AcquireTimeout) as ei:
        await pool.acquire(1, request_id="mine", timeout=0.2, on_queued=positions.append)
    assert positions == [2] and ei.value.position == 2
    # The timeout withdrew "mine" (a retry that gives up withdraws the request).
    assert [m.decode() for m in rclient.zrange(keys[3], 0, -1)] == ["first", "third"]
    await holder.release()


async def test_concurrent_same_request_id_one_place_one_grant(make_apool, rclient, pool_name):
    pool = make_apool(capacity=1)
    other = make_apool(capacity=1)
    holder = await pool.acquire(1)
    keys = pool_keys(pool_name)
    # Three concurrent attempts with one id: two on one pool object, one on another.
    tasks = [
        asyncio.create_task(p.acquire(1, request_id="dup", timeout=5)) for p in (pool, pool, other)
    ]
    await async_wait_until(
        lambda: (
            "dup" in pool._runtime.waiters
            and pool._runtime.waiters["dup"].users == 2
            and "dup" in other._runtime.waiters
        )
    )
    assert rclient.zcard(keys[3]) == 1  # one place in the queue
    await holder.release()
    leases = await asyncio.wait_for(asyncio.gather(*tasks), 3)
    assert len({(l.id, l.token) for l in leases}) == 1  # one grant, seen by all three
    assert rclient.zcard(keys[1]) == 1 and used(rclient, pool_name) == 1
    await leases[0].release()
    assert_empty(rclient, pool_name)
    await leases[1].release()  # the same pool object: the same lease state, already released
    # Another pool object (as another process) saw the same grant; it is gone now.
    with pytest.raises(LeaseLost):
        await leases[2].release()
    assert_empty(rclient, pool_name)


async def test_concurrent_same_request_id_one_gives_up(make_apool, rclient, pool_name):
    """Two local acquires share a request id; one times out. The other still gets the grant
    and keeps it (the give-up must not withdraw the other's request)."""
    pool = make_apool(capacity=1)
    holder = await pool.acquire(1)
    patient = asyncio.create_task(pool.acquire(1, request_id="shared", timeout=5))
    # The patient one is queued first (seen on the server, not slept for).
    await async_wait_until(lambda: rclient.zscore(pool_keys(pool_name)[3], "shared") is not None)
    with pytest.raises(AcquireTimeout):
        await pool.acquire(1, request_id="shared", timeout=0.1)
    # The place in the queue is still there (not withdrawn and re-made at the tail later).
    assert [m.decode() for m in rclient.zrange(pool_keys(pool_name)[3], 0, -1)] == ["shared"]
    await holder.release()
    lease = await asyncio.wait_for(patient, 2)
    await asyncio.sleep(0.1)
    st = await pool.status()
    assert st.lease_count == 1 and st.leases[0].lease_id == lease.id
    lease.ensure_valid()
    await lease.release()
    assert_empty(rclient, pool_name)


async def test_request_id_with_another_amount_is_refused(make_apool, rclient, pool_name):
    pool = make_apool(capacity="4GiB")
    a = await pool.acquire("1GiB", request_id="job-x")
    before = snapshot(rclient)
    with pytest.raises(InvalidArgument, match="another amount"):
        await pool.acquire("2GiB", request_id="job-x")
    assert snapshot(rclient) == before
    # Queued with one amount, retried with another: refused as well.
    b = await pool.acquire("3GiB")
    raw_acquire(rclient, pool_name, 1 << 30, ticket="job-q")
    before = snapshot(rclient)
    with pytest.raises(InvalidArgument, match="another amount"):
        await pool.acquire("2GiB", request_id="job-q", timeout=1)
    assert snapshot(rclient) == before
    await a.release()
    await b.release()
