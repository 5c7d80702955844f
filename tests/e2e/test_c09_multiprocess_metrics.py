"""c09 — metrics that lie under gunicorn.

4 gunicorn workers with ``--max-requests 8`` (they recycle during the test) and a load that
queues: /metrics reports one value per pool for capacity, used bytes, leases and waiters, equal
to what ``gpulock status`` reads from Redis (the service reads them at scrape time); counters
and histograms are summed over all workers, dead ones included, never reset and never left as
per-process series.

Also here: a sticky CUDA error (device-side assert) answers 500, the worker exits and gunicorn
replaces it, its leases come back, and the others go on."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from support.history import lease_intervals, max_overlap
from support.pools import GiB, MiB
from support.procs import alive

RESIDENT = 128 * MiB
ENV = {
    "GPULOCK_MODEL": "sleep",
    "GPULOCK_SLEEP_BYTES": "1GiB",
    "GPULOCK_SLEEP_SECONDS": "0.2",
    "GPULOCK_RESIDENT": str(RESIDENT),
    "GPULOCK_EXECUTOR_THREADS": "4",
    "GPULOCK_ACQUIRE_TIMEOUT": "60",
    "GPULOCK_TTL": "5",
}
CAPACITY = 2 * GiB + 4 * RESIDENT


@pytest.fixture(scope="module")
def svc(make_service):
    s = make_service("c09", workers=4, env=ENV, capacity=CAPACITY, max_requests=8)
    s.wait_ready(4, timeout=90)
    return s


def _pool(svc, m: dict, name: str) -> float:
    return m[f"{name}{{pool={svc.pool}}}"]


def _wait_quiet(svc, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = svc.status()
        if st.waiter_count == 0 and st.used == 4 * RESIDENT and st.lease_count == 4:
            m = svc.metrics()
            if m.get("gpulock_workers_ready") == 4 and m.get("gpulock_workers") == 4:
                return
        time.sleep(0.2)
    raise AssertionError(f"service did not settle: {svc.status()}")


def _stable_scrape(svc, timeout: float = 60):
    """A scrape with the pool quiet and unchanged from just before it to just after it.
    Workers still recycle after the load (gunicorn's --max-requests counts the test's own
    /metrics and /ready requests too), and a new worker's resident lease can be granted while
    the old one's is being released: comparing a scrape with a status read a moment later
    would then compare two different pools."""
    deadline = time.monotonic() + timeout
    while True:
        before = svc.status()
        m = svc.metrics()
        after = svc.status()
        same = (before.used, before.lease_count, before.waiter_count, before.grants) == (
            after.used,
            after.lease_count,
            after.waiter_count,
            after.grants,
        )
        if same and after.used == 4 * RESIDENT and after.lease_count == 4:
            return m, after
        assert time.monotonic() < deadline, f"pool never quiet for one scrape: {after}"
        time.sleep(0.2)


@pytest.mark.timeout(150)
def test_c09_multiprocess_metrics(svc):
    n = 60
    scrapes: list[tuple[dict, object]] = []
    stop = threading.Event()

    def scraper():
        while not stop.is_set():
            try:
                m = svc.metrics()
                scrapes.append((m, svc.status()))
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    async def load():
        # No keep-alive: a worker that reaches --max-requests closes its idle connections, and a
        # request sent on one at that moment gets a ReadError (seen once in a few runs) — the
        # race every client of a recycling server has, not what this test is about.
        limits = httpx.Limits(max_connections=12, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=svc.url, timeout=90, limits=limits) as c:
            sem = asyncio.Semaphore(12)

            async def one(i):
                async with sem:
                    # A worker that reaches --max-requests also drops a connection it had
                    # accepted but not read a request from yet (no keep-alive helps there):
                    # no answer, nothing run. The retry carries the same X-Request-ID, so even
                    # a request that had run would be answered once, from its stored result.
                    headers = {"X-Request-ID": f"c09-{i}"}
                    for attempt in range(3):
                        try:
                            r = await c.post(
                                "/v1/embeddings", json={"input": [f"req {i}"]}, headers=headers
                            )
                            break
                        except (httpx.ReadError, httpx.RemoteProtocolError):
                            if attempt == 2:
                                raise
                    return r.status_code, int(r.headers["x-worker-pid"])

            return await asyncio.gather(*(one(i) for i in range(n)))

    base = svc.metrics()
    t = threading.Thread(target=scraper, daemon=True)
    t.start()
    results = asyncio.run(load())
    stop.set()
    t.join(10)
    assert [s for s, _ in results] == [200] * n
    assert len({pid for _, pid in results}) > 4, "workers should have recycled during the load"

    assert scrapes
    assert any(_pool(svc, m, "gpulock_pool_waiters") > 0 for m, _ in scrapes), (
        "the load should queue"
    )
    prev = -1.0
    for m, st in scrapes:
        assert _pool(svc, m, "gpulock_pool_capacity_bytes") == st.capacity == CAPACITY
        assert _pool(svc, m, "gpulock_pool_used_bytes") <= CAPACITY
        # one series per pool, none per process
        assert not any(k.startswith("gpulock_pool_used_bytes") and "pid" in k for k in m)
        ok = m.get("gpulock_requests_total{route=embeddings,status=200}", 0.0)
        assert ok >= prev, "a counter went backwards across worker recycling"
        prev = ok

    _wait_quiet(svc)
    m, st = _stable_scrape(svc)
    assert _pool(svc, m, "gpulock_pool_capacity_bytes") == st.capacity
    assert _pool(svc, m, "gpulock_pool_used_bytes") == st.used == 4 * RESIDENT
    assert _pool(svc, m, "gpulock_pool_leases") == st.lease_count == 4
    assert _pool(svc, m, "gpulock_pool_waiters") == st.waiter_count == 0
    assert _pool(svc, m, "gpulock_pool_grants_total") == st.grants
    before = base.get("gpulock_requests_total{route=embeddings,status=200}", 0.0)
    assert m["gpulock_requests_total{route=embeddings,status=200}"] - before == n
    assert (
        m["gpulock_grants_total{route=embeddings}"]
        - base.get("gpulock_grants_total{route=embeddings}", 0)
        == n
    )
    assert (
        m["gpulock_hold_seconds_count{route=embeddings}"]
        - base.get("gpulock_hold_seconds_count{route=embeddings}", 0)
        == n
    )
    assert (
        m["gpulock_acquire_wait_seconds_count{route=embeddings}"]
        - base.get("gpulock_acquire_wait_seconds_count{route=embeddings}", 0)
        == n
    )
    assert m["gpulock_workers"] == 4 and m["gpulock_workers_ready"] == 4, (
        "stale gauges of dead workers"
    )
    assert m["gpulock_worker_resident_bytes"] == 4 * RESIDENT
    peak, _ = max_overlap(lease_intervals(svc.history()))
    assert peak <= CAPACITY


@pytest.mark.timeout(90)
def test_fatal_cuda_error_restarts_the_worker(svc):
    _wait_quiet(svc)
    f0 = svc.metrics().get("gpulock_cuda_fatal_errors_total{route=embeddings}", 0.0)
    r = httpx.post(svc.url + "/v1/embeddings", json={"input": ["cuda-assert"]}, timeout=60)
    assert r.status_code == 500, r.text
    assert "device-side assert" in r.json()["error"]["message"]
    pid = int(r.headers["x-worker-pid"])
    deadline = time.monotonic() + 20
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the worker must exit after a sticky CUDA error"
    _wait_quiet(svc)  # replaced by gunicorn; its leases were released or reaped
    assert pid not in svc.worker_pids()
    m = svc.metrics()
    assert m["gpulock_cuda_fatal_errors_total{route=embeddings}"] == f0 + 1
    ok = httpx.post(svc.url + "/v1/embeddings", json={"input": ["after"]}, timeout=30)
    assert ok.status_code == 200
