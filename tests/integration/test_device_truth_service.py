"""Device truth in the service (issue 18 items 1 and 3): with ``sample_device`` set, a worker's
limiter runs the device sampler (here on the fake device file), and ``/health``,
``/metrics`` and ``/dashboard/data`` show the device's external use and the over-users; the
sampler stops with the worker, and its report then expires."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.apps import Running
from support.pools import MiB
from support.waiting import async_wait_until

from gpulock import AsyncPool
from gpulock.devices import write_fake_devices

pytestmark = pytest.mark.timeout(120)

STRANGER = 4_000_000  # a pid no test process has


async def test_health_metrics_and_dashboard_show_the_device(redis_proc1, tmp_path):
    from gpulock_service.app import create_app
    from gpulock_service.settings import Settings

    f = tmp_path / "dev.json"
    other = AsyncPool.from_url(redis_proc1.url, "svc-dev")
    await other.configure(4096 * MiB)
    greedy = await other.acquire(100 * MiB, ttl=60, holder={"purpose": "greedy"})
    write_fake_devices(
        f,
        [
            {
                "index": 0,
                "total": 8192 * MiB,
                "used": 1300 * MiB,
                "processes": {str(STRANGER): 300 * MiB, str(os.getpid()): 1000 * MiB},
            }
        ],
    )
    settings = Settings(
        redis_url=redis_proc1.url,
        pool="svc-dev",
        capacity="4096MiB",
        configure="set",
        model="sleep",
        device="cpu",
        resident="64MiB",
        sleep_seconds=0.0,
        reaper_interval=0.1,
        sample_device=0,
        device_reader=f"fake:{f}",
    )
    app = create_app(settings)
    # This process (the test, and the worker in it) holds the greedy lease (100 MiB) and the
    # worker's resident lease (64 MiB) and uses 1000 MiB: 836 MiB over, past the 10% + 512 MiB
    # rule; the stranger's 300 MiB count as external, and so do the 836 MiB over the leases.
    excess = (1000 - 164) * MiB
    external = 300 * MiB + excess
    try:
        async with Running(app) as c:
            gpu = app.state.limiter
            await async_wait_until(lambda: gpu.readiness()[0], 60, "the resident lease")

            def health_shows() -> dict | None:
                st = gpu.backend.status
                return st if st is not None and st.external == external else None

            await async_wait_until(health_shows, timeout=60, what="the report in the status")
            h = (await c.get("/health")).json()["device_truth"]
            assert h["device"] == 0 and h["reader"] == "fake" and h["sampling"] is True
            assert h["external_bytes"] == external
            assert h["effective_capacity"] == 4096 * MiB - external
            assert h["report_left"] > 0

            # over-users are flagged after the sampler's 5 s hold
            async def flagged() -> bool:
                return bool((await other.status()).overusers)

            await async_wait_until(
                lambda: gpu.backend.status and gpu.backend.status.overusers, 60, "a flag"
            )
            assert await flagged()
            h = (await c.get("/health")).json()["device_truth"]
            [o] = h["overusers"]
            resident = [lz.id for lz in gpu.resident.leases]
            assert sorted(o["lease_ids"]) == sorted([greedy.id, *resident])
            assert o["excess"] == excess and o["pid"] == os.getpid()
            assert o["holder"]["host"] == socket.gethostname()

            text = (await c.get("/metrics")).text
            vals = {
                (s.name, s.labels.get("lease", "")): s.value
                for fam in text_string_to_metric_families(text)
                for s in fam.samples
                if s.labels.get("pool") == "svc-dev"
            }
            assert vals[("gpulock_device_external_bytes", "")] == external
            assert vals[("gpulock_pool_effective_capacity_bytes", "")] == 4096 * MiB - external
            [(lease_label, v)] = [
                (k[1], v) for k, v in vals.items() if k[0] == "gpulock_holder_overuse_bytes"
            ]
            assert sorted(lease_label.split(",")) == sorted(o["lease_ids"]) and v == excess

            d = (await c.get("/dashboard/data")).json()["pools"][0]
            assert d["external"] == external
            assert d["effective_capacity"] == 4096 * MiB - external
            [dv] = d["overusers"]
            assert dv["excess"] == excess and dv["holder"]["pid"] == str(os.getpid())
            assert "lease_ids" not in dv  # the dashboard never shows lease ids
        # The worker stopped: its sampler with it. The report expires (10 s) and the pool
        # grants its full capacity again.
        assert gpu.device.sampler is not None

        async def expired() -> bool:
            st = await other.status()
            return st.external == 0 and st.external_left == 0

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60  # the report counts 10 s
        while not await expired():
            assert loop.time() < deadline, "the stopped worker's report did not expire"
            await asyncio.sleep(0.05)
        assert (await other.status()).overusers == []
    finally:
        await greedy.release()
        await other.aclose()
