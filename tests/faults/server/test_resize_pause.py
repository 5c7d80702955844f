"""Redis stopped (SIGSTOP: connections succeed, replies never come) while a lease's growth waits,
then resumed (docs/SEMANTICS.md, "Resizing a lease"): the growth is still granted when the
other holder releases, the lease keeps its id and token, the growing lease's amount is the
server's, and the pool's raw keys agree (check_consistent; used never above capacity).

The pause is shorter than the leases' ttl (10 s) and, in one case, longer than the growth's
waiter ttl (1 s): the server then finds the growth's ticket expired when it runs again, and
the pool's refresh queues it again (or the release finds it and grants it). The clients'
socket timeout (0.3 s) makes the calls in flight time out and retry during the pause."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import redis
import redis.asyncio as aioredis

from gpulock import AcquireTimeout, AsyncPool, Pool
from gpulock.protocol.keys import pool_keys
from support.pools import AmountsDisagree, check_consistent, used
from support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.timeout(60)

CAPACITY = 100
TTL_S = 10.0
WAITER_TTL_S = 1.0


def _queue(r: redis.Redis, name: str) -> list[bytes]:
    return r.zrange(f"gpulock:{{{name}}}:queue", 0, -1)


def _check_frozen(r: redis.Redis, pool: str) -> None:
    """check_consistent on a copy of the pool's keys made in one MULTI (COPY: Redis >= 6.2),
    so that the pool's own calls, still running, cannot change the keys between its reads."""
    frozen = f"{pool}-frozen"
    src, dst = pool_keys(pool), pool_keys(frozen)
    pipe = r.pipeline(transaction=True)
    for a, b in zip(src[:7], dst[:7]):
        pipe.copy(a, b, replace=True)
    pipe.execute()
    try:
        check_consistent(r, frozen)
    finally:
        r.delete(*dst[:7])


def _server_amounts(r: redis.Redis, name: str) -> dict[str, int]:
    """Each lease's amount in its holder record, by lease id (the raw keys)."""
    holders = r.hgetall(f"gpulock:{{{name}}}:holders")
    return {k.decode(): int(v.decode().split("|", 1)[0]) for k, v in holders.items()}


@pytest.mark.parametrize("pause_s", [0.5, 2.0], ids=["within-waiter-ttl", "past-waiter-ttl"])
async def test_growth_waiting_through_a_redis_pause_is_granted_after_it(
    redis_proc, rclient, pool_name, pause_s
):
    clients = [
        aioredis.Redis.from_url(redis_proc.url, socket_timeout=0.3, socket_connect_timeout=0.3)
        for _ in range(2)
    ]
    kw = {"waiter_ttl": WAITER_TTL_S, "poll_interval": 0.2, "default_ttl": TTL_S}
    pa, pb = (AsyncPool(c, pool_name, **kw) for c in clients)
    try:
        await pa.configure(CAPACITY)
        a, b = await pa.acquire(60), await pb.acquire(40)
        lid, token = a.id, a.token
        grow = asyncio.create_task(a.resize(80, timeout=30))
        await async_wait_until(
            lambda: _queue(rclient, pool_name) == [f"grow:{lid}".encode()], 10, "the growth"
        )
        redis_proc.pause()
        try:
            await asyncio.sleep(pause_s)  # the fault's length (nothing is ordered by it)
            assert not grow.done() and a.amount == 60
        finally:
            redis_proc.resume()
        _check_frozen(rclient, pool_name)
        assert _server_amounts(rclient, pool_name) == {lid: 60, b.id: 40}
        await b.release()
        await asyncio.wait_for(grow, 10)
        assert (a.id, a.token, a.amount) == (lid, token, 80)
        assert _server_amounts(rclient, pool_name) == {lid: 80}
        assert used(rclient, pool_name) == 80 and _queue(rclient, pool_name) == []
        _check_frozen(rclient, pool_name)
        a.ensure_valid()
        await a.release()
        assert used(rclient, pool_name) == 0
        _check_frozen(rclient, pool_name)
    finally:
        for p in (pa, pb):
            await p.aclose()
        for c in clients:
            await c.aclose()


def test_sync_growth_waiting_through_a_redis_pause_is_granted_after_it(
    redis_proc, rclient, pool_name
):
    """The same through ``Pool`` (the growth waits in a thread), paused past the waiter ttl."""
    clients = [
        redis.Redis.from_url(redis_proc.url, socket_timeout=0.3, socket_connect_timeout=0.3)
        for _ in range(2)
    ]
    kw = {"waiter_ttl": WAITER_TTL_S, "poll_interval": 0.2, "default_ttl": TTL_S}
    pa, pb = (Pool(c, pool_name, **kw) for c in clients)
    try:
        pa.configure(CAPACITY)
        a, b = pa.acquire(60), pb.acquire(40)
        lid = a.id
        errors: list = []

        def grow() -> None:
            try:
                a.resize(80, timeout=30)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                errors.append(e)

        t = threading.Thread(target=grow)
        t.start()
        wait_until(lambda: _queue(rclient, pool_name) == [f"grow:{lid}".encode()], 10, "growth")
        redis_proc.pause()
        try:
            time.sleep(2.0)  # the fault's length (nothing is ordered by it)
            assert t.is_alive() and a.amount == 60
        finally:
            redis_proc.resume()
        _check_frozen(rclient, pool_name)
        assert _server_amounts(rclient, pool_name) == {lid: 60, b.id: 40}
        b.release()
        t.join(10)
        assert not t.is_alive() and not errors, errors
        assert a.amount == 80 and _server_amounts(rclient, pool_name) == {lid: 80}
        assert used(rclient, pool_name) == 80 and _queue(rclient, pool_name) == []
        _check_frozen(rclient, pool_name)
        a.release()
        assert used(rclient, pool_name) == 0
    finally:
        for p in (pa, pb):
            p.close()
        for c in clients:
            c.close()


@pytest.mark.xfail(
    raises=AmountsDisagree,
    strict=True,
    reason="a growth whose timeout ends while Redis is paused cannot be withdrawn (the resize "
    "back is not answered); it stays queued until its waiter ttl, and a release after the "
    "resume grants it: the server holds the new amount, lease.amount the old one, and the "
    "lease keeps the extra bytes until it is released or lost (docs/SEMANTICS.md: a timeout "
    "leaves the lease at its old amount)",
)
async def test_growth_timed_out_during_a_pause_leaves_the_lease_at_its_old_amount(
    redis_proc, rclient, pool_name
):
    """A's growth to 80 (timeout 1 s) queues; Redis is paused until the resize has ended
    (AcquireTimeout; its withdrawal is not answered within backend_timeout, 0.8 s); on the
    resume B releases: the lease's amount on the server must be ``lease.amount`` (60)."""
    c = aioredis.Redis.from_url(redis_proc.url, socket_timeout=0.3, socket_connect_timeout=0.3)
    p = AsyncPool(
        c, pool_name, backend_timeout=0.8, waiter_ttl=10.0, poll_interval=0.2, default_ttl=TTL_S
    )
    try:
        await p.configure(CAPACITY)
        a, b = await p.acquire(60), await p.acquire(40)
        grow = asyncio.create_task(a.resize(80, timeout=1.0))
        await async_wait_until(
            lambda: _queue(rclient, pool_name) == [f"grow:{a.id}".encode()], 10, "the growth"
        )
        redis_proc.pause()
        try:
            await async_wait_until(grow.done, 8, "the resize to end while Redis is paused")
        finally:
            redis_proc.resume()
        with pytest.raises(AcquireTimeout):
            await grow
        assert a.amount == 60
        await b.release()
        server = _server_amounts(rclient, pool_name)
        _check_frozen(rclient, pool_name)
        await a.release()
        assert used(rclient, pool_name) == 0
        if server[a.id] != a.amount:
            raise AmountsDisagree(f"lease.amount {a.amount}, server amount {server[a.id]}")
    finally:
        await p.aclose()
        await c.aclose()
