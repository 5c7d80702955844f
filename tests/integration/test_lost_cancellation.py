"""A background loop whose cancellation a Redis call lost still stops: the FastAPI limiter's
reaper and the broker's pool sampler (a pool's heartbeat ends by itself once closed).

redis-py's asyncio client (with a socket timeout, as gpulock always sets) loses a cancellation
that lands in the iteration a command's send completes in, on Python < 3.12 (see
``gpulock_common.aio``). Each test makes one of those loops lose its first cancellation at an
observed point (its Redis call done, the cancel caught and dropped, as redis-py does) and checks
that stopping returns: a single ``cancel(); await task`` waits forever there."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from gpulock import AsyncPool
from gpulock.fastapi import GpuLimiter

pytestmark = pytest.mark.timeout(60)


def _losing(real, state: dict):
    """``real`` (a coroutine function) that, once, loses the cancellation that reaches it
    after the real call returned."""

    async def call(*a, **kw):
        out = await real(*a, **kw)
        if not state.get("swallowed"):
            state["parked"] = True
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                state["swallowed"] = True
        return out

    return call


async def _until(pred, what: str) -> None:
    for _ in range(20_000):
        if pred():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


async def _stops(aw) -> None:
    t = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({t}, timeout=20)
    assert done, "stopping hung on a loop whose cancellation was lost"
    t.result()


async def test_limiter_stops_when_the_reaper_lost_its_cancellation(redis_proc1):
    gpu = GpuLimiter(redis_proc1.url, "lostcancel1", capacity="1GiB", reaper_interval=0.01)
    FastAPI(lifespan=gpu.lifespan)
    await gpu.start()
    state: dict = {}
    gpu.reaper.tick = _losing(gpu.reaper.tick, state)
    await _until(lambda: state.get("parked"), "a reaper tick done")
    await _stops(gpu.stop())
    assert state["swallowed"]


async def test_broker_stops_when_its_sampler_lost_its_cancellation(redis_proc1):
    from gpulock_broker.auth import parse_tokens
    from gpulock_broker.core import Broker

    r = aioredis.from_url(redis_proc1.url)
    await AsyncPool(r, "lostcancel2").configure("1GiB")
    tokens = parse_tokens({"tokens": [{"token": "t" * 32, "admin": True}]}, "test")
    core = Broker(redis_proc1.url, tokens)
    state: dict = {}
    core.status = _losing(core.status, state)  # what the dashboard's sampler reads
    await core.start()
    await _until(lambda: state.get("parked"), "a sampler read done")
    await _stops(core.aclose())
    assert state["swallowed"]
    await r.aclose()
