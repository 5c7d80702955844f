"""FIFO waiting: order, no starvation, positions, CapacityExceeded, QueueFull, timeout=0."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpulock import AcquireTimeout, CapacityExceeded, QueueFull
from support.pools import GiB, assert_empty, snapshot, used
from support.waiting import async_wait_until


async def _enqueue_in_order(pool, amounts, granted, **kw):
    """Start one acquire per amount, each only after the previous one is queued, so arrival
    order is known. Returns the tasks."""
    tasks = []
    for i, a in enumerate(amounts):
        queued = asyncio.Event()

        async def one(i=i, a=a, queued=queued):
            lease = await pool.acquire(a, on_queued=lambda pos: queued.set(), **kw)
            granted.append((i, lease))
            return lease

        tasks.append(asyncio.create_task(one()))
        await asyncio.wait_for(queued.wait(), 5)
    return tasks


async def test_strict_arrival_order(make_apool, rclient, pool_name):
    pool = make_apool(capacity=1)
    holder = await pool.acquire(1)
    granted: list = []
    tasks = await _enqueue_in_order(pool, [1] * 12, granted)
    await holder.release()
    for k in range(12):
        while len(granted) <= k:
            await asyncio.sleep(0.002)
        assert len(granted) == k + 1
        i, lease = granted[k]
        assert i == k, [g[0] for g in granted]
        await lease.release()
    await asyncio.gather(*tasks)
    assert [g[0] for g in granted] == list(range(12))
    assert_empty(rclient, pool_name)


async def test_order_across_pool_objects(make_apool, rclient, pool_name):
    """Waiters from different pool objects (different connections and listeners) are granted
    in arrival order too."""
    pools = [make_apool(capacity=1) for _ in range(3)]
    holder = await pools[0].acquire(1)
    granted: list = []
    tasks = []
    for i in range(9):
        queued = asyncio.Event()

        async def one(i=i, queued=queued):
            lease = await pools[i % 3].acquire(1, on_queued=lambda p: queued.set())
            granted.append(i)
            await lease.release()

        tasks.append(asyncio.create_task(one()))
        await queued.wait()
    await holder.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert granted == list(range(9))
    assert_empty(rclient, pool_name)


async def test_big_head_blocks_smaller_ones_no_starvation(make_apool, rclient, pool_name):
    pool = make_apool(capacity="8GiB")
    small_holder = await pool.acquire("2GiB")
    big_holder = await pool.acquire("4GiB")
    granted: list = []
    # 2 GiB free now. The head wants 8 GiB; the small ones behind it would fit, but must wait.
    tasks = await _enqueue_in_order(pool, ["8GiB", "1GiB", "1GiB"], granted)
    await small_holder.release()  # 4 GiB free: still not enough for the head
    await asyncio.sleep(0.3)
    assert granted == []
    st = await pool.status()
    assert [w.amount for w in st.waiters] == [8 * GiB, GiB, GiB]
    assert st.used == 4 * GiB
    await big_holder.release()  # the head gets all 8 GiB
    await asyncio.wait_for(tasks[0], 2)
    assert [g[0] for g in granted] == [0]
    assert used(rclient, pool_name) == 8 * GiB
    await granted[0][1].release()  # both small ones now fit, granted together
    await asyncio.wait_for(asyncio.gather(*tasks[1:]), 2)
    assert [g[0] for g in granted] == [0, 1, 2]
    for _, lease in granted[1:]:
        await lease.release()
    assert_empty(rclient, pool_name)


async def test_positions_count_down(make_apool, rclient, pool_name):
    pool = make_apool(capacity=1, poll_interval=0.05)
    holder = await pool.acquire(1)
    granted: list = []
    await _enqueue_in_order(pool, [1, 1, 1], granted)
    positions: list[int] = []
    last = asyncio.create_task(pool.acquire(1, on_queued=positions.append))
    while not positions:
        await asyncio.sleep(0.005)
    assert positions == [4]
    await holder.release()
    for k in range(3):
        while len(granted) <= k:
            await asyncio.sleep(0.005)
        await async_wait_until(lambda: positions[-1] == 3 - k, timeout=2)  # refreshed by the poll
        await granted[k][1].release()
    lease = await asyncio.wait_for(last, 2)
    await lease.release()
    # Positions seen only go down, by one at a time here (one release per step).
    assert positions == [4, 3, 2, 1], positions
    assert_empty(rclient, pool_name)


async def test_capacity_exceeded_at_once(make_apool, make_pool, rclient, pool_name):
    pool = make_apool(capacity="8GiB")
    holder = await pool.acquire("8GiB")
    before = snapshot(rclient)
    t0 = time.monotonic()
    for timeout in (None, 30, 0):
        with pytest.raises(CapacityExceeded) as ei:
            await pool.acquire("9GiB", timeout=timeout)
        assert ei.value.amount == 9 * GiB and ei.value.capacity == 8 * GiB
        assert str(9 * GiB) in str(ei.value)
    with pytest.raises(CapacityExceeded):
        make_pool(capacity="8GiB").acquire(8 * GiB + 1)  # sync: the same, at once
    assert time.monotonic() - t0 < 1.0
    assert snapshot(rclient) == before
    assert (await pool.status()).waiter_count == 0
    await holder.release()


async def test_queue_full(make_apool, rclient, pool_name):
    pool = make_apool(capacity=1, max_waiters=3)
    await pool.configure(1)
    holder = await pool.acquire(1)
    granted: list = []
    tasks = await _enqueue_in_order(pool, [1, 1, 1], granted)
    before = snapshot(rclient, f"gpulock:{{{pool_name}}}:queue")
    with pytest.raises(QueueFull) as ei:
        await pool.acquire(1)
    assert ei.value.max_waiters == 3 and ei.value.queue_length == 3
    assert snapshot(rclient, f"gpulock:{{{pool_name}}}:queue") == before
    await holder.release()
    for k in range(3):
        while len(granted) <= k:
            await asyncio.sleep(0.002)
        await granted[k][1].release()
    await asyncio.gather(*tasks)
    assert_empty(rclient, pool_name)


async def test_timeout_zero_never_queues_nor_jumps(make_apool, make_pool, rclient, pool_name):
    pool = make_apool(capacity="8GiB")
    holder = await pool.acquire("6GiB")
    granted: list = []
    tasks = await _enqueue_in_order(pool, ["4GiB"], granted)  # waits: only 2 GiB free
    before = snapshot(rclient)
    # 1 GiB would fit the free bytes, but a waiter is ahead: timeout=0 must not jump it.
    with pytest.raises(AcquireTimeout) as ei:
        await pool.acquire("1GiB", timeout=0)
    assert ei.value.queue_length == 1 and ei.value.position == 0
    with pytest.raises(AcquireTimeout):
        make_pool().acquire("1GiB", timeout=0)
    assert snapshot(rclient) == before
    await holder.release()
    lease = await asyncio.wait_for(tasks[0], 2)
    # Empty queue and room: timeout=0 grants at once.
    small = await pool.acquire("1GiB", timeout=0)
    assert used(rclient, pool_name) == 5 * GiB
    # Not enough room, empty queue: refused, not queued.
    with pytest.raises(AcquireTimeout):
        await pool.acquire("4GiB", timeout=0)
    assert (await pool.status()).waiter_count == 0
    await small.release()
    await lease.release()
    assert_empty(rclient, pool_name)


async def test_raising_capacity_grants_waiters(make_apool, rclient, pool_name):
    pool = make_apool(capacity="2GiB")
    holder = await pool.acquire("2GiB")
    granted: list = []
    tasks = await _enqueue_in_order(pool, ["1GiB", "1GiB"], granted)
    await pool.configure("4GiB")
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert [g[0] for g in granted] == [0, 1]
    for _, lease in granted:
        await lease.release()
    await holder.release()
    assert_empty(rclient, pool_name)


async def test_lowering_capacity_below_a_waiter_does_not_block_the_queue(
    make_apool, rclient, pool_name
):
    """A queued request that can never fit after the capacity is lowered must not block the
    ones behind it forever: it fails with CapacityExceeded, the others are granted."""
    pool = make_apool(capacity="8GiB", poll_interval=0.1)
    holder = await pool.acquire("8GiB")
    granted: list = []
    tasks = await _enqueue_in_order(pool, ["6GiB", "1GiB"], granted)
    await pool.configure("4GiB")
    await holder.release()
    with pytest.raises(CapacityExceeded):
        await asyncio.wait_for(tasks[0], 2)
    lease = await asyncio.wait_for(tasks[1], 2)
    await lease.release()
    assert_empty(rclient, pool_name)
