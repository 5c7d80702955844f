"""A pool's max_ttl below the service's lease ttl: the GpuLimiter leases with
min(ttl, max_ttl) instead of failing every request (and never becoming ready)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from fastapi import FastAPI

from gpulock import AsyncPool
from gpulock.fastapi import GpuLimiter, current_lease
from support.apps import Running

GiB = 2**30
pytestmark = pytest.mark.timeout(60)


_Running = Running  # the lifespan + in-process client harness (tests/support/apps.py)


async def _configure(url: str, pool: str, **kw) -> None:
    p = AsyncPool.from_url(url, pool)
    try:
        await p.configure(2 * GiB, **kw)
    finally:
        await p.aclose()


def _app(url: str, pool: str, **kw) -> tuple[FastAPI, GpuLimiter]:
    gpu = GpuLimiter(url, pool, **kw)
    app = FastAPI(lifespan=gpu.lifespan)

    def work() -> dict:
        lease = current_lease()
        assert lease is not None
        return {"ttl": lease.ttl}

    @app.post("/run")
    @gpu.endpoint("run", estimate=lambda: GiB)
    def run() -> dict:
        return work()

    return app, gpu


async def _poll(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_max_ttl_lowered_while_running_clamps_the_lease_ttl(redis_proc1, caplog):
    await _configure(redis_proc1.url, "mt1", max_ttl=60)
    app, gpu = _app(redis_proc1.url, "mt1", ttl=6, reaper_interval=0.05)
    async with _Running(app) as c:
        r = await c.post("/run")
        assert r.status_code == 200 and r.json()["ttl"] == 6
        await _configure(redis_proc1.url, "mt1", max_ttl=3)
        await _poll(lambda: gpu.backend.status is not None and gpu.backend.status.max_ttl == 3)
        with caplog.at_level(logging.WARNING, logger="gpulock.fastapi"):
            for _ in range(3):
                r = await c.post("/run")
                assert r.status_code == 200, r.text
                assert r.json()["ttl"] == 3
        warns = [x.getMessage() for x in caplog.records if "max_ttl" in x.getMessage()]
        assert len(warns) == 1 and "6" in warns[0] and "3" in warns[0] and "GPULOCK_TTL" in warns[0]


async def test_max_ttl_lowered_before_the_next_status_read_still_serves(redis_proc1):
    await _configure(redis_proc1.url, "mt2", max_ttl=60)
    app, gpu = _app(
        redis_proc1.url, "mt2", ttl=6, reaper_interval=600
    )  # no status read in the test
    async with _Running(app) as c:
        assert (await c.post("/run")).json()["ttl"] == 6
        await _configure(redis_proc1.url, "mt2", max_ttl=3)
        r = await c.post("/run")  # refused by the pool, status re-read, retried with 3 s
        assert r.status_code == 200, r.text
        assert r.json()["ttl"] == 3


async def test_service_starts_ready_under_a_max_ttl_below_the_default_ttl(redis_proc1, monkeypatch):
    from gpulock_service.app import create_app
    from gpulock_service.settings import Settings

    await _configure(redis_proc1.url, "mt3", max_ttl=20)
    settings = Settings(
        redis_url=redis_proc1.url,
        pool="mt3",
        model="sleep",
        sleep_seconds=0.0,
        sleep_bytes="1MiB",
        reaper_interval=0.05,
    )
    assert settings.ttl == 30
    app = create_app(settings)
    async with _Running(app) as c:
        ready = None
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            ready = await c.get("/ready")
            if ready.status_code == 200:
                break
            await asyncio.sleep(0.02)
        assert ready is not None and ready.status_code == 200, ready.text if ready else None
        r = await c.post("/v1/embeddings", json={"input": ["hello", "world"]})
        assert r.status_code == 200, r.text
        lim: GpuLimiter = app.state.limiter
        assert all(lz.ttl == 20 for lz in lim.resident.leases)


async def test_invalid_argument_from_acquire_is_a_json_error_not_a_bare_500(
    redis_proc1, monkeypatch
):
    from gpulock.errors import InvalidArgument

    await _configure(redis_proc1.url, "mt4", max_ttl=60)
    app, gpu = _app(redis_proc1.url, "mt4", ttl=6, reaper_interval=600)
    async with _Running(app) as c:

        async def refuse(*a, **kw):
            raise InvalidArgument("refused for the test")

        assert gpu.backend.pool is not None
        monkeypatch.setattr(gpu.backend.pool, "acquire", refuse)
        r = await c.post("/run")
        assert r.status_code == 500
        assert r.headers["content-type"].startswith("application/json"), r.text
        assert "refused for the test" in r.json()["detail"] and "mt4" in r.json()["detail"]


async def test_an_estimator_returning_a_bad_amount_is_a_json_500_naming_the_route(redis_proc1):
    """A route's estimator that returns 0 (or a negative or NaN amount) is the route's bug: a
    500 with a JSON body naming the route and the value, not a bare 'Internal Server Error';
    nothing is leased."""
    await _configure(redis_proc1.url, "mt5", max_ttl=60)
    gpu = GpuLimiter(redis_proc1.url, "mt5", ttl=6, reaper_interval=600)
    app = FastAPI(lifespan=gpu.lifespan)

    @app.post("/bad/{n}")
    @gpu.endpoint("bad", estimate=lambda n: float(n))
    def bad(n: str) -> dict:
        return {"ran": True}

    async with _Running(app) as c:
        for n in ("0", "-5", "nan"):
            r = await c.post(f"/bad/{n}")
            assert r.status_code == 500, (n, r.text)
            assert r.headers["content-type"].startswith("application/json"), r.text
            body = r.json()
            assert "'bad'" in body["detail"] and "estimate" in body["detail"], body
        assert gpu.backend.pool is not None
        assert (await gpu.backend.pool.status()).used == 0
