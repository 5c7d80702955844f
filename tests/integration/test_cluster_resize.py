"""Resizing a lease on a real Redis Cluster and a real Valkey cluster (3 masters, 3 replicas, on
loopback, started here; docs/SEMANTICS.md, "Resizing a lease"): through ``AsyncPool`` and
``Pool`` on a ``redis+cluster://`` URL, on a pool served by each master, a shrink hands its
bytes to a waiter, a growth queues and is granted by another holder's release (the hand-off,
published on the pool's shard: ``poll_interval`` is 60 s, so no poll can deliver it), and the
deadlock rule refuses the second growth of a cycle. Every step is read on the raw keys of the
pool's master (check_consistent)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis
from support.cluster import Cluster, start_cluster
from support.pools import check_consistent, used
from support.waiting import async_wait_until, wait_until

from gpulock import AsyncPool, Pool, ResizeRefused
from gpulock.protocol.keys import pool_key

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster(server_binary):
    c = start_cluster(server_binary)
    yield c
    c.stop()


def _spread(c: Cluster, prefix: str) -> list[str]:
    """Pool names, one served by each master (in master order)."""
    return [names[0] for names in c.names_by_master(prefix)]


def _raw(c: Cluster, name: str) -> redis.Redis:
    """A plain client of the master that serves pool ``name`` (all its keys: one slot)."""
    return c.client(c.master_of(pool_key(name, "cfg")))


def _queue(r: redis.Redis, name: str) -> list[str]:
    return [t.decode() for t in r.zrange(f"gpulock:{{{name}}}:queue", 0, -1)]


async def test_async_resize_on_every_master(cluster):
    """Capacity 100. A holds 100, W waits for 30: A shrinks to 70, W is granted. A grows to
    100 (used 100: queues as ``grow:<A>``), W releases, A is granted 100. Then A holds 90 and
    B 10: A's growth to 95 waits (B may release), B's growth to 15 is refused (ResizeRefused,
    B unchanged); B releases and A is granted 95."""
    for name in _spread(cluster, "rza"):
        r = _raw(cluster, name)
        p = AsyncPool.from_url(cluster.url, name, poll_interval=60)
        try:
            await p.configure(100)
            a = await p.acquire(100, ttl=30)
            w = asyncio.create_task(p.acquire(30, ttl=30, timeout=30))
            await async_wait_until(lambda: len(_queue(r, name)) == 1, 10, "W to queue")
            await a.resize(70)
            wl = await asyncio.wait_for(w, 10)
            assert (a.amount, wl.amount) == (70, 30) and used(r, name) == 100
            check_consistent(r, name)

            grow = asyncio.create_task(a.resize(100, timeout=30))
            await async_wait_until(lambda: _queue(r, name) == [f"grow:{a.id}"], 10, "the growth")
            assert a.amount == 70 and not grow.done()
            check_consistent(r, name)
            await wl.release()
            await asyncio.wait_for(grow, 10)
            assert a.amount == 100 and used(r, name) == 100 and _queue(r, name) == []
            check_consistent(r, name)

            await a.resize(90)
            b = await p.acquire(10, ttl=30)
            grow = asyncio.create_task(a.resize(95, timeout=30))
            await async_wait_until(lambda: _queue(r, name) == [f"grow:{a.id}"], 10, "the growth")
            with pytest.raises(ResizeRefused) as ei:
                await b.resize(15)
            assert (ei.value.lease_id, ei.value.amount, ei.value.current) == (b.id, 15, 10)
            assert b.amount == 10 and not grow.done() and used(r, name) == 100
            check_consistent(r, name)
            await b.release()
            await asyncio.wait_for(grow, 10)
            assert a.amount == 95 and used(r, name) == 95
            await a.release()
            assert used(r, name) == 0
            check_consistent(r, name)
        finally:
            await p.aclose()
            r.close()


def test_sync_resize_on_every_master(cluster):
    """The same history through ``Pool`` (threads wait where the async test has tasks)."""
    for name in _spread(cluster, "rzs"):
        r = _raw(cluster, name)
        with Pool.from_url(cluster.url, name, poll_interval=60) as p:
            p.configure(100)
            a = p.acquire(100, ttl=30)
            got: list = []
            t = threading.Thread(target=lambda: got.append(p.acquire(30, ttl=30, timeout=30)))
            t.start()
            wait_until(lambda: len(_queue(r, name)) == 1, 10, "W to queue")
            a.resize(70)
            t.join(10)
            assert got and (a.amount, got[0].amount) == (70, 30) and used(r, name) == 100
            check_consistent(r, name)

            errors: list = []

            def grow_to(n: int) -> None:
                try:
                    a.resize(n, timeout=30)
                except BaseException as e:  # noqa: BLE001 - handed to the test
                    errors.append(e)

            g = threading.Thread(target=grow_to, args=(100,))
            g.start()
            wait_until(lambda: _queue(r, name) == [f"grow:{a.id}"], 10, "the growth")
            assert a.amount == 70 and g.is_alive()
            got[0].release()
            g.join(10)
            assert not g.is_alive() and not errors, errors
            assert a.amount == 100 and used(r, name) == 100 and _queue(r, name) == []
            check_consistent(r, name)

            a.resize(90)
            b = p.acquire(10, ttl=30)
            g = threading.Thread(target=grow_to, args=(95,))
            g.start()
            wait_until(lambda: _queue(r, name) == [f"grow:{a.id}"], 10, "the growth")
            with pytest.raises(ResizeRefused):
                b.resize(15)
            assert b.amount == 10 and g.is_alive() and used(r, name) == 100
            check_consistent(r, name)
            b.release()
            g.join(10)
            assert not g.is_alive() and not errors, errors
            assert a.amount == 95 and used(r, name) == 95
            a.release()
            assert used(r, name) == 0
            check_consistent(r, name)
        r.close()
