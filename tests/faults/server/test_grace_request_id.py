"""A request with an ``X-Request-ID`` follows the grace rule too (docs/RELIABILITY.md, "Redis
loses its data"): when its ``acquire_timeout`` ends before the pool's restart grace period
does, it is answered 503 at once, saying it is the grace period, with Retry-After to its end,
as a request without the header is, instead of waiting its whole timeout for nothing. Its job
keeps its place (it is parked), and a retry with the same id, on this worker (it joins the
job) or on another (it follows the owner's claim), is answered at once the same way.
Checked on a real server restarted empty, under :class:`gpulock.fastapi.GpuLimiter` apps."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest
from fastapi import FastAPI

from gpulock import Pool
from gpulock.fastapi import GpuLimiter
from support.apps import one_route_app
from support.pools import GiB, status_once

pytestmark = pytest.mark.timeout(90)

G = 40.0  # the pool's max_ttl: the grace period after the restart
# The requests' acquire_timeout, well inside the grace period. An answer "at once" is one in
# under half of it: 8 s (it was 3) leaves a loaded machine 4 s to answer, and a request that
# waited its timeout for nothing still fails the check.
TIMEOUT = 8.0


def _app(url: str, pool: str) -> tuple[FastAPI, GpuLimiter]:
    return one_route_app(
        url,
        pool,
        ttl=2,
        acquire_timeout=TIMEOUT,
        park_timeout=2,
        reaper_interval=0.1,
    )


async def _sees_grace(gpu: GpuLimiter) -> None:
    deadline = time.monotonic() + 10
    while not (
        gpu.backend.status is not None and gpu.backend.status.grace_left > 0
    ):  # its status read saw it
        assert time.monotonic() < deadline, "the limiter never saw the grace period"
        await asyncio.sleep(0.02)


async def _post(c: httpx.AsyncClient, url: str, name: str, **kw) -> tuple[httpx.Response, float]:
    """POST /sync; check the answer is the grace period's 503, given at once."""
    t0 = time.monotonic()
    r = await c.post("/sync", json={}, **kw)
    elapsed = time.monotonic() - t0
    left = (await status_once(url, name)).grace_left
    assert r.status_code == 503, r.text
    assert elapsed < TIMEOUT / 2, (elapsed, r.text)  # it did not wait its timeout for nothing
    assert "restart grace period" in r.json()["detail"], r.text
    assert "no GPU memory for" not in r.json()["detail"], r.text  # 4 GiB are free
    assert G - 10 < left <= G, left
    assert int(r.headers["retry-after"]) >= math.floor(left) - 1, (r.headers, left)
    return r, elapsed


async def test_a_request_id_in_the_grace_period_is_answered_at_once(redis_proc1):
    rp, name = redis_proc1, "graced-rid"
    op = Pool.from_url(rp.url, name)
    op.configure(4 * GiB, max_ttl=G)
    op.close()
    app, gpu = _app(rp.url, name)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30
        ) as c:
            assert (await c.post("/sync", json={})).status_code == 200  # the limiter saw the pool
            rp.restart()
            await _sees_grace(gpu)

            await _post(c, rp.url, name)  # without the header: the rule as it landed
            h = {"X-Request-ID": "rid-in-the-grace"}
            r, _ = await _post(c, rp.url, name, headers=h)
            assert "keeps its place" in r.json()["detail"], r.text  # parked, as before
            assert (await status_once(rp.url, name)).waiter_count == 1  # its place is kept
            # a retry with the same id joins the parked job: answered at once the same way
            r, _ = await _post(c, rp.url, name, headers=h)
            assert (await status_once(rp.url, name)).waiter_count == 1


async def test_a_request_id_following_another_worker_in_the_grace_is_answered_at_once(
    redis_proc1,
):
    rp, name = redis_proc1, "graced-rid-follow"
    op = Pool.from_url(rp.url, name)
    op.configure(4 * GiB, max_ttl=G)
    op.close()
    app_a, gpu_a = _app(rp.url, name)
    app_b, gpu_b = _app(rp.url, name)
    async with app_a.router.lifespan_context(app_a), app_b.router.lifespan_context(app_b):
        async with (
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app_a), base_url="http://a", timeout=30
            ) as a,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app_b), base_url="http://b", timeout=30
            ) as b,
        ):
            assert (await a.post("/sync", json={})).status_code == 200
            assert (await b.post("/sync", json={})).status_code == 200
            rp.restart()
            await _sees_grace(gpu_a)
            await _sees_grace(gpu_b)

            h = {"X-Request-ID": "rid-followed-in-the-grace"}
            await _post(a, rp.url, name, headers=h)  # worker a owns it; its job stays queued
            assert (await status_once(rp.url, name)).waiter_count == 1
            # worker b follows a's claim: answered at once too, the place still kept
            r, _ = await _post(b, rp.url, name, headers=h)
            assert "keeps its place" in r.json()["detail"], r.text
            assert (await status_once(rp.url, name)).waiter_count == 1
