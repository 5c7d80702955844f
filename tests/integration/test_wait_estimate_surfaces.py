"""The wait estimate where people and programs read it (docs/SEMANTICS.md, "Wait estimate"):
``gpulock status`` (table and --json), ``gpulock top``, ``gpulock run``'s waiting line, the
FastAPI integration's 503 (``estimated_wait_s`` and the Retry-After it gives) and its
``/metrics`` gauges; each number the server's estimate, against a real Redis.

A pool's drain rate is measured by draining a queue (support.drain); every wait is on
observed state."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading

import pytest
import redis

from gpulock import Pool
from gpulock.estimates.wait import wait_seconds_at_tail
from gpulock.fastapi import install_http_guards
from gpulock.retry_after import retry_after
from support.apps import Running, one_route_app
from support.drain import measure_drain, queue_behind
from support.pools import GiB, status_until
from support.procs import gpulock_argv
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

UNIT = 1000  # bytes of each lease of the CLI tests; the pool holds one at a time


def cli(url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPULOCK_REDIS_URL": url, "COLUMNS": "250"}
    return subprocess.run(
        [*gpulock_argv(), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def sync_pool(redis_proc1):
    made = []

    def make(name: str, **kw) -> Pool:
        client = redis.Redis.from_url(redis_proc1.url, socket_timeout=5, socket_connect_timeout=2)
        p = Pool(client, name, **kw)
        made.append((p, client))
        return p

    yield make
    for p, client in made:
        p.close()
        client.close()


def test_status_and_top_show_each_waiters_estimate(redis_proc1, sync_pool):
    url = redis_proc1.url
    pool = sync_pool("ws1", capacity=UNIT)
    holder = pool.acquire(UNIT)
    threads = queue_behind(pool, UNIT, 2)
    # unmeasured: the summary says so (no column of dashes), --json has nulls; top's column
    # has a dash for each
    out = cli(url, "status", "ws1")
    assert out.returncode == 0, out.stderr
    assert "est. wait" not in out.stdout, out.stdout
    assert "drain rate not measured yet: no wait estimates" in out.stdout, out.stdout
    top = cli(url, "top", "ws1", "--once").stdout
    assert "est. wait" in top and top.count("—") >= 2 and "not measured yet" in top, top
    d = json.loads(cli(url, "status", "ws1", "--json").stdout)
    assert d["drain"] is None and [w["estimated_wait_s"] for w in d["waiters"]] == [None, None]
    holder.release()
    for t in threads:
        t.join(240)

    drain = measure_drain(pool, UNIT)
    holder = pool.acquire(UNIT)
    threads = queue_behind(pool, UNIT, 2)
    try:
        st = pool.status()
        assert st.drain == drain  # nothing granted to a waiter since: the same rate
        want = [w.estimated_wait for w in st.waiters]
        assert all(w is not None and w > 0 for w in want)

        d = json.loads(cli(url, "status", "ws1", "--json").stdout)
        assert d["drain"] == dataclasses.asdict(drain)
        assert [w["estimated_wait_s"] for w in d["waiters"]] == pytest.approx(want)
        assert all("estimated_wait" not in w for w in d["waiters"])  # one name for it

        out = cli(url, "status", "ws1").stdout
        assert "est. wait" in out and "queue drains " in out and "grants/s while busy" in out, out
        for w in want:
            assert f"~{w:.1f}s" in out, (w, out)

        top = cli(url, "top", "ws1", "--once")
        assert top.returncode == 0, top.stderr
        assert "est. wait" in top.stdout and "grants/s while busy" in top.stdout, top.stdout
        for w in want:
            assert f"~{w:.1f}s" in top.stdout, (w, top.stdout)
    finally:
        holder.release()
        for t in threads:
            t.join(240)


def test_run_says_how_long_it_is_expected_to_wait(redis_proc1, sync_pool):
    url = redis_proc1.url
    pool = sync_pool("ws2", capacity=UNIT)
    measure_drain(pool, UNIT)
    holder = pool.acquire(UNIT)
    env = {**os.environ, "GPULOCK_REDIS_URL": url}
    proc = subprocess.Popen(
        [*gpulock_argv(), "run", "--pool", "ws2", "--amount", str(UNIT), "--", "true"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    try:
        wait_until(lambda: pool.status().waiter_count == 1, 60, "gpulock run to queue")
        est = pool.status().waiters[0].estimated_wait
        assert est is not None
        holder.release()
        assert proc.wait(120) == 0
        reader.start()
        reader.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    waiting = [ln for ln in lines if "waiting for" in ln]
    assert waiting, lines
    # the server's estimate as the acquire answered it (at most the status's, read later on
    # the same rate and queue)
    assert "position 1 in the queue of 1, about " in waiting[0], waiting
    assert waiting[0].rstrip().endswith("s left"), waiting


async def test_a_503_carries_the_estimate_its_retry_after_comes_from(redis_proc1, sync_pool):
    """A request that leaves the queue is told the time for the whole queue to drain (the
    estimate at its tail), a parked one its own place's; Retry-After is that estimate put
    through the policy; /metrics shows the drain rate and the head's estimate."""
    pool = sync_pool("ws3", capacity=4 * GiB)
    drain = measure_drain(pool, 4 * GiB)
    app, gpu = one_route_app(redis_proc1.url, "ws3", acquire_timeout=0.5, park_timeout=5.0)
    install_http_guards(app)  # its error handlers put the estimate in the body
    async with Running(app) as c:
        holder = pool.acquire(4 * GiB)
        try:
            r = await c.post("/sync", json={})  # no X-Request-ID: it leaves the queue
            assert r.status_code == 503, r.text
            body = r.json()
            tail = wait_seconds_at_tail(
                queued_bytes=0, queue_length=0, amount=GiB, free_bytes=0, rate=drain
            )
            assert body["estimated_wait_s"] == pytest.approx(tail, abs=1e-3), body
            cap = gpu.settings.max_retry_after
            assert r.headers["retry-after"] == str(retry_after(tail, cap=cap))

            # it left the queue (the cancel runs on this loop): the next one is at its head
            await status_until(redis_proc1.url, "ws3", lambda st: st.waiter_count == 0, 60)
            r = await c.post("/sync", json={}, headers={"X-Request-ID": "parked"})
            assert r.status_code == 503 and "keeps its place" in r.json()["detail"], r.text
            est = pool.status().waiters[0].estimated_wait  # its own, as the server has it
            assert r.json()["estimated_wait_s"] == pytest.approx(est, abs=1e-3), r.text
            ra = retry_after(est, cap=cap, keep_place=gpu.settings.park_timeout)
            assert r.headers["retry-after"] == str(ra)

            m = (await gpu.metrics_response()).body.decode()
            assert _gauge(m, "gpulock_pool_drain_bytes_per_second") == drain.bytes_per_s
            assert _gauge(m, "gpulock_pool_drain_grants_per_second") == drain.grants_per_s
            assert _gauge(m, "gpulock_pool_head_estimated_wait_seconds") == pytest.approx(est)
        finally:
            holder.release()


def _gauge(text: str, name: str) -> float:
    """The one sample of ``name`` in a Prometheus text exposition."""
    got = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
    assert len(got) == 1, (name, got)
    return float(got[0].split()[-1])


async def test_the_estimator_uses_the_servers_estimate_else_the_rates(redis_proc1):
    """RetryAfterEstimator.answer: the server's estimate (a listed waiter's, or at the tail
    for a place not listed) once the pool's drain rate is measured; today's rates (and no
    estimate to report for the per-place guess) while it is not."""
    from dataclasses import replace

    from gpulock import PoolStatus
    from gpulock.estimates.wait import DrainRate
    from gpulock.fastapi import GpuLimiter
    from gpulock.estimates.wait import wait_seconds
    from gpulock.protocol.replies import WaiterInfo

    gpu = GpuLimiter(redis_proc1.url, "ws4", ttl=30, max_retry_after=60, park_timeout=30)
    bare = PoolStatus("ws4", 10 * GiB, 10 * GiB, 0, 0, 10, 1, 2, 0, 0, 0)
    gpu.backend.status = bare
    assert gpu.retry.answer(3) == (3, None)  # nothing measured: one second a place, a guess
    gpu.retry.pool_rate.rate = 4.0
    assert gpu.retry.answer(8) == (2, 2.0)  # the worker's busy rate: 8 / 4

    drain = DrainRate(bytes_per_s=float(GiB), grants_per_s=2.0)
    waiters = [
        WaiterInfo(
            i + 1,
            f"r{i}",
            2 * GiB,
            1.0,
            10.0,
            {},
            ahead_bytes=2 * GiB * i,
            estimated_wait=wait_seconds(
                ahead_bytes=2 * GiB * i, amount=2 * GiB, free_bytes=0, position=i + 1, rate=drain
            ),
        )
        for i in range(2)
    ]
    st = replace(bare, drain=drain, waiters=waiters)
    gpu.backend.status = st
    assert [w.estimated_wait for w in st.waiters] == [2.0, 4.0]  # 2, then 4 GiB at 1 GiB/s
    assert gpu.retry.answer(2) == (4, 4.0)  # the listed waiter's own
    # a place not listed, or the tail: behind the queue's bytes (here 4 GiB and 1 GiB of its own)
    tail = replace(st, waiter_count=2).estimated_wait_for(GiB)
    assert tail == 5.0
    assert gpu.retry.answer(3, amount=GiB) == (5, tail)
    assert gpu.retry.answer(3, amount=GiB, tail=True) == (5, tail)
    # at the tail behind one waiter only: its bytes alone are ahead
    assert gpu.retry.answer(2, amount=GiB, tail=True).estimated_wait == 3.0
    # a request's own estimate wins; the local part is added at the worker's rate
    gpu.retry.local_rate.rate = 1.0
    assert gpu.retry.answer(1, pool_wait=0.5, local=2) == (3, 2.5)
    # a parked request is told at most half its kept place
    assert gpu.retry.answer(1, pool_wait=40.0, parked=True) == (15, 40.0)


async def test_the_services_openai_shaped_503_carries_the_estimate(redis_proc1, sync_pool):
    """The embeddings service's error shape (gpulock_service.openai_errors): the estimate is
    in the ``error`` object, next to gpulock's reason."""
    from gpulock_service.openai_errors import guard_detail, install_openai_errors

    pool = sync_pool("ws5", capacity=4 * GiB)
    drain = measure_drain(pool, 4 * GiB)
    app, gpu = one_route_app(redis_proc1.url, "ws5", acquire_timeout=0.5, park_timeout=0)
    install_http_guards(app, detail=guard_detail)
    install_openai_errors(app)
    async with Running(app) as c:
        holder = pool.acquire(4 * GiB)
        try:
            r = await c.post("/sync", json={})
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "queue_timeout", err
            tail = wait_seconds_at_tail(
                queued_bytes=0, queue_length=0, amount=GiB, free_bytes=0, rate=drain
            )
            assert err["estimated_wait_s"] == pytest.approx(tail, abs=1e-3), err
            cap = gpu.settings.max_retry_after
            assert r.headers["retry-after"] == str(retry_after(tail, cap=cap))
        finally:
            holder.release()
