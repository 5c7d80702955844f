"""The per-pool commands that are not scripts touch only their pool's shard: a real Redis
Cluster (3 masters, no replicas, so a fault lasts until healed), started once for this module.
Each test stops one master with SIGSTOP (connections succeed, replies never come): the master
of slot 0, redis-py's "default" node, and resumes it in a ``finally``.

* ``gpulock pool delete`` (:func:`gpulock.admin.pools.delete_pool`, :func:`adelete_pool`) of a pool
  on another master is done at once: it asks only the pool's master (it scanned every master
  through redis-py's cluster client and waited the hung one's socket timeout, then failed);
* the dashboards' sampler (:class:`gpulock.admin.samples.Sampler`) keeps recording the other pools'
  samples (a round sampled the pools one after another, each call of the hung pool waiting
  its socket timeout, and redis-py's asyncio client then re-read the cluster by its hung
  default node before every later call);
* the FastAPI layer's idempotency store, calibration and back-off keys of a pool on another
  master are read and written at once (through redis-py's asyncio cluster client a call of the
  hung pool's made every later call of the client wait for the hung default node).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from support.cluster import Cluster, masters_now, start_cluster
from support.procs import proc_state
from support.waiting import wait_until

from gpulock import AsyncPool, Pool
from gpulock.admin.pools import adelete_pool, delete_pool
from gpulock._async import _CLIENT_DEFAULTS
from gpulock.transport.connect import async_client, sync_client
from gpulock.protocol.keys import pool_key
from gpulock.admin.samples import Sampler, read_samples

pytestmark = pytest.mark.timeout(120)

#: Seconds a command of a healthy shard may take while another master hangs (the clients'
#: socket timeout is 5 s: a command that waited for the hung master takes longer; with the
#: idempotency store's 1 s timeout such a command fails instead). 3.5 s, not 1.5 s: what the
#: bound tells apart is waiting for the hung master or not, and a loaded machine took more.
PROMPT_S = 3.5


@pytest.fixture(scope="module")
def cluster(default_binary) -> Iterator[Cluster]:
    c = start_cluster(default_binary, masters=3, replicas=0, node_timeout_ms=1000)
    try:
        yield c
    finally:
        c.stop()


def hung_name(c: Cluster) -> str:
    """A pool name on the master of slot 0 (the one :func:`hung` stops)."""
    return c.names_by_master("hung-")[c.masters.index(masters_now(c)[0])][0]


@contextmanager
def hung(c: Cluster) -> Iterator[None]:
    """The master of slot 0 stopped (SIGSTOP) while the block runs, resumed after it."""
    node = masters_now(c)[0]
    c.pause(node)
    try:
        wait_until(lambda: proc_state(node.pid) == "T", 10, "the master to stop")
        yield
    finally:
        c.resume(node)
        c.wait_ok()


def healthy(c: Cluster, prefix: str) -> list[str]:
    """A pool name on each master but the one of slot 0."""
    hang = c.masters.index(masters_now(c)[0])
    return [ns[0] for i, ns in enumerate(c.names_by_master(prefix)) if i != hang]


def configure(c: Cluster, *names: str) -> None:
    for n in names:
        with Pool.from_url(c.url, n) as p:
            p.configure(100)


def test_pool_delete_asks_only_the_pools_master(cluster):
    names = healthy(cluster, "del-")
    configure(cluster, *names)
    rest = pool_key(names[0], "res:x")  # a key the delete finds by SCAN
    cluster.client(cluster.master_of(rest)).set(rest, "1")

    async def main() -> None:
        r = sync_client(cluster.url, **_CLIENT_DEFAULTS)
        ar = async_client(cluster.url, **_CLIENT_DEFAULTS)
        try:
            r.ping()  # both clients have read the slot map
            await ar.ping()
            with hung(cluster):
                t0 = time.monotonic()
                assert delete_pool(r, names[0]).state == "deleted"
                assert (await adelete_pool(ar, names[1])).state == "deleted"
                assert time.monotonic() - t0 < PROMPT_S
                assert cluster.client(cluster.master_of(rest)).exists(rest) == 0
        finally:
            r.close()
            await ar.aclose()

    asyncio.run(main())


def test_the_sampler_records_the_other_pools_while_a_shard_hangs(cluster):
    names = healthy(cluster, "smp-")
    configure(cluster, *names)
    stuck = hung_name(cluster)

    async def main() -> None:
        ar = async_client(cluster.url, **_CLIENT_DEFAULTS)
        pools = {n: AsyncPool(ar, n) for n in (stuck, *names)}
        try:
            for n in names:
                await pools[n].status()  # the client has read the slot map

            async def status(n: str, limit: int):
                return await pools[n].status(limit=limit)

            async def listed() -> list[str]:
                return [stuck, *names]  # the hung pool first

            with hung(cluster):
                sampler = Sampler(ar, listed, status, interval=0.2)
                task = asyncio.get_running_loop().create_task(sampler.run())
                t0 = time.monotonic()
                try:
                    while True:
                        counts = [len(await read_samples(ar, n)) for n in names]
                        if min(counts) >= 3:
                            break
                        assert time.monotonic() - t0 < 2 * PROMPT_S, counts
                        await asyncio.sleep(0.05)
                finally:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
        finally:
            for p in pools.values():
                await p.aclose()
            await ar.aclose()

    asyncio.run(main())


def test_the_idempotency_store_of_a_healthy_pool_answers_while_a_shard_hangs(cluster):
    from gpulock.fastapi._backend import Backend
    from gpulock.fastapi._idempotency import MISSING, RequestStore

    name = healthy(cluster, "idem-")[0]
    stuck = hung_name(cluster)

    async def main() -> None:
        # a 1 s socket timeout: a command of the hung pool fails within the test's time
        ar = async_client(cluster.url, **{**_CLIENT_DEFAULTS, "socket_timeout": 1.0})
        mine, theirs = Backend(name), Backend(stuck)
        mine.redis = theirs.redis = ar
        store = RequestStore(None, mine, None, None, None)  # type: ignore[arg-type]
        try:
            assert await store.claim("rq.a", "fp")  # the client has read the slot map
            with hung(cluster):
                with pytest.raises(Exception):  # noqa: B017 - the hung pool's: a timeout
                    await RequestStore(None, theirs, None, None, None).held("rq.x")  # type: ignore[arg-type]
                t0 = time.monotonic()
                assert await store.claim("rq.b", "fp")
                assert not await store.held("rq.b")
                assert await store.get("rq.b", "fp", "b") is MISSING
                await store.unclaim("rq.b")
                assert time.monotonic() - t0 < PROMPT_S
        finally:
            await ar.aclose()

    asyncio.run(main())
