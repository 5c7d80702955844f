"""The blocking Pool after close(): an acquire raises PoolClosed at once, as AsyncPool's does
(no new background thread, no lease that nothing would renew), and nothing is written to
Redis by it."""

from __future__ import annotations

import pytest

from gpulock import Pool, PoolClosed
from support.pools import assert_empty

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("timeout", [0, None, 5])
def test_sync_acquire_after_close_raises_pool_closed(redis_proc, rclient, pool_name, timeout):
    p = Pool.from_url(redis_proc.url, pool_name, capacity=4)
    lease = p.acquire(1, ttl=30)
    lease.release()
    p.close()
    with pytest.raises(PoolClosed, match="closed before this call; nothing was queued") as ei:
        p.acquire(1, ttl=30, timeout=timeout)
    assert "left the queue" not in str(ei.value)  # it never queued
    assert p._runtime is None and p._portal is None, "close() must not be undone by a later acquire"
    p.close()  # idempotent
    assert_empty(rclient, pool_name)


def test_sync_acquire_after_close_of_an_unused_pool(redis_proc, rclient, pool_name):
    p = Pool.from_url(redis_proc.url, pool_name, capacity=4)
    p.close()
    with pytest.raises(PoolClosed, match="closed before this call; nothing was queued"):
        p.acquire(1)
    with pytest.raises(PoolClosed):
        with p.lease(1, timeout=0):
            pass
    assert_empty(rclient, pool_name)


def test_a_lease_left_when_its_pool_closed_says_so_when_found_lost(redis_proc, pool_name):
    """A held lease stops being renewed when its pool object is closed; past its deadline
    ensure_valid() names the close as the reason, not an unreachable Redis."""
    from support.waiting import wait_until

    from gpulock import LeaseLost

    p = Pool.from_url(redis_proc.url, pool_name, capacity=4)
    lease = p.acquire(1, ttl=1)
    p.close()
    wait_until(lambda: lease.lost, 10, "the lease's local deadline", interval=0.05)
    with pytest.raises(LeaseLost, match="pool object for .* was closed") as ei:
        lease.ensure_valid()
    assert "unreachable" not in str(ei.value)
