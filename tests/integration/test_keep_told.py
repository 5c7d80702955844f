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


async def test_a_holder_that_missed_the_message_gives_back_at_its_next_renewal(
    redis_proc1, pool_name
):
    """The backstop: a holder whose subscription is down when the waiter queues (the 'k'
    message is lost) learns it from its next renewal's reply (the queue length), every ttl/3
    (0.5 s here); with ``keep`` 600 s and the lease renewed all along, nothing else gives the
    bytes back within the waiter's timeout."""
    from gpulock_common.aio import stop_tasks

    holder = AsyncPool.from_url(
        redis_proc1.url, pool_name, capacity=100, keep=LONG, default_ttl=1.5, max_ttl=LONG
    )
    other = AsyncPool.from_url(redis_proc1.url, pool_name)
    try:
        await (await holder.acquire(60)).release()
        assert holder.kept()["idle"] == 1
        await stop_tasks(holder._runtime.listener.cancel())  # deaf: the message is lost
        assert not holder._runtime.listening
        lease = await other.acquire(100, timeout=30)
        assert holder.kept()["idle"] == 0 and holder.kept()["draining"]
        assert not holder._runtime.listening  # it was the renewal, not a message
        await lease.release()
    finally:
        await other.aclose()
        await holder.aclose()
