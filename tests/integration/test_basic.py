"""Basic use, sync and async: configure, acquire/release, context managers, status, tokens."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from gpulock import AcquireTimeout, AsyncLease, Lease, LeaseLost, PoolNotFound
from support.pools import GiB, assert_empty, check_consistent, server_ms, used
from support.waiting import async_wait_until


async def test_async_configure_acquire_release(make_apool, rclient, pool_name):
    pool = make_apool()
    r = await pool.configure("8GiB")
    assert r["created"] == 1 and r["capacity"] == 8 * GiB and r["used"] == 0 and r["epoch"] > 0
    r2 = await pool.configure("8GiB")
    assert r2["created"] == 0 and r2["epoch"] == r["epoch"]

    lease = await pool.acquire("3GiB", ttl=10, holder={"purpose": "embed"})
    assert isinstance(lease, AsyncLease)
    assert lease.amount == 3 * GiB and len(lease.id) == 32 and lease.token > 0
    assert used(rclient, pool_name) == 3 * GiB
    now = server_ms(rclient)
    assert abs(lease.expires_at * 1000 - (now + 10_000)) < 1000
    lease.ensure_valid()
    assert not lease.lost and not lease.released
    await lease.release()
    assert lease.released
    assert_empty(rclient, pool_name)
    await lease.release()  # idempotent
    with pytest.raises(LeaseLost, match="released"):
        lease.ensure_valid()


async def test_async_context_managers(make_apool, rclient, pool_name):
    pool = make_apool(capacity="8GiB")  # created on first use
    async with pool.lease("2GiB", ttl=5) as lease:
        assert used(rclient, pool_name) == 2 * GiB
        async with pool.lease(GiB) as inner:
            assert used(rclient, pool_name) == 3 * GiB
            assert inner.token > lease.token
    assert_empty(rclient, pool_name)
    # A body that raises still releases.
    with pytest.raises(RuntimeError):
        async with pool.lease("8GiB"):
            raise RuntimeError("boom")
    assert_empty(rclient, pool_name)
    # Awaiting pool.lease(...) directly gives a lease (the same as acquire).
    lease = await pool.lease("1GiB")
    async with lease:
        assert used(rclient, pool_name) == GiB
    assert_empty(rclient, pool_name)


def test_sync_configure_acquire_release(make_pool, rclient, pool_name):
    pool = make_pool()
    with pytest.raises(PoolNotFound):
        pool.acquire("1GiB")
    assert pool.configure("8GiB")["capacity"] == 8 * GiB
    lease = pool.acquire("4GiB", ttl=5)
    assert isinstance(lease, Lease) and lease.amount == 4 * GiB
    assert used(rclient, pool_name) == 4 * GiB
    with pool.lease("4GiB") as second:
        assert second.token > lease.token
        assert used(rclient, pool_name) == 8 * GiB
        with pytest.raises(AcquireTimeout):
            pool.acquire(1, timeout=0)
    lease.release()
    lease.release()
    assert_empty(rclient, pool_name)
    with pytest.raises(ZeroDivisionError):
        with pool.lease("8GiB"):
            1 / 0
    assert_empty(rclient, pool_name)


async def test_status_fields(make_apool, rclient, pool_name):
    pool = make_apool(capacity="8GiB")
    holder = await pool.acquire(
        "6GiB", ttl=20, holder={"purpose": "weights"}, request_id="req-hold"
    )
    queued: list[int] = []
    waiter = asyncio.create_task(
        pool.acquire(
            "4GiB", holder={"purpose": "batch"}, request_id="req-wait", on_queued=queued.append
        )
    )
    while not queued:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    st = await pool.status()
    assert (st.pool, st.capacity, st.used, st.free) == (pool_name, 8 * GiB, 6 * GiB, 2 * GiB)
    assert st.lease_count == 1 and st.waiter_count == 1
    (l,) = st.leases
    assert (l.lease_id, l.amount, l.token, l.request_id) == (
        holder.id,
        6 * GiB,
        holder.token,
        "req-hold",
    )
    assert 18 < l.expires_in <= 20 and l.ttl == 20
    assert l.holder["purpose"] == "weights" and l.holder["pid"] == os.getpid()
    assert l.holder["host"] == socket.gethostname()
    (w,) = st.waiters
    assert (w.position, w.request_id, w.amount) == (1, "req-wait", 4 * GiB)
    assert 0.15 <= w.waited < 5 and w.expires_in > 0
    assert w.holder["purpose"] == "batch"
    assert st.grants == 1 and st.fence == holder.token
    assert st.to_dict()["waiters"][0]["amount"] == 4 * GiB
    await holder.release()
    lease = await asyncio.wait_for(waiter, 2)
    await lease.release()
    st = await pool.status()
    assert st.used == 0 and st.leases == [] and st.waiters == [] and st.grants == 2


async def test_tokens_strictly_increase(make_apool, make_pool, rclient, pool_name):
    apool = make_apool(capacity="4GiB")
    spool = make_pool(capacity="4GiB")
    tokens = []
    for i in range(30):
        if i % 2:
            lease = await apool.acquire("1GiB")
            tokens.append(lease.token)
            await lease.release()
        else:
            lease = spool.acquire("1GiB")
            tokens.append(lease.token)
            lease.release()
    assert all(b > a for a, b in zip(tokens, tokens[1:])), tokens
    # Hand-offs too: waiters granted by a release get fresh, larger tokens, in grant order.
    holders = [await apool.acquire("2GiB") for _ in range(2)]
    assert holders[1].token > holders[0].token > tokens[-1]
    order: list = []

    async def wait_one():
        lease = await apool.acquire("2GiB")
        order.append(lease)
        return lease

    waiting = [asyncio.create_task(wait_one()) for _ in range(4)]
    await async_wait_until(lambda: rclient.zcard(f"gpulock:{{{pool_name}}}:queue") == 4)
    for h in holders:
        await h.release()
    while len(order) < 2:
        await asyncio.sleep(0.005)
    for g in list(order):
        await g.release()
    await asyncio.gather(*waiting)
    for g in order[2:]:
        await g.release()
    handoff = [g.token for g in order]
    assert handoff[0] > holders[1].token
    assert all(b > a for a, b in zip(handoff, handoff[1:])), handoff
    assert_empty(rclient, pool_name)
    check_consistent(rclient, pool_name)
