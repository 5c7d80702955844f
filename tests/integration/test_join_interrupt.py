"""An interrupt that lands in an acquire's Join step after the runtime registered the waiter
(a KeyboardInterrupt from Ctrl-C, or what ``gpulock run``'s signal handler raises) leaves
nothing queued: the registration this acquire made is undone and its request withdrawn, as
when the interrupt lands in the wait that follows. Another acquire sharing the request id
keeps the waiter and the request.

The interrupt is injected by a ``Runtime.queue_waiter`` that registers and then raises, the
latest point of the step (its handle never reaches the flow)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import redis

from gpulock import AsyncPool
from gpulock.protocol.keys import pool_keys
from gpulock.runtime.runtime import Runtime
from support.pools import assert_empty
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(60)


def queued(rclient: redis.Redis, pool_name: str) -> int:
    return int(rclient.zcard(pool_keys(pool_name)[3]))


def interrupt_after_registering(monkeypatch: pytest.MonkeyPatch, calls: int = 1) -> list[str]:
    """Make ``Runtime.queue_waiter`` raise KeyboardInterrupt once it registered, from its
    ``calls``-th call on (the earlier ones return normally). Returns the tickets it did so for."""
    real = Runtime.queue_waiter
    seen: list[int] = []
    hit: list[str] = []

    def queue_waiter(self: Runtime, ticket: str, *a: Any, **kw: Any) -> Any:
        w = real(self, ticket, *a, **kw)
        seen.append(1)
        if len(seen) >= calls:
            hit.append(ticket)
            raise KeyboardInterrupt  # as a signal handler's raise landing at the end of Join
        return w

    monkeypatch.setattr(Runtime, "queue_waiter", queue_waiter)
    return hit


def test_sync_acquire_interrupted_after_registering_leaves_the_queue(
    make_pool, rclient, pool_name, monkeypatch
):
    pool = make_pool(capacity=1, poll_interval=60)
    holder = make_pool(capacity=1).acquire(1, ttl=30)
    hit = interrupt_after_registering(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        pool.acquire(1, ttl=30, request_id="r")
    assert hit == ["r"]  # it queued, and was interrupted after registering
    rt = pool._runtime
    assert rt is not None and dict(rt.waiters) == {}  # no local waiter left to refresh it
    assert pool.status().waiter_count == 0 and queued(rclient, pool_name) == 0
    holder.release()
    assert pool.status().used == 0  # the release granted nothing to the withdrawn request
    assert_empty(rclient, pool_name)


def test_sync_acquire_interrupted_after_joining_a_shared_waiter_keeps_it(
    make_pool, rclient, pool_name, monkeypatch
):
    """Two acquires with one request id: the second is interrupted after it joined the
    first's waiter. It leaves the waiter, and withdraws nothing: the first keeps its place
    and gets the grant."""
    pool = make_pool(capacity=1, poll_interval=60)
    holder = make_pool(capacity=1).acquire(1, ttl=30)
    hit = interrupt_after_registering(monkeypatch, calls=2)
    out: dict[str, Any] = {}

    def first() -> None:
        try:
            out["lease"] = pool.acquire(1, ttl=30, request_id="same")
        except BaseException as e:  # noqa: BLE001 - recorded for the assertions
            out["error"] = e

    t = threading.Thread(target=first, daemon=True)
    t.start()
    wait_until(
        lambda: pool._runtime is not None and "same" in pool._runtime.waiters,
        what="the first acquire's waiter",
    )
    with pytest.raises(KeyboardInterrupt):
        pool.acquire(1, ttl=30, request_id="same")
    assert hit == ["same"]
    rt = pool._runtime
    assert rt is not None and rt.waiters["same"].users == 1  # the first acquire's only
    assert queued(rclient, pool_name) == 1  # not withdrawn
    holder.release()
    t.join(20)
    assert not t.is_alive() and "error" not in out, out
    out["lease"].release()
    assert_empty(rclient, pool_name)


def test_sync_growth_interrupted_after_registering_leaves_the_queue(
    make_pool, rclient, pool_name, monkeypatch
):
    """The same for a lease's growth (``resize``, which joins a waiter too): it keeps its
    amount, and no local waiter is left to queue the growth again."""
    pool = make_pool(capacity=2, poll_interval=60)
    holder = make_pool(capacity=2).acquire(1, ttl=30)
    lease = pool.acquire(1, ttl=30)
    hit = interrupt_after_registering(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        lease.resize(2)
    assert len(hit) == 1
    rt = pool._runtime
    assert rt is not None and dict(rt.waiters) == {}
    st = pool.status()
    assert st.waiter_count == 0 and st.used == 2 and queued(rclient, pool_name) == 0
    holder.release()
    assert pool.status().used == 1  # the growth was not granted
    lease.release()
    assert_empty(rclient, pool_name)


def test_async_acquire_interrupted_after_registering_leaves_the_queue(
    make_pool, redis_proc, rclient, pool_name, monkeypatch
):
    """The async pool: a CancelledError cannot land in its Join step (the step has no await),
    but a KeyboardInterrupt a signal handler raises can. It propagates out of the event loop
    (asyncio.run here), after the acquire withdrew."""
    holder = make_pool(capacity=1).acquire(1, ttl=30)
    hit = interrupt_after_registering(monkeypatch)
    seen: dict[str, Any] = {}

    async def main() -> None:
        pool = AsyncPool.from_url(redis_proc.url, pool_name, capacity=1, poll_interval=60)
        try:
            await pool.acquire(1, ttl=30, request_id="r")
        finally:
            rt = pool._runtime
            seen["waiters"] = None if rt is None else dict(rt.waiters)
            seen["waiter_count"] = (await pool.status()).waiter_count
            await pool.aclose()

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    assert hit == ["r"]
    assert seen == {"waiters": {}, "waiter_count": 0}
    assert queued(rclient, pool_name) == 0
    holder.release()
    assert_empty(rclient, pool_name)
