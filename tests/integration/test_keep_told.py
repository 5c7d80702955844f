"""A keeping pool object hears the server's 'k' message (lua/lib.lua tell_kept) for every kept
lease, not only for those it listens on for asks to yield: a kept lease acquired with
``preemptible=False`` is given back the moment a request does not fit, not at the holder's
next renewal (ttl/3) or after its ``keep`` seconds. Both shells; the ttl and ``keep`` here are
600 s, so a grant within the waiter's timeout can only come from the message."""

from __future__ import annotations

import pytest

from gpulock import AsyncPool, Pool

pytestmark = pytest.mark.timeout(90)

LONG = 600.0  # the holder's ttl and keep: no renewal and no expiry of idle kept bytes in a test


@pytest.mark.parametrize("preemptible", [True, False])
def test_sync_holder_gives_kept_bytes_back_when_told(redis_proc1, pool_name, preemptible):
    holder = Pool.from_url(redis_proc1.url, pool_name, capacity=100, keep=LONG, default_ttl=LONG)
    other = Pool.from_url(redis_proc1.url, pool_name)
    try:
        holder.acquire(60, preemptible=preemptible).release()
        assert holder._bg is not None and holder._bg.rt.kept.counts()["idle"] == 1
        with other.acquire(100, timeout=30):  # it does not fit: the holder is told
            pass
        assert holder._bg.rt.kept.counts()["idle"] == 0
    finally:
        other.close()
        holder.close()


@pytest.mark.parametrize("preemptible", [True, False])
async def test_async_holder_gives_kept_bytes_back_when_told(redis_proc1, pool_name, preemptible):
    holder = AsyncPool.from_url(
        redis_proc1.url, pool_name, capacity=100, keep=LONG, default_ttl=LONG
    )
    other = AsyncPool.from_url(redis_proc1.url, pool_name)
    try:
        await (await holder.acquire(60, preemptible=preemptible)).release()
        assert holder._runtime.kept.counts()["idle"] == 1
        lease = await other.acquire(100, timeout=30)
        await lease.release()
        assert holder._runtime.kept.counts()["idle"] == 0
    finally:
        await other.aclose()
        await holder.aclose()
