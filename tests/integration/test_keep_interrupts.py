"""A release interrupted on a keeping pool object (a cancellation, Ctrl-C) leaves nothing
stranded (README "No leak"; docs/SEMANTICS.md "Kept bytes"): a release in ``keep`` mode that
the server ran (and kept) but whose reply the holder never read is ended by a plain release in
the background, so a waiter is granted at once, not at the lease's expiry. The leases' ttl is
60 s and the waiter's timeout 10 s: only that release can grant it in time. Found by a
fresh-user trial (a cancelled ``release()`` stranded the bytes for a whole ttl)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from gpulock import AsyncPool, Pool
from gpulock.errors import LeaseLost
from gpulock.protocol.keys import pool_keys
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

TTL = 60.0
WAIT_S = 10.0  # a generous deadline for what must happen; never a bound on its speed


def _kept_and_used(url: str, name: str) -> tuple[bytes | None, int]:
    c = redis.Redis.from_url(url)
    try:
        kept, used = c.hmget(pool_keys(name)[0], "kept", "used")
        return kept, int(used or 0)
    finally:
        c.close()


@pytest.mark.parametrize("yields", range(8))
async def test_a_cancelled_release_strands_nothing(redis_proc1, pool_name, yields):
    """The release task is cancelled after ``yields`` turns of the loop: wherever that lands
    (before the call, with it on the wire, with its reply unread), a waiter for the whole pool
    is granted within its timeout."""
    holder = AsyncPool.from_url(redis_proc1.url, pool_name, capacity=10, keep=TTL, default_ttl=TTL)
    other = AsyncPool.from_url(redis_proc1.url, pool_name)
    try:
        lease = await holder.acquire(4)
        t = asyncio.ensure_future(lease.release())
        for _ in range(yields):
            await asyncio.sleep(0)
        t.cancel()
        try:
            await t
        except asyncio.CancelledError:
            pass
        if not lease.released:  # cancelled before it began: the holder still holds it
            await lease.release()
        got = await other.acquire(10, timeout=WAIT_S)  # the whole pool: nothing stranded
        await got.release()
    finally:
        await other.aclose()
        await holder.aclose()
    assert _kept_and_used(redis_proc1.url, pool_name) == (None, 0)


async def test_a_keep_release_cancelled_after_the_server_kept_it(redis_proc1, pool_name):
    """Deterministic: the keep-mode release runs on the server (the lease is listed as kept),
    then the caller's task is cancelled before the reply is read."""
    holder = AsyncPool.from_url(redis_proc1.url, pool_name, capacity=10, keep=TTL, default_ttl=TTL)
    other = AsyncPool.from_url(redis_proc1.url, pool_name)
    real = holder._eval_once

    async def ran_then_cancelled(name: str, args: list[str]) -> Any:
        r = await real(name, args)
        if name == "release" and "keep" in args:
            raise asyncio.CancelledError()
        return r

    try:
        lease = await holder.acquire(4)
        holder._eval_once = ran_then_cancelled  # type: ignore[method-assign]
        with pytest.raises(asyncio.CancelledError):
            await lease.release()
        holder._eval_once = real  # type: ignore[method-assign]
        assert lease.released and holder.kept()["idle"] == 0
        got = await other.acquire(10, timeout=WAIT_S)
        await got.release()
    finally:
        await other.aclose()
        await holder.aclose()
    assert _kept_and_used(redis_proc1.url, pool_name) == (None, 0)


def test_a_keep_release_interrupted_after_the_server_kept_it_sync(redis_proc1, pool_name):
    """The blocking shell: Ctrl-C (KeyboardInterrupt) after the server kept the lease, before
    the reply was read: the background release ends it."""
    holder = Pool.from_url(redis_proc1.url, pool_name, capacity=10, keep=TTL, default_ttl=TTL)
    other = Pool.from_url(redis_proc1.url, pool_name)
    real = holder._eval_once

    def ran_then_interrupted(name: str, args: list[str]) -> Any:
        r = real(name, args)
        if name == "release" and "keep" in args:
            raise KeyboardInterrupt()
        return r

    try:
        lease = holder.acquire(4)
        holder._eval_once = ran_then_interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            lease.release()
        holder._eval_once = real  # type: ignore[method-assign]
        assert lease.released and holder.kept()["idle"] == 0
        with other.acquire(10, timeout=WAIT_S):
            pass
    finally:
        other.close()
        holder.close()
    wait_until(
        lambda: _kept_and_used(redis_proc1.url, pool_name) == (None, 0), WAIT_S, "nothing left"
    )


def test_a_sync_pool_s_kept_counts_outlive_close(redis_proc1, pool_name):
    """``Pool.kept()`` counts since the pool object was made, also after ``close()`` (as
    ``AsyncPool.kept()`` does); a resize of a released lease gives no kept bytes back."""
    holder = Pool.from_url(redis_proc1.url, pool_name, capacity=10, keep=TTL, default_ttl=TTL)
    try:
        first = holder.acquire(4)
        first.release()  # kept
        with holder.acquire(4):  # from kept bytes
            pass
        with pytest.raises(LeaseLost):
            first.resize(6)  # released: LeaseLost, and the idle kept lease stays
        assert holder.kept()["idle"] == 1 and holder.kept()["given_back"] == 0
    finally:
        holder.close()
    counts = holder.kept()
    assert counts["grants"] == 1 and counts["kept"] == 1 and counts["given_back"] == 1
