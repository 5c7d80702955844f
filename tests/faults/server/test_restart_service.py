"""Redis restarted empty (kill -9, a new server on the same port) under the service's limiters
(issue 9 item 1): two services on one Redis, 4 + 2 workers, the second having set the pool's
capacity. Each worker is a :class:`gpulock.fastapi.GpuLimiter` with a resident lease and the
background status read every ``reaper_interval``, as in ``gpulock serve``; here they run in one
process (one event loop), which is what a worker is to the core.

Promised (docs/RELIABILITY.md, "Redis loses its data"): every live lease is put back with its
id and token within a renewal interval — here long before it, since a status read sees the
restart first — the pool is made again with the capacity the operator set and with the grace
period in force, and no worker loses its resident lease.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from gpulock.protocol.keys import pool_keys
from gpulock.fastapi import GpuLimiter
from support.pools import MiB, holder_tokens

pytestmark = pytest.mark.timeout(60)


async def test_two_services_put_every_resident_lease_back(redis_proc1):
    rp, name = redis_proc1, "svc-restart"
    direct = redis.Redis.from_url(rp.url)
    # Service A: 4 workers with serve's CPU default capacity, create-only. Service B: 2 workers
    # started with --capacity 1GiB, which sets the pool's capacity. ttl 30 s: the heartbeat is
    # due 10 s after each grant, the status read every 0.1 s.
    a = [
        GpuLimiter(
            rp.url,
            name,
            capacity="2GiB",
            configure="create",
            ttl=30,
            reaper_interval=0.1,
            exit_on_fatal=False,
        )
        for _ in range(4)
    ]
    b = [
        GpuLimiter(
            rp.url,
            name,
            capacity="1GiB",
            configure="set",
            ttl=30,
            reaper_interval=0.1,
            exit_on_fatal=False,
        )
        for _ in range(2)
    ]
    workers = a + b
    lost: list[str] = []
    try:
        for w in workers:
            await w.start()
        for w in workers:
            lz = await w.acquire_resident(100 * MiB)
            lz.on_lost(lambda lz: lost.append(lz._state.lost_reason))
        before = holder_tokens(direct, name)
        assert len(before) == 6 and int(direct.hget(pool_keys(name)[0], "capacity")) == 1 << 30
        old_epoch = int(direct.hget(pool_keys(name)[0], "epoch"))

        rp.restart()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 8.0:  # the heartbeats are ~10 s away
            if lost or holder_tokens(direct, name) == before:
                break
            await asyncio.sleep(0.02)
        back_s = time.monotonic() - t0
        assert not lost, f"resident leases lost instead of put back: {lost}"
        assert holder_tokens(direct, name) == before, "not every lease was put back with its token"
        cfg = {k.decode(): v.decode() for k, v in direct.hgetall(pool_keys(name)[0]).items()}
        assert int(cfg["epoch"]) != old_epoch
        assert int(cfg["capacity"]) == 1 << 30, (
            f"the operator's capacity was lost: {cfg['capacity']}"
        )
        st = await a[0].backend.pool.status()
        assert st.grace_left > 0 and st.reasserted == 6, st
        await asyncio.sleep(0.3)  # a few status reads later: everyone still ready, nothing lost
        assert not lost
        for w in workers:
            ok, details = w.readiness()
            assert ok, details
        print(
            f"\n6 resident leases put back {back_s * 1000:.0f} ms after the restart; capacity "
            f"{int(cfg['capacity']) >> 20} MiB; grace {st.grace_left:.1f}s left"
        )
    finally:
        for w in workers:
            await w.stop(grace_s=1)
        direct.close()
