"""Kept bytes and a waiter on another host (docs/SEMANTICS.md, "Kept bytes"): a core pool object
with ``keep=`` keeps a released lease idle; an SDK client of the broker (the other host) asks
for bytes that do not fit next to it and is granted once the holder heard of it (the ``k``
message the broker's acquire published), with no renewal or expiry of the holder's to explain
it (ttl and ``keep`` 600 s). Both SDK shells, and a grant from kept bytes afterwards once the
waiter left. Every wait is on observed state with a generous deadline."""

from __future__ import annotations

import asyncio

import pytest
import redis
from gpulock_client import AsyncPool, Pool

from gpulock import AsyncPool as CoreAsyncPool
from gpulock import Pool as CorePool
from gpulock.protocol.keys import pool_key
from support.waiting import wait_until

from ._support import USER_TOKEN

GiB = 2**30
WAIT_S = 30.0  # a generous deadline for what must happen; never a bound on its speed
LONG_S = 600.0  # the holder's ttl and keep: nothing but the 'k' message gives the bytes back
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def rc(redis_srv):
    c = redis.Redis.from_url(redis_srv.url)
    yield c
    c.close()


def _kept(rc: redis.Redis) -> str:
    v = rc.hget(pool_key("gpu-a", "cfg"), "kept")
    return v.decode() if v else ""


def test_an_sdk_waiter_gets_bytes_kept_by_a_core_pool_object(broker_srv, redis_srv, gpu, rc):
    holder = CorePool.from_url(redis_srv.url, gpu, default_ttl=LONG_S, keep=LONG_S)
    try:
        holder.configure("10GiB", max_ttl=LONG_S)
        first = holder.acquire("8GiB")
        first.release()
        assert first.id in _kept(rc) and holder.kept()["idle"] == 1
        with Pool(broker_srv.url, gpu, token=USER_TOKEN) as sdk:
            got = sdk.acquire("6GiB", timeout=WAIT_S)  # 8 kept + 6 > 10: it must be told
            assert got.token > first.token
            assert _kept(rc) == "" and holder.kept()["idle"] == 0
            assert holder.kept()["draining"]
            got.release()
        # nobody waits now: the holder's next release is kept again, the one after is local
        again = holder.acquire("8GiB")
        assert again.id != first.id  # given back, so a new lease
        again.release()
        assert again.id in _kept(rc) and not holder.kept()["draining"]
        third = holder.acquire("8GiB")
        assert third.id == again.id and third.token == again.token  # from kept bytes
        third.release()
    finally:
        holder.close()
    wait_until(lambda: _kept(rc) == "", WAIT_S, "close gives the idle kept lease back")


async def test_an_async_sdk_waiter_gets_bytes_kept_by_a_core_async_pool(
    broker_srv, redis_srv, gpu, rc
):
    holder = CoreAsyncPool.from_url(redis_srv.url, gpu, default_ttl=LONG_S, keep=LONG_S)
    try:
        await holder.configure("10GiB", max_ttl=LONG_S)
        first = await holder.acquire("8GiB")
        await first.release()
        assert first.id in _kept(rc)
        async with AsyncPool(broker_srv.url, gpu, token=USER_TOKEN) as sdk:
            got = await asyncio.wait_for(sdk.acquire("6GiB", timeout=WAIT_S), WAIT_S + 5)
            assert _kept(rc) == "" and holder.kept()["given_back"] == 1
            await got.release()
    finally:
        await holder.aclose()
