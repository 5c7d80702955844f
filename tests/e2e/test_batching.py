"""Dynamic batching across the 4 gunicorn workers of the service: 48 concurrent requests of
512 MiB each on a 4 GiB pool all complete, the workers run them in batches (one lease per
batch, for the batch's bytes), and at no instant do the leases the workers recorded hold
more than the pool."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from support.history import lease_intervals, max_overlap
from support.pools import GiB

BATCH_SERVICE = {
    "GPULOCK_MODEL": "sleep",
    "GPULOCK_SLEEP_BYTES": "512MiB",
    "GPULOCK_SLEEP_SECONDS": "0.2",
    "GPULOCK_RESIDENT": "0",
    "GPULOCK_EXECUTOR_THREADS": "2",
    "GPULOCK_ACQUIRE_TIMEOUT": "60",
    "GPULOCK_BATCH": "true",
    "GPULOCK_BATCH_MAX_WAIT_MS": "20",
}


@pytest.mark.timeout(120)
def test_batching_across_four_workers_never_exceeds_the_pool(make_service):
    svc = make_service("batching", workers=4, env=BATCH_SERVICE, capacity=4 * GiB)
    svc.wait_ready(4, timeout=90)

    async def fire(n: int):
        async def one(i: int):
            await asyncio.sleep(0.005 * i)  # spread the connections over the workers
            async with httpx.AsyncClient(base_url=svc.url, timeout=90) as c:
                r = await c.post("/v1/embeddings", json={"input": [f"text {i}"]})
                return r.status_code, r.json(), r.headers.get("x-worker-pid", "")

        return await asyncio.gather(*(one(i) for i in range(n)))

    results = asyncio.run(fire(48))
    assert [s for s, _, _ in results] == [200] * 48
    for i, (_, body, _) in enumerate(results):  # each its own result
        assert body["data"][0]["embedding"] == [float(len(f"text {i}"))] * 8
    assert len({pid for _, _, pid in results}) >= 2, "the requests should spread over workers"
    leases = lease_intervals(svc.history(), routes={"embeddings"})
    peak_bytes, _ = max_overlap(leases)
    assert peak_bytes <= 4 * GiB, peak_bytes
    assert len(leases) < 48, "the workers should have batched"
    assert max(a for _, _, a, _ in leases) > 512 * 2**20
    text = httpx.get(svc.url + "/metrics", timeout=10).text
    assert 'gpulock_batch_size_count{route="embeddings"}' in text
    st = svc.status_when(lambda st: st.used == 0)
    assert st.used == 0 and st.waiter_count == 0
