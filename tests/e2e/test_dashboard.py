"""The service's ``/dashboard`` (issue 15): two gunicorn workers, the sleep model, resident
leases; the page, in headless Chromium under a running load, shows what ``gpulock status
--json`` reports, the resident bytes, the 503s and OOMs; one worker samples the pool's history
into Redis; ``GPULOCK_DASHBOARD=0`` turns it off."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import httpx
import pytest
from support.browser import Browser, dom_view, pool_dom, status_view
from support.pools import GiB
from support.waiting import wait_until

from gpulock import Pool
from gpulock.protocol.keys import pool_key
from gpulock.errors import GpuLockError

MiB = 2**20
ENV = {
    "GPULOCK_MODEL": "sleep",
    "GPULOCK_SLEEP_BYTES": "512MiB",
    "GPULOCK_SLEEP_SECONDS": "0",
    "GPULOCK_RESIDENT": "256MiB",
    "GPULOCK_ACQUIRE_TIMEOUT": "0.5",
    "GPULOCK_INFERENCE_TIMEOUT": "20",
    "GPULOCK_PARK_TIMEOUT": "0",
}


@pytest.fixture(scope="module")
def svc(make_service):
    s = make_service("dash", workers=2, env=ENV, capacity=4 * GiB)
    s.wait_ready(2, timeout=120)
    return s


def status_json(svc) -> dict:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpulock",
            "--redis-url",
            svc.redis_url,
            "status",
            svc.pool,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.timeout(240)
def test_the_page_shows_the_pool_live_under_load(svc, tmp_path):
    url = svc.url
    # a 503 (no room in time) and an OOM, counted in Redis by whichever worker answered
    holder = Pool.from_url(svc.redis_url, svc.pool)
    big = holder.acquire(3 * GiB, holder={"job": "batch-a"})  # leaves 512 MiB: 2 x 256 resident
    r = httpx.post(url + "/v1/embeddings", json={"input": ["a", "b"]}, timeout=30)  # 1 GiB
    assert r.status_code == 503, r.text
    r = httpx.post(url + "/v1/embeddings", json={"input": ["oom"]}, timeout=60)
    assert r.status_code == 503 and "out of memory" in r.text
    wait_until(
        lambda: svc.status().waiter_count == 0 and svc.status().used == 3 * GiB + 512 * MiB, 10
    )
    # the running load: a held lease and a waiter that cannot fit until it goes
    waiter = Pool.from_url(svc.redis_url, svc.pool)
    got: list = []

    def wait_for_1g() -> None:
        try:
            got.append(waiter.acquire(GiB, timeout=120, holder={"job": "batch-b"}))
        except GpuLockError as e:
            got.append(e)

    th = threading.Thread(target=wait_for_1g, daemon=True)
    th.start()
    try:
        wait_until(lambda: svc.status().waiter_count == 1, 10, "the waiter")
        with Browser(tmp_path) as b:
            page = b.new_page(url + "/dashboard")
            st = status_view(status_json(svc))
            assert st["lease_count"] == 3 and st["waiter_count"] == 1
            d = wait_until(
                lambda: (x := pool_dom(page, svc.pool)) and dom_view(x) == st and x,
                30,
                f"the page to show {st}",
                interval=0.1,
            )
            assert d["stats"]["resident"] == 512 * MiB
            assert d["stats"]["rejected"] >= 2 and d["stats"]["oom"] == 1  # 503s: timeout + OOM
            assert "job=batch-a" in d["text"] and "job=batch-b" in d["text"]
            assert "512 MiB" in d["text"]  # the resident bytes, formatted by the page
            wait_until(
                lambda: (x := pool_dom(page, svc.pool)) and x["points"].get("resident", 0) >= 2,
                30,
                "two samples on the chart",
                interval=0.1,
            )
            # live: the big lease goes, the waiter is granted, the page follows
            big.release()
            wait_until(lambda: got, 30, "the waiter's grant")
            st2 = status_view(status_json(svc))
            assert st2["waiter_count"] == 0 and st2["used"] == GiB + 512 * MiB
            wait_until(
                lambda: (x := pool_dom(page, svc.pool)) and dom_view(x) == st2,
                30,
                f"the page to show {st2}",
                interval=0.1,
            )
            shot = tmp_path / "dashboard.png"
            page.screenshot(shot)
            assert shot.stat().st_size > 10_000
            if os.environ.get("GPULOCK_DASHBOARD_SCREENSHOT"):
                shutil.copy(shot, os.environ["GPULOCK_DASHBOARD_SCREENSHOT"])
        # one sampler for the two workers: the lease names one of them
        import redis

        c = redis.Redis.from_url(svc.redis_url)
        try:
            owner = c.get(pool_key(svc.pool, "sampler")).decode()
            assert int(owner.split("-")[0]) in svc.worker_pids()
            assert 2 <= c.llen(pool_key(svc.pool, "samples")) <= 900
        finally:
            c.close()
    finally:
        waiter.close()
        th.join(10)
        holder.close()
        for g in got:
            if not isinstance(g, Exception):
                g.release()


@pytest.mark.timeout(180)
def test_the_history_outlives_the_worker_that_samples_it(svc):
    import signal

    import redis

    c = redis.Redis.from_url(svc.redis_url)
    lease_key, ring = pool_key(svc.pool, "sampler"), pool_key(svc.pool, "samples")
    try:
        wait_until(lambda: c.llen(ring) >= 2, 30, "samples")
        owner = c.get(lease_key).decode()
        pid = int(owner.split("-")[0])
        assert pid in svc.worker_pids()
        oldest, n0 = c.lindex(ring, -1), c.llen(ring)
        os.kill(pid, signal.SIGKILL)
        new = wait_until(
            lambda: (o := c.get(lease_key)) is not None and o.decode() != owner and o.decode(),
            30,
            "another worker to take the sampler lease over",
        )
        assert int(new.split("-")[0]) != pid
        wait_until(lambda: c.llen(ring) >= n0 + 2, 30, "sampling to go on")
        assert c.lindex(ring, -1) == oldest  # nothing of the history was lost (< 900 samples)
        svc.wait_ready(2, timeout=120)  # gunicorn replaced the killed worker
    finally:
        c.close()


def test_the_dashboard_can_be_turned_off():
    import asyncio

    from gpulock_service.app import create_app
    from gpulock_service.settings import Settings

    async def get(app, path):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t"
        ) as c:
            return await c.get(path)

    on = create_app(Settings(model="sleep", dashboard=True))
    off = create_app(Settings(model="sleep", dashboard=False))
    assert asyncio.run(get(on, "/dashboard")).status_code == 200
    for path in ("/dashboard", "/dashboard/data", "/dashboard/dashboard.js"):
        assert asyncio.run(get(off, path)).status_code == 404
