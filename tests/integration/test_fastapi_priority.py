"""Priorities in the FastAPI integration (docs/SERVICE.md, "Priorities"): a route's
``priority=`` orders its requests in the pool's queue and in the worker's thread-slot line;
``GpuLimiter(priority_header=...)`` lets a request's header replace it, at most the route's
``max_priority``; a malformed header value is a 400 and leases nothing; a bad priority fails
when the route is declared. Orders are checked by observed state (the pool's status, the
worker's slot line), never by sleeps."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from fastapi import Depends, FastAPI
from support.apps import Running
from support.pools import status_until
from support.waiting import async_wait_until

from gpulock import AsyncPool
from gpulock.errors import InvalidArgument
from gpulock.fastapi import GpuCall, GpuLimiter

GiB = 2**30
HEADER = "X-GpuLock-Priority"
pytestmark = pytest.mark.timeout(60)


async def _status(url: str, pool: str):
    p = AsyncPool.from_url(url, pool)
    try:
        return await p.status()
    finally:
        await p.aclose()


def _app(url: str, pool: str, **kw: Any) -> tuple[FastAPI, GpuLimiter, dict[str, Any]]:
    """Routes: ``/hold`` (2 GiB, the whole pool, until ``seen["gate"]`` is set), ``/low``
    (priority 0), ``/high`` (priority 5), ``/vip`` (priority 0, max_priority 10), and
    ``/guarded`` (the dependency shape, priority 0, max_priority 10); every route but /hold
    leases 2 GiB, so one runs at a time. ``seen["order"]``: the routes whose work ran, in
    order."""
    kw.setdefault("capacity", 2 * GiB)
    kw.setdefault("acquire_timeout", 20)
    gpu = GpuLimiter(url, pool, **kw)
    app = FastAPI(lifespan=gpu.lifespan)
    gate = threading.Event()
    seen: dict[str, Any] = {"order": [], "gate": gate}

    def work(name: str) -> dict:
        if name == "hold":
            assert gate.wait(20), "the test never opened the gate"
        seen["order"].append(name)
        return {"ran": name}

    @app.post("/hold")
    @gpu.endpoint("hold", estimate=lambda: 2 * GiB)
    def hold() -> dict:
        return work("hold")

    @app.post("/low")
    @gpu.endpoint("low", estimate=lambda: 2 * GiB)
    def low() -> dict:
        return work("low")

    @app.post("/high")
    @gpu.endpoint("high", estimate=lambda: 2 * GiB, priority=5)
    def high() -> dict:
        return work("high")

    @app.post("/vip")
    @gpu.endpoint("vip", estimate=lambda: 2 * GiB, max_priority=10)
    def vip() -> dict:
        return work("vip")

    @app.post("/guarded")
    async def guarded(
        call: GpuCall = Depends(
            gpu.guard("guarded", estimate=lambda name: 2 * GiB, max_priority=10)
        ),
    ) -> dict:
        return await call(work, "guarded")

    return app, gpu, seen


async def test_a_higher_priority_route_is_served_before_a_queued_lower_one(redis_proc1):
    url = redis_proc1.url
    app, gpu, seen = _app(url, "pr1", executor_threads=4)
    async with Running(app) as c:
        hold = asyncio.create_task(c.post("/hold"))
        await status_until(url, "pr1", lambda st: st.used == 2 * GiB)
        low = asyncio.create_task(c.post("/low"))
        await status_until(url, "pr1", lambda st: st.waiter_count == 1)
        high = asyncio.create_task(c.post("/high"))
        st = await status_until(url, "pr1", lambda st: st.waiter_count == 2)
        # the pool lists the later, higher one first, and each with its route's priority
        assert [(w.holder.get("route"), w.priority) for w in st.waiters] == [
            ("high", 5),
            ("low", 0),
        ]
        seen["gate"].set()
        rs = await asyncio.gather(hold, low, high)
        assert [r.status_code for r in rs] == [200, 200, 200], [r.text for r in rs]
        assert seen["order"] == ["hold", "high", "low"]


async def test_a_higher_priority_goes_first_in_the_workers_thread_slot_line(redis_proc1):
    """With one executor thread busy, the requests wait for it in the worker (not yet in the
    pool's queue): the same order holds there."""
    url = redis_proc1.url
    app, gpu, seen = _app(url, "pr2", executor_threads=1, capacity=8 * GiB)
    slots = gpu.slots
    async with Running(app) as c:
        hold = asyncio.create_task(c.post("/hold"))
        await status_until(url, "pr2", lambda st: st.used == 2 * GiB)
        low = asyncio.create_task(c.post("/low"))
        await async_wait_until(lambda: len(slots.waiters) == 1, what="/low waiting for a thread")
        high = asyncio.create_task(c.post("/high"))
        await async_wait_until(lambda: len(slots.waiters) == 2, what="/high waiting for a thread")
        assert (await _status(url, "pr2")).waiter_count == 0  # neither is in the pool's queue
        seen["gate"].set()
        rs = await asyncio.gather(hold, low, high)
        assert [r.status_code for r in rs] == [200, 200, 200], [r.text for r in rs]
        assert seen["order"] == ["hold", "high", "low"]


async def test_the_priority_header_lowers_always_and_raises_up_to_max_priority(redis_proc1):
    url = redis_proc1.url
    app, gpu, seen = _app(url, "pr3", executor_threads=10, priority_header=HEADER)
    asks = [
        ("/low", "7", 0),  # max_priority defaults to the route's priority: clamped to 0
        ("/low", "-3", -3),  # lowering is always allowed
        ("/high", "9", 5),  # clamped to the route's own 5
        ("/high", "-100", -100),
        ("/vip", "7", 7),  # max_priority 10: raised
        ("/vip", " +10 ", 10),
        ("/guarded", "8", 8),  # the dependency shape follows the same rule
        ("/vip", None, 0),  # no header: the route's priority
    ]
    async with Running(app) as c:
        hold = asyncio.create_task(c.post("/hold"))
        await status_until(url, "pr3", lambda st: st.used == 2 * GiB)
        tasks = []
        for i, (path, value, _) in enumerate(asks):
            headers = {} if value is None else {HEADER: value}
            tasks.append(asyncio.create_task(c.post(path, headers=headers)))
            await status_until(url, "pr3", lambda st, n=i + 1: st.waiter_count == n)
        st = await _status(url, "pr3")
        got = sorted((w.holder.get("route"), w.priority) for w in st.waiters)
        assert got == sorted((path[1:], want) for path, _, want in asks)
        seen["gate"].set()
        rs = await asyncio.gather(hold, *tasks)
        assert [r.status_code for r in rs] == [200] * len(rs), [r.text for r in rs]


async def test_without_priority_header_the_header_is_ignored(redis_proc1):
    url = redis_proc1.url
    app, gpu, seen = _app(url, "pr4", executor_threads=4)
    assert gpu.settings.priority_header is None
    async with Running(app) as c:
        hold = asyncio.create_task(c.post("/hold"))
        await status_until(url, "pr4", lambda st: st.used == 2 * GiB)
        vip = asyncio.create_task(c.post("/vip", headers={HEADER: "9"}))
        bad = asyncio.create_task(c.post("/low", headers={HEADER: "not a number"}))
        st = await status_until(url, "pr4", lambda st: st.waiter_count == 2)
        assert sorted(w.priority for w in st.waiters) == [0, 0]
        seen["gate"].set()
        rs = await asyncio.gather(hold, vip, bad)
        assert [r.status_code for r in rs] == [200, 200, 200]


async def test_a_malformed_priority_header_is_a_400_naming_it_and_leases_nothing(redis_proc1):
    url = redis_proc1.url
    app, gpu, seen = _app(url, "pr5", priority_header=HEADER)
    async with Running(app) as c:
        for path in ("/low", "/vip", "/guarded"):
            for value in ("abc", "1000", "-101", "1.5", "", "--5", "0x10"):
                r = await c.post(path, headers={HEADER: value})
                assert r.status_code == 400, (path, value, r.text)
                assert r.headers["content-type"].startswith("application/json")
                detail = r.json()["detail"]
                assert HEADER in detail and repr(value) in detail, (path, value, detail)
        st = await _status(url, "pr5")
        assert st.used == 0 and st.grants == 0 and st.waiter_count == 0
        assert seen["order"] == []
        r = await c.post("/vip", headers={HEADER: "3"})
        assert r.status_code == 200 and seen["order"] == ["vip"]


def test_a_bad_route_priority_fails_when_the_route_is_declared():
    gpu = GpuLimiter("redis://127.0.0.1:1/0", "pr6")  # no I/O: never started
    app = FastAPI()
    with pytest.raises(InvalidArgument, match=r"'big'.*1000"):

        @app.post("/big")
        @gpu.endpoint("big", estimate=lambda: GiB, priority=1000)
        def big() -> dict:
            return {}

    with pytest.raises(InvalidArgument, match=r"'g'.*-101"):
        gpu.guard("g", estimate=lambda: GiB, priority=-101)
    with pytest.raises(InvalidArgument, match=r"'g'.*max_priority.*101"):
        gpu.guard("g", estimate=lambda: GiB, max_priority=101)
    with pytest.raises(InvalidArgument, match=r"'g'.*max_priority \(1\).*priority \(2\)"):
        gpu.guard("g", estimate=lambda: GiB, priority=2, max_priority=1)
    with pytest.raises(InvalidArgument, match=r"'b'.*1000"):
        gpu.batcher("b", lambda xs: xs, estimate=lambda x: GiB, priority=1000)
    with pytest.raises(InvalidArgument, match="priority"):
        gpu.guard("g", estimate=lambda: GiB, priority=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="priority_header"):
        GpuLimiter("redis://127.0.0.1:1/0", "pr6", priority_header="X Priority")


async def test_the_service_reads_its_priority_header_in_batches_too(redis_proc1):
    """The embeddings service (batching on, its default): GPULOCK_PRIORITY_HEADER and
    GPULOCK_MAX_PRIORITY; a malformed value is a 400 in OpenAI's shape naming the header."""
    from gpulock_service.app import create_app
    from gpulock_service.settings import Settings

    url = redis_proc1.url
    settings = Settings(
        redis_url=url,
        pool="pr7",
        capacity="1GiB",
        model="sleep",
        sleep_seconds=0.0,
        sleep_bytes="1MiB",
        resident="0",
        reaper_interval=0.05,
        acquire_timeout=20,
        priority_header=HEADER,
        max_priority=5,
    )
    assert settings.batch
    app = create_app(settings)
    async with Running(app) as c:
        await async_wait_until(
            lambda: app.state.limiter.readiness()[0], timeout=15, what="the service ready"
        )
        r = await c.post("/v1/embeddings", json={"input": "x"}, headers={HEADER: "high"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert HEADER in err["message"] and "'high'" in err["message"], err
        assert err["code"] == "invalid_priority"
        assert (await _status(url, "pr7")).grants == 0
        # the whole pool held by another client: the service's request queues, with its
        # header's priority clamped to GPULOCK_MAX_PRIORITY
        other = AsyncPool.from_url(url, "pr7")
        try:
            lease = await other.acquire(GiB, ttl=30)
            req = asyncio.create_task(
                c.post("/v1/embeddings", json={"input": ["a", "b"]}, headers={HEADER: "50"})
            )
            st = await status_until(url, "pr7", lambda st: st.waiter_count == 1)
            assert st.waiters[0].priority == 5
            await lease.release()
            r = await req
            assert r.status_code == 200, r.text
        finally:
            await other.aclose()
