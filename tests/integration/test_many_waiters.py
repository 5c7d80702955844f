"""Many waiters, few connections: a process with N concurrent waiting acquires on one pool
object opens at most ``max_connections`` connections to Redis (the hand-off subscription
included), however large N is; nobody hits redis-py's "Too many connections" on the way
(callers queue for a connection instead); every waiter is granted, in FIFO order, as the
holder ahead of them releases; and nothing is left in Redis afterwards.

Connections are counted on the server: ``total_connections_received`` (every connection the
server accepted, so a short-lived one cannot slip between two samples) and ``CLIENT LIST``
while the waiters wait. Connection errors are counted where redis-py makes them (a counting
``__init__`` on its ``ConnectionError``), since gpulock retries them silently.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis.exceptions as rex

from gpulock import AsyncPool, Pool
from support.pools import assert_empty
from support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.timeout(120)

DEFAULT_MAX_CONNECTIONS = 16  # the documented default of from_url's max_connections


@pytest.fixture
def pool_errors(monkeypatch):
    """Messages of every redis-py ConnectionError made while the test runs that says the
    client ran out of connections ("Too many connections", or a blocking pool's timeout)."""
    seen: list[str] = []
    orig = rex.ConnectionError.__init__

    def counting_init(self, *args, **kw):
        msg = str(args[0]) if args else ""
        if "Too many connections" in msg or "No connection available" in msg:
            seen.append(msg)
        orig(self, *args, **kw)

    monkeypatch.setattr(rex.ConnectionError, "__init__", counting_init)
    return seen


def _opened(rclient) -> int:
    return int(rclient.info("stats")["total_connections_received"])


def _others(rclient) -> int:
    """Connections to the server other than the test's own ``rclient``."""
    me = rclient.client_id()
    return sum(1 for c in rclient.client_list() if int(c["id"]) != me)


def _check_fifo(granted: list[tuple[int, int]], n: int) -> None:
    """``granted``: (fencing token, queue position when enqueued) per waiter. Tokens grow with
    each grant, so sorted by token the positions must be 1..n in order."""
    assert len(granted) == n
    positions = [pos for _, pos in sorted(granted)]
    assert positions == list(range(1, n + 1)), "grants out of FIFO order"


@pytest.mark.parametrize(
    "n, max_connections", [(1000, None), (3000, 4)], ids=["1000-default", "3000-max4"]
)
async def test_async_waiters_share_a_bounded_set_of_connections(
    redis_proc, rclient, pool_name, pool_errors, n, max_connections
):
    limit = DEFAULT_MAX_CONNECTIONS if max_connections is None else max_connections
    kw = {} if max_connections is None else {"max_connections": max_connections}
    before = _opened(rclient)
    pool = AsyncPool.from_url(redis_proc.url, pool_name, capacity=1, **kw)
    try:
        holder = await pool.acquire(1, ttl=30)
        granted: list[tuple[int, int]] = []
        queued: dict[int, int] = {}

        async def waiter(i: int) -> None:
            lease = await pool.acquire(
                1, ttl=30, timeout=90, on_queued=lambda p: queued.setdefault(i, p)
            )
            granted.append((lease.token, queued[i]))
            await lease.release()

        tasks = [asyncio.create_task(waiter(i)) for i in range(n)]
        await async_wait_until(lambda: len(queued) == n or any(t.done() for t in tasks), timeout=60)
        assert len(queued) == n, [t.exception() for t in tasks if t.done()][:3]
        assert sorted(queued.values()) == list(range(1, n + 1))
        waiting = _others(rclient)
        assert waiting <= limit, (
            f"{waiting} connections open while {n} waiters wait (limit {limit})"
        )

        await holder.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 90)
        _check_fifo(granted, n)
    finally:
        await pool.aclose()
    opened = _opened(rclient) - before
    assert opened <= limit, f"{opened} connections opened for {n} waiters (limit {limit})"
    assert not pool_errors, f"{len(pool_errors)} connection-pool errors, e.g. {pool_errors[0]!r}"
    assert_empty(rclient, pool_name)


def test_sync_waiters_share_a_bounded_set_of_connections(
    redis_proc, rclient, pool_name, pool_errors
):
    """The blocking Pool: its calling threads' client has at most max_connections, its
    background thread's client (heartbeat, hand-off subscription) at most 4 more."""
    n, max_connections = 300, 4
    limit = max_connections + min(max_connections, 4)
    before = _opened(rclient)
    pool = Pool.from_url(redis_proc.url, pool_name, capacity=1, max_connections=max_connections)
    try:
        holder = pool.acquire(1, ttl=30)
        granted: list[tuple[int, int]] = []
        queued: dict[int, int] = {}
        errors: list[BaseException] = []

        def waiter(i: int) -> None:
            try:
                lease = pool.acquire(
                    1, ttl=30, timeout=90, on_queued=lambda p: queued.setdefault(i, p)
                )
                granted.append((lease.token, queued[i]))
                lease.release()
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                errors.append(e)

        threads = [threading.Thread(target=waiter, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        wait_until(lambda: len(queued) == n or errors, timeout=60)
        assert not errors, errors[:3]
        waiting = _others(rclient)
        assert waiting <= limit, (
            f"{waiting} connections open while {n} waiters wait (limit {limit})"
        )
        holder.release()
        for t in threads:
            t.join(90)
        assert not errors, errors[:3]
        _check_fifo(granted, n)
    finally:
        pool.close()
    opened = _opened(rclient) - before
    assert opened <= limit, f"{opened} connections opened for {n} waiting threads (limit {limit})"
    assert not pool_errors, f"{len(pool_errors)} connection-pool errors, e.g. {pool_errors[0]!r}"
    assert_empty(rclient, pool_name)


async def test_enqueues_of_a_burst_share_round_trips(redis_proc, rclient, pool_name, pool_errors):
    """Concurrent acquires go out together (pipelines) once every connection slot is busy, and
    a burst right after SCRIPT FLUSH (every call of a batch gets NOSCRIPT) still ends well."""
    n = 500
    pool = AsyncPool.from_url(redis_proc.url, pool_name, capacity=1, max_connections=4)
    try:
        holder = await pool.acquire(1, ttl=30)
        rclient.script_flush()
        outs = await asyncio.gather(
            *(pool.acquire(1, timeout=0) for _ in range(n)), return_exceptions=True
        )
        assert all(type(o).__name__ == "AcquireTimeout" for o in outs), {
            type(o).__name__ for o in outs
        }
        assert 1 <= pool._batch.batches < n // 10, pool._batch.batches
        await holder.release()
    finally:
        await pool.aclose()
    assert not pool_errors
    assert_empty(rclient, pool_name)


async def test_cancelled_waiters_of_a_burst_leave_nothing(redis_proc, rclient, pool_name):
    """Waiters cancelled at every stage (waiting for a batch, in a batch in flight, queued)
    leave nothing behind in Redis; the holder's lease is the only thing held."""
    n = 1000
    pool = AsyncPool.from_url(redis_proc.url, pool_name, capacity=1, max_connections=4)
    try:
        holder = await pool.acquire(1, ttl=30)
        # The hand-off subscription first: the burst below is about the calls to Redis, not
        # about a cancellation racing the subscription's confirmation.
        first_queued = asyncio.Event()
        first = asyncio.create_task(
            pool.acquire(1, timeout=60, on_queued=lambda p: first_queued.set())
        )
        await asyncio.wait_for(first_queued.wait(), 10)
        tasks = [asyncio.create_task(pool.acquire(1, timeout=3)) for _ in range(n)] + [first]
        for k in range(
            0, n + 1, 100
        ):  # cancel in slices, the later ones after the earlier were sent
            await asyncio.sleep(0)
            for t in tasks[k : k + 100]:
                t.cancel()
        outs = await asyncio.gather(*tasks, return_exceptions=True)
        # redis-py 8.1 lets a command whose reply is awaited finish in spite of a cancel (the
        # caller's task then goes on): such an acquire ends with its timeout instead.
        kinds = {type(o).__name__ for o in outs}
        assert kinds <= {"CancelledError", "AcquireTimeout"}, kinds
        assert sum(isinstance(o, asyncio.CancelledError) for o in outs) > n // 2
        st = await pool.status()
        assert st.waiter_count == 0 and st.used == 1
        await holder.release()
    finally:
        await pool.aclose()
    assert_empty(rclient, pool_name)
