"""The room the workers' resident leases (their models) leave, in the FastAPI integration: a
request that can never fit next to them is refused with 413 at once by every route style, also
when the worker's own view of the pool is older than the models (right after a start), and a
model whose resident lease is still queued counts (docs/SEMANTICS.md, "Resident leases")."""

from __future__ import annotations

import asyncio

import pytest
from support.pools import status_until

from gpulock import AsyncPool

from .test_fastapi import GiB, _app, _Running, _used

pytestmark = pytest.mark.timeout(60)


async def test_request_larger_than_the_room_residents_leave_is_413_at_once(redis_proc1):
    """capacity 4 GiB; other workers' models hold 3 GiB as resident leases, taken after this
    worker's last status read (as right after a start: its view of the pool does not know
    them yet): a 2 GiB request can never be granted. It must not sit at the head of the FIFO
    for its whole timeout (stalling the 1 GiB requests behind it) and then answer an
    unwinnable 503: the decorator and the Depends guard both answer 413 at once."""
    app, gpu, _ = _app(
        redis_proc1.url, "it-room", acquire_timeout=5.0, park_timeout=0, reaper_interval=60
    )
    other = AsyncPool.from_url(redis_proc1.url, "it-room")
    async with _Running(app) as c:
        models = [
            await other.acquire(
                int(1.5 * GiB), ttl=30, holder={"purpose": "resident:model"}, resident=True
            )
            for _ in range(2)
        ]
        big, small, guarded = await asyncio.gather(
            c.post("/sync", json={"gib": 2}),
            c.post("/sync", json={"gib": 1}),
            c.post("/run", json={"gib": 2}),
        )
        assert big.status_code == 413 and guarded.status_code == 413, (big.text, guarded.text)
        for r in (big, guarded):
            detail = r.json()["detail"]
            assert (
                "2.0GiB" in detail
                and "1.0GiB" in detail
                and "4.0GiB" in detail
                and "3.0GiB" in detail
            ), detail
        assert small.status_code == 200
        # Nothing was queued or granted for the refused requests.
        assert await _used(redis_proc1.url, "it-room", settle_at=3 * GiB) == 3 * GiB
        # A model went away: the same request now fits.
        await models.pop().release()
        assert (await c.post("/sync", json={"gib": 2})).status_code == 200
        for lz in models:
            await lz.release()
    await other.aclose()


async def test_a_worker_whose_resident_lease_is_still_queued_counts(redis_proc1):
    """Another worker's resident lease is queued (the pool is full of short leases): its bytes
    are as good as taken, so a request that fits only if that model never loads is refused
    at once; one that fits next to it waits as usual and is served."""
    app, gpu, _ = _app(redis_proc1.url, "it-room-q", acquire_timeout=5.0, park_timeout=0)
    other = AsyncPool.from_url(redis_proc1.url, "it-room-q")
    async with _Running(app) as c:
        model = await other.acquire(GiB, resident=True)
        short = await other.acquire(3 * GiB)  # the pool is full
        queued = asyncio.create_task(other.acquire(GiB, resident=True))
        st = await status_until(redis_proc1.url, "it-room-q", lambda s: s.waiter_count == 1)
        assert st.resident == GiB and st.resident_queued == GiB, st
        big = await c.post("/sync", json={"gib": 2.5})
        assert big.status_code == 413, big.text
        fits = asyncio.ensure_future(c.post("/sync", json={"gib": 2}))
        await short.release()  # the queued model gets its GiB, then the 2 GiB request
        second = await asyncio.wait_for(queued, 5)
        assert (await fits).status_code == 200
        for lz in (model, second):
            await lz.release()
    await other.aclose()
