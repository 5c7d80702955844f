"""Preemption in the FastAPI integration (docs/SERVICE.md, "Preemption"), against a real Redis:
a request of a default route is never asked to yield (it finishes; the higher-priority request
waits for it); a route declared ``preemptible=True`` is asked: its handler sees
``current_lease().yield_requested`` and answers early, its stream ends at the next chunk
boundary with an error event ``preempted``; background work (``calls.call`` without a request)
and an opted-in batch are asked and yield; in each case the higher-priority request is granted
after the yield. Every wait is on observed state (the pool's status and counters, the leases'
yield state) with a generous deadline; the ask is decided in the script that queues the
waiter, so "not asked" is read once the waiter is seen queued."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
import redis
from fastapi import FastAPI, Request, Response
from prometheus_client import REGISTRY
from support.apps import Running
from support.pools import GiB, config, status_until

from gpulock.fastapi import GpuLimiter, StreamLease, current_lease
from support.preempt import enable_preemption

pytestmark = pytest.mark.timeout(90)

WAIT_S = 20.0  # the longest a route waits for what the test must make happen
GRACE_MS = 30_000  # the yield grace: cooperative holders release long before it


def _preempt(url: str, pool: str, gap: int = 1, grace_ms: int = GRACE_MS) -> None:
    """Turn preemption on in ``pool`` (it exists: the limiter made it)."""
    c = redis.Redis.from_url(url)
    try:
        enable_preemption(c, pool, gap, grace_ms / 1000)
    finally:
        c.close()


def _counters(url: str, pool: str) -> tuple[int, int]:
    """The pool's ``(y_asked, y_done)``."""
    c = redis.Redis.from_url(url)
    try:
        cfg = config(c, pool)
        return cfg.get("y_asked", 0), cfg.get("y_done", 0)
    finally:
        c.close()


def _yields(route: str) -> float:
    return REGISTRY.get_sample_value("gpulock_yields_requested_total", {"route": route}) or 0.0


def _until_asked() -> bool:
    """In a route's thread: wait until its lease is asked to yield (True), at most WAIT_S."""
    lease = current_lease()
    assert lease is not None
    end = time.monotonic() + WAIT_S
    while not lease.yield_requested:
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def _app(url: str, pool: str) -> tuple[FastAPI, GpuLimiter, dict[str, Any]]:
    """Routes, each leasing the whole pool (2 GiB): ``/hold`` (default: not preemptible;
    runs until ``seen["gate"]`` is set), ``/hold-pre`` (``preemptible=True``: answers once
    asked), ``/stream-pre`` (a preemptible SSE stream that never ends by itself), ``/embed``
    (a preemptible batcher whose batch runs until asked) and ``/high`` (priority 5).
    ``seen["order"]``: the routes whose work finished, in order."""
    gpu = GpuLimiter(
        url, pool, capacity=2 * GiB, acquire_timeout=WAIT_S, executor_threads=4, ttl=2.0
    )
    app = FastAPI(lifespan=gpu.lifespan)
    gate = threading.Event()
    seen: dict[str, Any] = {"order": [], "gate": gate, "closed": threading.Event()}

    @app.post("/hold")
    @gpu.endpoint("hold", estimate=lambda: 2 * GiB)
    def hold() -> dict:
        assert gate.wait(WAIT_S), "the test never opened the gate"
        lease = current_lease()
        assert lease is not None
        seen["order"].append("hold")
        return {"asked": lease.yield_requested}

    @app.post("/hold-pre")
    @gpu.endpoint("hold-pre", estimate=lambda: 2 * GiB, preemptible=True)
    def hold_pre() -> dict:
        asked = _until_asked()  # work that can stop early and still answer
        seen["order"].append("hold-pre")
        return {"asked": asked}

    @app.post("/stream-pre")
    @gpu.endpoint("stream-pre", estimate=lambda: 2 * GiB, stream="sse", preemptible=True)
    def stream_pre(stream: StreamLease) -> Any:
        try:
            i = 0
            end = time.monotonic() + WAIT_S
            while time.monotonic() < end:  # never ends by itself within the test
                yield {"i": i, "asked": stream.yield_requested}
                i += 1
                time.sleep(0.01)
        finally:
            seen["order"].append("stream-pre")
            seen["closed"].set()

    def embed_batch(items: list[int]) -> list[dict]:
        asked = _until_asked()  # the batch in flight finishes: the natural yield point
        seen["order"].append("embed")
        return [{"item": x, "asked": asked} for x in items]

    batcher = gpu.batcher(
        "embed",
        embed_batch,
        estimate=lambda x: 2 * GiB,
        estimate_batch=lambda xs: 2 * GiB,
        preemptible=True,
    )

    @app.post("/embed")
    async def embed(request: Request, response: Response) -> Any:
        return await batcher.submit(1, request=request, response=response)

    @app.post("/high")
    @gpu.endpoint("high", estimate=lambda: 2 * GiB, priority=5)
    def high() -> dict:
        seen["order"].append("high")
        return {"ran": "high"}

    return app, gpu, seen


async def _high_queued(url: str, pool: str, c: Any) -> asyncio.Task[Any]:
    """Send ``/high`` and return its task once the pool lists it queued (only where the holder
    is not asked: an asked one may yield, and ``/high`` be granted, between two reads)."""
    task = asyncio.create_task(c.post("/high"))
    st = await status_until(url, pool, lambda st: st.waiter_count == 1, timeout=WAIT_S)
    assert [(w.holder.get("route"), w.priority) for w in st.waiters] == [("high", 5)]
    return task


async def test_a_default_routes_request_is_never_asked_and_the_higher_one_waits(redis_proc1):
    url, pool = redis_proc1.url, "pe1"
    app, gpu, seen = _app(url, pool)
    async with Running(app) as c:
        _preempt(url, pool)
        hold = asyncio.create_task(c.post("/hold"))
        await status_until(url, pool, lambda st: st.used == 2 * GiB, timeout=WAIT_S)
        high = await _high_queued(url, pool, c)
        # the waiter queued at the head: the ask was decided in that script, and none was made
        assert _counters(url, pool) == (0, 0)
        assert not high.done()
        seen["gate"].set()
        rh, rg = await asyncio.gather(hold, high)
        assert (rh.status_code, rh.json()) == (200, {"asked": False}), rh.text
        assert rg.status_code == 200, rg.text
        assert seen["order"] == ["hold", "high"]
        assert _counters(url, pool) == (0, 0)
        assert _yields("hold") == 0


async def test_a_preemptible_route_is_asked_answers_early_and_the_higher_one_is_granted(
    redis_proc1,
):
    url, pool = redis_proc1.url, "pe2"
    app, gpu, seen = _app(url, pool)
    before = _yields("hold-pre")
    async with Running(app) as c:
        _preempt(url, pool)
        held = asyncio.create_task(c.post("/hold-pre"))
        await status_until(url, pool, lambda st: st.used == 2 * GiB, timeout=WAIT_S)
        high = asyncio.create_task(c.post("/high"))  # asks, and may be granted between polls
        rp, rg = await asyncio.gather(held, high)
        assert (rp.status_code, rp.json()) == (200, {"asked": True}), rp.text
        assert rg.status_code == 200, rg.text
        assert seen["order"] == ["hold-pre", "high"]
        assert _counters(url, pool) == (1, 1)  # asked once, released before the deadline
        assert _yields("hold-pre") == before + 1


async def test_a_preemptible_stream_ends_at_the_next_chunk_after_a_yield(redis_proc1):
    url, pool = redis_proc1.url, "pe3"
    app, gpu, seen = _app(url, pool)
    async with Running(app) as c:
        _preempt(url, pool)
        stream = asyncio.create_task(c.post("/stream-pre"))
        await status_until(url, pool, lambda st: st.used == 2 * GiB, timeout=WAIT_S)
        high = asyncio.create_task(c.post("/high"))  # asks, and may be granted between polls
        rs, rg = await asyncio.gather(stream, high)
        assert rs.status_code == 200 and rg.status_code == 200, (rs.text, rg.text)
        assert seen["closed"].is_set()  # the body was closed: its finally ran
        assert seen["order"] == ["stream-pre", "high"]
        events = [e for e in rs.text.split("\n\n") if e.strip()]
        assert "data: [DONE]" not in rs.text
        assert events[-1].startswith("event: error"), events[-3:]
        err = json.loads(events[-1].split("data: ", 1)[1])["error"]
        assert err["code"] == "preempted", err
        chunks = [json.loads(e.split("data: ", 1)[1]) for e in events[:-1]]
        assert chunks and chunks[0]["i"] == 0  # some chunks went out before it ended
        assert _counters(url, pool) == (1, 1)


async def test_background_work_is_preemptible_by_default_and_yields(redis_proc1):
    """Work no request waits on: ``calls.call`` without a request; it checks
    ``current_lease().yield_requested`` between its steps and stops at a checkpoint."""
    url, pool = redis_proc1.url, "pe4"
    app, gpu, seen = _app(url, pool)
    async with Running(app) as c:
        _preempt(url, pool)
        steps: list[int] = []

        def job() -> str:
            lease = current_lease()
            assert lease is not None
            end = time.monotonic() + WAIT_S
            while not lease.yield_requested and time.monotonic() < end:
                steps.append(len(steps))  # one step of the job
                time.sleep(0.005)
            seen["order"].append("bg")
            return "checkpointed" if lease.yield_requested else "ran out"

        bg = asyncio.create_task(gpu.calls.call(job, route="bg", amount=2 * GiB))
        await status_until(url, pool, lambda st: st.used == 2 * GiB, timeout=WAIT_S)
        high = asyncio.create_task(c.post("/high"))  # asks, and may be granted between polls
        out, rg = await asyncio.gather(bg, high)
        assert out == "checkpointed" and steps
        assert rg.status_code == 200, rg.text
        assert seen["order"] == ["bg", "high"]
        assert _counters(url, pool) == (1, 1)
        assert _yields("bg") >= 1


async def test_an_opted_in_batch_is_asked_finishes_its_batch_and_releases(redis_proc1):
    url, pool = redis_proc1.url, "pe5"
    app, gpu, seen = _app(url, pool)
    async with Running(app) as c:
        _preempt(url, pool)
        emb = asyncio.create_task(c.post("/embed"))
        await status_until(url, pool, lambda st: st.used == 2 * GiB, timeout=WAIT_S)
        high = asyncio.create_task(c.post("/high"))  # asks, and may be granted between polls
        re, rg = await asyncio.gather(emb, high)
        assert (re.status_code, re.json()) == (200, {"item": 1, "asked": True}), re.text
        assert rg.status_code == 200, rg.text
        assert seen["order"] == ["embed", "high"]
        assert _counters(url, pool) == (1, 1)
