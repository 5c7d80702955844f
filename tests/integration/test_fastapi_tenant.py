"""``GpuLimiter(tenant=...)`` (the service's ``GPULOCK_TENANT``): every lease of the limiter
counts under the tenant, so the pool's quota for it caps what the service holds across its
workers: a request at the quota waits in the pool's queue though the pool has room, one over
it is a 413 with reason ``quota``; a bad tenant fails when the limiter is made. And the
limiter's pool must have one device: on a pool of several it is not ready (503 saying why)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from fastapi import FastAPI
from support.apps import Running
from support.pools import status_until

from gpulock import AsyncPool, InvalidArgument
from gpulock.fastapi import GpuLimiter

GiB = 2**30
pytestmark = pytest.mark.timeout(60)


def _app(url: str, pool: str, **kw: Any) -> tuple[FastAPI, threading.Event]:
    gpu = GpuLimiter(url, pool, capacity=8 * GiB, acquire_timeout=20, executor_threads=4, **kw)
    app = FastAPI(lifespan=gpu.lifespan)
    gate = threading.Event()

    @app.post("/hold")
    @gpu.endpoint("hold", estimate=lambda: 2 * GiB)
    def hold() -> dict:
        assert gate.wait(20), "the test never opened the gate"
        return {}

    @app.post("/big")
    @gpu.endpoint("big", estimate=lambda: 3 * GiB)
    def big() -> dict:
        return {}

    return app, gate


async def test_the_limiters_leases_count_under_its_tenant(redis_proc1):
    url, name = redis_proc1.url, "tq1"
    admin = AsyncPool.from_url(url, name)
    await admin.configure(8 * GiB, quotas={"svc-a": 2 * GiB})
    app, gate = _app(url, name, tenant="svc-a")
    try:
        async with Running(app) as c:
            r = await c.post("/big")
            assert r.status_code == 413, r.text
            assert "quota" in r.text and "svc-a" in r.text, r.text
            first = asyncio.create_task(c.post("/hold"))
            await status_until(url, name, lambda st: st.used == 2 * GiB)
            second = asyncio.create_task(c.post("/hold"))
            st = await status_until(url, name, lambda st: st.waiter_count == 1)
            assert st.free == 6 * GiB  # room in the pool, none in the tenant's quota
            assert [w.tenant for w in st.waiters] == ["svc-a"]
            assert [li.tenant for li in st.leases] == ["svc-a"]
            assert st.tenants["svc-a"].used == 2 * GiB
            other = await admin.acquire(4 * GiB, tenant="svc-b", timeout=0)  # others pass
            await other.release()
            gate.set()
            rs = await asyncio.gather(first, second)
            assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]
    finally:
        await admin.aclose()


@pytest.mark.parametrize("bad", ["a b", "x" * 65, 5])
def test_a_bad_tenant_fails_when_the_limiter_is_made(bad):
    with pytest.raises(InvalidArgument, match="tenant must be"):
        GpuLimiter("redis://127.0.0.1:1/0", "p", tenant=bad)


async def test_a_pool_of_several_devices_is_refused_not_leased_from(redis_proc1):
    """The integration runs a model on one GPU and leases without a device: on a pool of
    several devices its leases would count on GPUs it does not use, so the worker is not
    ready and answers 503 saying why, and nothing is leased."""
    url, name = redis_proc1.url, "tq2"
    admin = AsyncPool.from_url(url, name)
    await admin.configure(devices=[4 * GiB, 4 * GiB])
    app, gate = _app(url, name)
    gate.set()
    try:
        async with Running(app) as c:
            r = await c.post("/big")
            assert r.status_code == 503, r.text
            assert "has 2 devices" in r.text, r.text
            st = await admin.status()
            assert st.grants == 0 and st.used == 0
    finally:
        await admin.aclose()
