"""A retry with X-Request-ID that lands on another worker than the one holding the place: two
GpuLimiter apps on one real Redis (two "workers"). The follower answers with the place the
request really has (the pool's queue in Redis, plus the owner's thread-slot queue that the
owner publishes in its claim) and the Retry-After of the same policy the owner uses."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpulock import AsyncPool

from .test_fastapi import _app, _Running

pytestmark = pytest.mark.timeout(60)


async def _until(pred, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def _status(url: str, pool: str):
    p = AsyncPool.from_url(url, pool)
    try:
        return await p.status()
    finally:
        await p.aclose()


@pytest.mark.parametrize("phase", ["slot", "queued"])
async def test_retry_on_another_worker_gets_the_real_place_and_retry_after(redis_proc1, phase):
    pool = f"follow-{phase}"
    threads = 1 if phase == "slot" else 8
    # No reaper tick after the start: no grant rate is measured, so both workers' Retry-After
    # follow from the place alone (one second per place) and must agree exactly.
    kw = dict(executor_threads=threads, acquire_timeout=0.5, park_timeout=30, reaper_interval=30)
    a_app, a, _ = _app(redis_proc1.url, pool, **kw)
    b_app, b, _ = _app(redis_proc1.url, pool, **kw)
    async with _Running(a_app) as ca, _Running(b_app) as cb:
        hold = asyncio.create_task(ca.post("/sync", json={"seconds": 6.0, "gib": 4}))
        await _until(
            lambda: a.slots.free == threads - 1 and a.retry.local_grants == 1,
            "the holder running",
        )

        def waiting() -> int:  # requests of worker A behind the holder, wherever they wait
            if phase == "slot":
                return len(a.slots.waiters)
            return sum(1 for j in a.jobs.by_ticket.values() if j.phase == "queued" and j.position)

        ahead = []
        for i in range(3):  # parked (X-Request-ID), so they keep their places after their 503s
            ahead.append(
                asyncio.create_task(
                    ca.post("/sync", json={"gib": 1}, headers={"X-Request-ID": f"ahead-{i}"})
                )
            )
            await _until(lambda: waiting() == i + 1, f"request {i} waiting")
        h = {"X-Request-ID": "the-one"}
        first = await ca.post("/sync", json={"gib": 1}, headers=h)
        assert first.status_code == 503, first.text
        assert first.headers["x-queue-position"] == "4", first.headers
        if phase == "queued":
            assert (await _status(redis_proc1.url, pool)).waiter_count == 4

        retry = await cb.post("/sync", json={"gib": 1}, headers=h)  # worker B, the place is A's
        assert retry.status_code == 503, retry.text
        assert "position 4" in retry.json()["detail"] and "unknown" not in retry.json()["detail"]
        assert retry.headers["x-queue-position"] == "4", retry.headers
        assert retry.headers["retry-after"] == first.headers["retry-after"], (
            first.headers,
            retry.headers,
        )
        assert retry.headers["x-request-id"] == "the-one"
        assert (await hold).status_code == 200
        for t in ahead:
            assert (await t).status_code == 503


async def test_retries_on_another_worker_keep_the_owners_place(redis_proc1):
    """The owner's place is extended by 503s a follower gives on another worker (the
    follower writes the hold it promised; the owner reads it before withdrawing): a client
    whose retries all land elsewhere keeps its rank past the owner's own hold."""
    pool = "follow-hold"
    kw = dict(acquire_timeout=0.3, park_timeout=1.0, reaper_interval=30)
    a_app, a, _ = _app(redis_proc1.url, pool, **kw)
    b_app, b, _ = _app(redis_proc1.url, pool, **kw)
    async with _Running(a_app) as ca, _Running(b_app) as cb:
        holder = AsyncPool.from_url(redis_proc1.url, pool)
        lease = await holder.acquire(4 * 2**30, ttl=60)  # the pool is full until released below
        try:
            h = {"X-Request-ID": "retried-elsewhere"}
            r = await ca.post("/sync", json={"gib": 4}, headers=h)
            assert r.status_code == 503 and r.headers["x-queue-position"] == "1", r.headers
            job = a.jobs.by_ticket[next(iter(a.jobs.by_ticket))]
            own_hold_ends = job.place.until  # what A alone would keep it for
            later = await ca.post("/sync", json={"gib": 4}, headers={"X-Request-ID": "later"})
            assert later.status_code == 503 and later.headers["x-queue-position"] == "2"
            retries = 0
            while time.monotonic() < own_hold_ends + 1.0:
                r = await cb.post("/sync", json={"gib": 4}, headers=h)  # always worker B
                assert r.status_code == 503, r.text
                assert r.headers["x-queue-position"] == "1", (retries, r.headers)
                retries += 1
            assert job.phase == "queued" and not job.abandoned
            assert a.jobs.places.get(job.ticket) is job.place
        finally:
            await lease.release()
            await holder.aclose()
        # granted on A when its turn came; B's retry collects the stored result
        await _until(lambda: job.phase == "done", "the owner's job to run")
        r = await cb.post("/sync", json={"gib": 4}, headers=h)
        assert r.status_code == 200, r.text
