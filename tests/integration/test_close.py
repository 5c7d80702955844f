"""Closing a pool object while another thread or task waits in acquire: the wait ends at once
with PoolClosed, the request leaves the server's queue, nothing is held, and later acquires on
the closed object fail at once (the async shell) instead of waiting for a heartbeat and a
listener that no longer run."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from gpulock import AsyncPool, Pool, PoolClosed
from support.pools import assert_empty

pytestmark = pytest.mark.timeout(30)


def test_sync_close_ends_a_wait_in_another_thread(redis_proc, rclient, pool_name):
    with Pool.from_url(redis_proc.url, pool_name, capacity=1) as other:
        holder = other.acquire(1, ttl=30)
        p = Pool.from_url(redis_proc.url, pool_name)
        out: dict = {}

        def wait():
            t0 = time.monotonic()
            try:
                out["lease"] = p.acquire(1, timeout=None)
            except BaseException as e:  # noqa: BLE001 - recorded for the assertion
                out["error"] = e
            out["took"] = time.monotonic() - t0

        t = threading.Thread(target=wait)
        t.start()
        deadline = time.monotonic() + 5
        while other.status().waiter_count != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert other.status().waiter_count == 1
        t0 = time.monotonic()
        p.close()
        t.join(10)
        assert not t.is_alive(), "close() left the waiting thread blocked"
        assert isinstance(out.get("error"), PoolClosed), out
        assert time.monotonic() - t0 < 5
        st = other.status()
        assert st.waiter_count == 0 and st.used == 1, (
            "the closed pool's request must leave the queue"
        )
        holder.release()
    assert_empty(rclient, pool_name)


async def test_async_close_ends_a_waiting_task(redis_proc, rclient, pool_name):
    other = AsyncPool.from_url(redis_proc.url, pool_name, capacity=1)
    holder = await other.acquire(1, ttl=30)
    p = AsyncPool.from_url(redis_proc.url, pool_name)
    task = asyncio.create_task(p.acquire(1, timeout=None))
    for _ in range(500):
        if (await other.status()).waiter_count == 1:
            break
        await asyncio.sleep(0.01)
    await p.aclose()
    with pytest.raises(
        PoolClosed, match="closed while this call waited; the request left the queue"
    ):
        await asyncio.wait_for(task, 5)
    st = await other.status()
    assert st.waiter_count == 0 and st.used == 1
    with pytest.raises(PoolClosed, match="closed before this call; nothing was queued"):
        await p.acquire(1, timeout=0)  # closed: no heartbeat would keep a lease alive
    await holder.release()
    await other.aclose()
    assert_empty(rclient, pool_name)


async def test_async_close_survives_a_socket_close_that_times_out(redis_proc, pool_name):
    """redis-py raises TimeoutError when a socket's close is not confirmed within
    socket_connect_timeout (a soak's worker on a loaded machine hit it); closing the pool
    object is best effort, as Pool.close's: it ends, closed, without raising."""
    import redis.exceptions

    p = AsyncPool.from_url(redis_proc.url, pool_name, capacity=1)
    await (await p.acquire(1, ttl=30)).release()
    real = p.redis.aclose

    async def slow_close() -> None:
        await real()
        raise redis.exceptions.TimeoutError("Timed out closing connection after 2.0")

    p.redis.aclose = slow_close  # type: ignore[method-assign]
    await p.aclose()
    with pytest.raises(PoolClosed):
        await p.acquire(1, timeout=0)


def test_sync_close_closes_its_event_loop(redis_proc, pool_name):
    """The sync Pool's background event loop is closed when the pool object closes, not left
    to its finalizer at interpreter exit (which may run after its self-pipe's socket is gone
    and print "Exception ignored in BaseEventLoop.__del__ ... Invalid file descriptor: -1" on
    a CLI's stderr)."""
    p = Pool.from_url(redis_proc.url, pool_name, capacity=1)
    p.acquire(1, ttl=30).release()
    portal = p._portal
    assert portal is not None and not portal.loop.is_closed()
    p.close()
    assert not portal.thread.is_alive()
    assert portal.loop.is_closed()
