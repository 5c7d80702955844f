"""The OOM back-off (docs/SEMANTICS.md, "Back-off on OOM") on a served route against a real
Redis, with injected CUDA OOMs: a bucket's estimate rises and the pool's factor shrinks, both
seen by a second worker (a second limiter on the same pool), repeated OOMs shrink how much of
the capacity is granted down to the floor, and both come back after clean calls / time.
CPU only: the OOM is the message ``gpulock.cuda.is_oom`` classifies, raised by the route."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time

import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families
from support.apps import Running

from gpulock import AsyncPool
from gpulock.http.access_log import ACCESS_LOGGER, AccessLog
from gpulock.fastapi import GpuLimiter, current_lease
from gpulock.oom_backoff import BackoffRule

MiB, GiB = 2**20, 2**30
pytestmark = pytest.mark.timeout(60)
BUCKET = "embed|b4|s16"  # the bucket of batch 3 (→ 4) × 10 tokens (→ 16)


def formula(batch: int, tokens: int) -> int:
    """100 MiB per sequence: the routes ask for 3 × 10 → 300 MiB."""
    return batch * 100 * MiB


def _app(url: str, pool: str, rule: BackoffRule | None, gate: threading.Event | None = None):
    gpu = GpuLimiter(
        url, pool, capacity=4 * GiB, configure="set", oom_backoff=rule, executor_threads=4
    )
    app = FastAPI(lifespan=gpu.lifespan)
    app.add_middleware(AccessLog, log_format="json")
    seen: dict = {"amounts": []}

    @app.post("/embed")
    @gpu.endpoint("embed", estimate=lambda body: gpu.estimate("embed", 3, 10, formula))
    def embed(body: dict) -> dict:
        lease = current_lease()
        assert lease is not None
        seen["amounts"].append(lease.amount)
        if body.get("oom"):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if body.get("wait") and gate is not None:
            assert gate.wait(30)
        return {"ok": True}

    @app.get("/metrics")
    async def m():
        return await gpu.metrics_response()

    return app, gpu, seen


async def _until(pred, what: str, timeout: float = 10.0):
    """Await ``pred()`` (a coroutine function) until it is truthy; its value."""
    deadline = time.monotonic() + timeout
    while True:
        v = await pred()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def _sees(gpu: GpuLimiter, factor: float, scale: float) -> bool:
    await gpu.backoff.refresh()
    return gpu.backoff.factor() == pytest.approx(factor) and gpu.backoff.scale(
        BUCKET
    ) == pytest.approx(scale)


async def test_an_oom_raises_the_bucket_and_shrinks_the_pool_for_every_worker(redis_proc1, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    rule = BackoffRule(episode_s=60.0, capacity_every_s=3600.0)
    app_a, a, seen_a = _app(redis_proc1.url, "bo1", rule)
    app_b, b, seen_b = _app(redis_proc1.url, "bo1", rule)
    async with Running(app_a) as ca, Running(app_b) as cb:
        assert (await cb.post("/embed", json={})).status_code == 200
        assert seen_b["amounts"] == [300 * MiB]  # the formula: no back-off yet
        r = await ca.post("/embed", json={"oom": True})
        assert r.status_code == 503 and r.json()["detail"].startswith("the GPU ran out")
        # worker A's cache and Redis hold the new state; worker B sees it at its next read
        await _until(lambda: _sees(a, 0.8, 1.5), "worker A's back-off")
        await _until(lambda: _sees(b, 0.8, 1.5), "worker B's back-off")
        raw = await a.backend.redis.hgetall("gpulock:{bo1}:backoff")
        assert set(raw) == {b"pool", b"b:" + BUCKET.encode()}
        # B's next request: the estimate × 1.5 (450 MiB), leased / 0.8 (562.5 MiB)
        assert (await cb.post("/embed", json={})).status_code == 200
        assert seen_b["amounts"][-1] == math.ceil(math.ceil(300 * MiB * 1.5) / 0.8)
        # its access line says the bytes leased, not the estimate before the factor
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == ACCESS_LOGGER]
        embeds = [x for x in lines if x["path"] == "/embed" and x["status"] == 200]
        assert embeds[-1]["lease_bytes"] == seen_b["amounts"][-1]
        # a second OOM in the same episode (60 s here) changes nothing
        assert (await cb.post("/embed", json={"oom": True})).status_code == 503
        await _until(lambda: _sees(b, 0.8, 1.5), "worker B unchanged")
        assert (await a.backend.redis.hget("gpulock:{bo1}:backoff", "pool")).startswith(b"0.8 ")
        # the state is visible: status JSON and metrics
        assert a.backoff.state() == {"enabled": True, "factor": 0.8, "scales": {BUCKET: 1.5}}
        text = (await ca.get("/metrics")).text
        vals = {
            (s.name, s.labels.get("bucket")): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.labels.get("pool") == "bo1"
        }
        assert vals[("gpulock_oom_backoff_factor", None)] == 0.8
        assert vals[("gpulock_estimate_scale", BUCKET)] == 1.5


async def test_clean_calls_and_time_bring_both_back(redis_proc1):
    # short steps so that the recovery is seen in a test: 2 clean calls per -0.25 of scale,
    # +0.1 of factor per 0.2 s without an OOM
    rule = BackoffRule(
        estimate_every=2, estimate_down=0.25, capacity_step=0.1, capacity_every_s=0.2, episode_s=0
    )
    app_a, a, _ = _app(redis_proc1.url, "bo2", rule)
    app_b, b, seen_b = _app(redis_proc1.url, "bo2", rule)
    async with Running(app_a) as ca, Running(app_b) as cb:
        assert (await ca.post("/embed", json={"oom": True})).status_code == 503
        await _until(lambda: _scale_is(b, 1.5), "B sees the OOM")
        # the factor comes back by time alone, in steps, to 1 and no further
        await _until(lambda: _factor_is(a, 1.0), "the factor back at 1")
        # the scale comes back by clean calls of the bucket, whichever worker makes them
        for _ in range(2):
            assert (await cb.post("/embed", json={})).status_code == 200
        await _until(lambda: _scale_is(a, 1.25), "A sees B's clean calls")
        assert (await ca.post("/embed", json={})).status_code == 200
        assert (await cb.post("/embed", json={})).status_code == 200
        await _until(lambda: _scale_is(b, 1.0), "the scale back at 1")
        # back at 1: clean calls write nothing more
        n = await a.backend.redis.hget("gpulock:{bo2}:backoff", "ok:" + BUCKET)
        assert (await cb.post("/embed", json={})).status_code == 200
        assert seen_b["amounts"][-1] == 300 * MiB
        assert await a.backend.redis.hget("gpulock:{bo2}:backoff", "ok:" + BUCKET) == n == b"4"
        assert b.backoff.state()["scales"] == {}


async def _factor_is(gpu: GpuLimiter, f: float) -> bool:
    await gpu.backoff.refresh()
    return gpu.backoff.factor() == pytest.approx(f)


async def _scale_is(gpu: GpuLimiter, s: float) -> bool:
    await gpu.backoff.refresh()
    return gpu.backoff.scale(BUCKET) == pytest.approx(s)


async def test_repeated_ooms_shrink_the_granted_capacity_to_the_floor(redis_proc1):
    """Four OOMs take the factor to its floor (0.5): each 1 GiB request (asked for with a
    fixed amount, so no bucket scale) leases 2 GiB, and a 4 GiB pool runs two at once; the
    third waits in the queue although 2 GiB of real work would still fit."""
    rule = BackoffRule(episode_s=0, capacity_every_s=3600.0)
    gate = threading.Event()
    app, gpu, seen = _app(redis_proc1.url, "bo3", rule, gate)

    @app.post("/fixed")
    @gpu.endpoint("fixed", estimate=lambda body: GiB)
    def fixed(body: dict) -> dict:
        lease = current_lease()
        assert lease is not None
        seen["amounts"].append(lease.amount)
        if body.get("oom"):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if body.get("wait"):
            assert gate.wait(30)
        return {"ok": True}

    pool = AsyncPool.from_url(redis_proc1.url, "bo3")
    try:
        async with Running(app) as c:
            factors = []
            for _ in range(4):
                assert (await c.post("/fixed", json={"oom": True})).status_code == 503
                await _until(
                    lambda: _factor_is(gpu, max(0.5, 0.8 ** (len(factors) + 1))), "the cut"
                )
                factors.append(gpu.backoff.factor())
            assert factors == pytest.approx([0.8, 0.64, 0.512, 0.5])
            held = [asyncio.create_task(c.post("/fixed", json={"wait": True})) for _ in range(3)]

            async def two_run_one_waits():
                st = await pool.status()
                return st.used == 4 * GiB and st.lease_count == 2 and st.waiter_count == 1

            await _until(two_run_one_waits, "two leases of 2 GiB and one waiter")
            gate.set()
            assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 3
            assert seen["amounts"][-3:] == [2 * GiB] * 3
    finally:
        await pool.aclose()


async def test_an_oom_the_batcher_handles_raises_its_bucket(redis_proc1):
    """An OOM inside a batch is handled in the executor thread (split, or each request of a
    part that still runs out of memory gets its 503): the job ends without raising, and the
    back-off still reacts, for the bucket of the batch's estimate."""
    rule = BackoffRule(episode_s=60.0)
    gpu = GpuLimiter(redis_proc1.url, "bo4", capacity=4 * GiB, configure="set", oom_backoff=rule)
    app = FastAPI(lifespan=gpu.lifespan)

    def run(items: list[int]) -> list[int]:
        if 0 in items:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return items

    batcher = gpu.batcher(
        "batch",
        run,
        estimate=lambda i: MiB,
        estimate_batch=lambda items: gpu.estimate("batch", len(items), 8, formula),
    )

    @app.post("/b")
    async def b(body: dict):
        return {"v": await batcher.submit(body["v"])}

    async with Running(app) as c:
        r = await c.post("/b", json={"v": 0})
        assert r.status_code == 503 and r.json()["detail"].startswith("the GPU ran out")
        await _until(lambda: _factor_is(gpu, 0.8), "the pool's cut")
        assert gpu.backoff.scale("batch|b1|s8") == 1.5
        assert (await c.post("/b", json={"v": 5})).json() == {"v": 5}


async def test_backoff_off_writes_nothing(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "bo5", None)
    async with Running(app) as c:
        assert (await c.post("/embed", json={"oom": True})).status_code == 503
        assert (await c.post("/embed", json={})).status_code == 200
        assert seen["amounts"] == [300 * MiB, 300 * MiB]
        assert await gpu.backend.redis.exists("gpulock:{bo5}:backoff") == 0
        assert gpu.backoff.state() == {"enabled": False, "factor": 1.0, "scales": {}}
