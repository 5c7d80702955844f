"""The dashboard's 503 count and ``/metrics`` count the same answers: a worker that is not ready
answers 503 from every route shape (the decorator, the Depends guard, the batcher), and each
such answer is counted once in ``gpulock_requests_total`` and once in the pool's ``rejected``
counter the dashboard shows (one place counts both)."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from fastapi import Request, Response

from gpulock.admin.samples import read_counters
from gpulock.fastapi import metrics

from .test_fastapi import _app, _Running

pytestmark = pytest.mark.timeout(60)


async def test_not_ready_503s_are_counted_alike_on_metrics_and_the_dashboard(redis_proc1):
    app, gpu, _ = _app(redis_proc1.url, "it-counts")
    b = gpu.batcher("counted", lambda items: [{"ok": True} for _ in items], estimate=lambda i: 1)

    @app.post("/b")
    async def batched(body: dict, request: Request, response: Response):
        return await b.submit(body, request=request, response=response)

    routes = {"/sync": "sync", "/run": "run", "/b": "counted"}

    def served_503() -> float:
        return sum(metrics().requests.labels(r, "503")._value.get() for r in routes.values())

    r = aioredis.from_url(redis_proc1.url)
    try:
        async with _Running(app) as c:
            base, before = served_503(), (await read_counters(r, "it-counts"))["rejected"]
            gpu.set_condition("model", False, "loading")
            for path in routes:
                ans = await c.post(path, json={})
                assert ans.status_code == 503 and "loading" in ans.text, (path, ans.text)
            assert served_503() - base == 3
            # the pool's counter is written in the background: until it got all three
            deadline = time.monotonic() + 10
            while True:
                got = (await read_counters(r, "it-counts"))["rejected"] - before
                if got >= 3 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.01)
            assert got == 3, got
    finally:
        await r.aclose()
