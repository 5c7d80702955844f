"""Redis lost an idle pool (FLUSHALL; a restart without its data is the same) under pool
objects opened without a capacity, which rely on an operator's ``gpulock pool set`` (a worker
that only acquires; every pool object of the HTTP broker).

What is promised (docs/RELIABILITY.md, "Redis loses its data", step 2):
* a pool object that saw the pool makes it again at its next acquire, as the server last
  showed it (capacity, max_ttl, max_waiters, queue policy) and with a grace period, even
  when it holds nothing and waits for nothing at the loss, and even without a capacity of its
  own: its acquire is refused in the grace period (``timeout=0``) or granted after it, never
  ``PoolNotFound`` (it was, before: only a pool object given a capacity made the pool again);
* a pool object that never saw the pool and has no capacity has nothing to make it from: its
  acquire raises ``PoolNotFound`` and writes nothing.

The checks read the raw keys, not gpulock's own view.
"""

from __future__ import annotations

import pytest
import redis

from gpulock import AcquireTimeout, PoolNotFound
from gpulock.protocol.keys import pool_keys

from support.pools import check_consistent, config
from support.waiting import wait_until

from .test_restart_waiters import _Shell

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_an_idle_pool_object_without_capacity_remakes_a_flushed_pool_as_last_seen(
    redis_proc1, kind
):
    rp, name = redis_proc1, f"remake-{kind}"
    direct = redis.Redis.from_url(rp.url)
    operator = _Shell("sync", rp.url, name)
    worker = None
    try:
        operator("configure", 10, max_ttl=2, max_waiters=7, policy="backfill", backfill_window=3)
        worker = _Shell(kind, rp.url, name, default_ttl=1)  # no capacity: the operator's
        lease = worker("acquire", 4)
        if kind == "async":
            worker.loop.run_until_complete(lease.release())
        else:
            lease.release()
        seen = worker.pool._runtime.recovery  # what the pool object last saw

        def learned() -> bool:
            worker.pump()
            return seen.max_ttl_seen_ms == 2000 and seen.max_waiters_seen == 7

        wait_until(learned, timeout=5.0)
        old_epoch = config(direct, name)["epoch"]
        direct.flushall()  # no lease, no waiter: the heartbeat has nothing to recover

        # made again at once, with the grace period: nothing is granted in it
        with pytest.raises(AcquireTimeout) as refused:
            worker("acquire", 4, timeout=0)
        assert "restart grace period" in str(refused.value), str(refused.value)
        assert refused.value.grace_left > 0
        cfg = config(direct, name)
        assert cfg["epoch"] != old_epoch and cfg["grace_until"] > 0, cfg
        assert (cfg["capacity"], cfg["max_ttl_ms"], cfg["max_waiters"]) == (10, 2000, 7), cfg
        assert cfg["backfill_ms"] == 3000, cfg
        assert direct.hget(pool_keys(name)[0], "policy") == b"backfill"

        # and a wait is granted after the grace period ends (server clock)
        lease = worker("acquire", 4, timeout=30)
        raw = direct.hget(pool_keys(name)[2], lease.id)
        assert raw is not None
        assert int(raw.decode().split("|")[2]) >= cfg["grace_until"], (raw, cfg)
        if kind == "async":
            worker.loop.run_until_complete(lease.release())
        else:
            lease.release()
        assert check_consistent(direct, name) == {"used": 0, "leases": 0, "queued": 0}
    finally:
        if worker is not None:
            worker.close()
        operator.close()
        direct.close()


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_pool_object_that_never_saw_the_pool_gets_pool_not_found(redis_proc1, kind):
    rp, name = redis_proc1, f"never-{kind}"
    direct = redis.Redis.from_url(rp.url)
    operator = _Shell("sync", rp.url, name)
    fresh = _Shell(kind, rp.url, name)  # no capacity, and it never reads the pool before
    try:
        operator("configure", 10)
        direct.flushall()
        with pytest.raises(PoolNotFound):
            fresh("acquire", 4, timeout=0)
        with pytest.raises(PoolNotFound):
            fresh("acquire", 4, timeout=5)
        fresh.pump(0.1)  # let a background task (there must be none) write
        assert not direct.exists(pool_keys(name)[0])
    finally:
        fresh.close()
        operator.close()
        direct.close()
