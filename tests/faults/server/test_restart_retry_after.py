"""Retry-After right after Redis restarted empty (kill -9, a new server on the same port),
under a :class:`gpulock.fastapi.GpuLimiter` app (docs/SERVICE.md, "Retry-After").

Nothing is granted in the grace period that follows the restart (one ``max_ttl``), so a 503
must not tell the client to come back before it ends: Retry-After is at least the time left in
the grace period (it said 1–3 s with 40–47 s left). A parked request (``X-Request-ID``) whose
``park_timeout`` is shorter than the grace keeps its place until the grace ends and
``park_timeout`` after, so the retry sent after Retry-After collects its result.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from gpulock import Pool
from support.apps import one_route_app
from support.pools import GiB, status_once

pytestmark = pytest.mark.timeout(60)

GRACE = 6.0  # the pool's max_ttl, set by the operator: the grace period after a restart


async def test_retry_after_covers_the_grace_period_and_a_parked_request_keeps_its_place(
    redis_proc1,
):
    import httpx

    rp, name = redis_proc1, "ra-grace"
    op = Pool.from_url(rp.url, name)
    op.configure(4 * GiB, max_ttl=GRACE)  # `gpulock pool set ra-grace --max-ttl 6`
    op.close()
    app, gpu = one_route_app(
        rp.url, name, ttl=2, acquire_timeout=0.5, park_timeout=2, reaper_interval=0.1
    )
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=30
        ) as c:
            assert (await c.post("/sync", json={})).status_code == 200
            rp.restart()
            deadline = time.monotonic() + 10
            while not (
                gpu.backend.status is not None and gpu.backend.status.grace_left > 0
            ):  # the limiter saw it
                assert time.monotonic() < deadline, "the limiter never saw the grace period"
                await asyncio.sleep(0.02)

            r = await c.post("/sync", json={})  # withdrawn at its 503
            left = (await status_once(rp.url, name)).grace_left
            assert r.status_code == 503, r.text
            assert int(r.headers["retry-after"]) >= math.floor(left) >= 3, (r.headers, left)
            # it says why: the grace period, not a lack of memory (4 GiB are free)
            assert "restart grace period" in r.json()["detail"], r.text
            assert "no GPU memory for" not in r.json()["detail"], r.text
            assert gpu.backend.grace()["active"] and 0 < gpu.backend.grace()["left"] <= GRACE, (
                gpu.backend.grace()
            )

            h = {"X-Request-ID": "parked-through-the-grace"}
            r = await c.post("/sync", json={}, headers=h)
            left = (await status_once(rp.url, name)).grace_left
            assert r.status_code == 503, r.text
            assert "keeps its place" in r.json()["detail"]
            ra = int(r.headers["retry-after"])
            assert ra >= math.floor(left) >= 2, (r.headers, left)  # longer than park_timeout / 2

            # The place outlasts park_timeout (2 s) while the grace (6 s) runs: the request
            # is granted when the grace ends, and the retry collects its result.
            deadline = time.monotonic() + 15
            while True:
                st = await status_once(rp.url, name)
                if st.grace_left == 0 and st.grants >= 1 and st.used == 0 and st.waiter_count == 0:
                    break
                assert st.grants >= 1 or st.waiter_count == 1 or st.grace_left > 0, (
                    f"the parked request left the queue before the grace ended: {st}"
                )
                assert time.monotonic() < deadline, st
                await asyncio.sleep(0.05)
            r = await c.post("/sync", json={}, headers=h)
            assert r.status_code == 200 and r.headers.get("x-idempotent-replay") == "true", (
                r.status_code,
                r.headers,
            )
