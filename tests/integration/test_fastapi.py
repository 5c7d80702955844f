"""gpulock.fastapi in-process, against a real Redis: the pieces the e2e tests exercise through
gunicorn, here one at a time and with exact assertions (error mapping, Retry-After, request
ids, cancellation, c05, OOM traceback release, estimates, metrics), plus the import-time
promises (no torch, no sockets)."""

from __future__ import annotations

import asyncio
import gc
import math
import re
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
from fastapi import Depends, FastAPI
from support.apps import Running
from support.pools import status_until
from support.waiting import async_wait_until

from gpulock import AsyncPool
from gpulock.cuda import (
    DeviceMemory,
    drop_traceback,
    empty_cache,
    is_cuda_error,
    is_fatal_cuda_error,
    is_oom,
)
from gpulock.fastapi import (
    GpuCall,
    GpuLimiter,
    current_lease,
    metrics,
    next_bucket,
    request_ticket,
)
from gpulock_service.estimators import BertEstimator

GiB = 2**30
pytestmark = pytest.mark.timeout(60)


# ---- pure pieces ---------------------------------------------------------------------------------


def test_request_ticket_is_valid_and_stable_for_any_header_value():
    pat = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
    for v in ["abc", "x" * 5000, "with spaces / slashes {braces}", "ünïcødé ✓", "", "\x00\n"]:
        t = request_ticket("embeddings", v)
        assert pat.match(t) and t == request_ticket("embeddings", v)
    assert request_ticket("a", "same") != request_ticket("b", "same")
    assert request_ticket("a", "one") != request_ticket("a", "two")


def test_bert_estimator_formula():
    est = BertEstimator()  # all-MiniLM-L6-v2
    b, s = 32, 128
    elems = b * s * (6 * 384 + 2 * 1536) + 2 * b * 12 * s * s
    assert est.peak(b, s) == 4 * elems
    assert est(b, s) == math.ceil(2.0 * 4 * elems)
    assert est(1, 1) == 2 * 2**20  # the floor
    assert est(64, 32) > est(32, 32) > est(32, 16)
    assert [next_bucket(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [1, 1, 2, 4, 8, 64, 128]
    assert next_bucket(3, minimum=8) == 8


def test_cuda_error_classification_and_traceback_release():
    import torch

    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert is_oom(oom) and is_cuda_error(oom) and not is_fatal_cuda_error(oom)
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert is_oom(
        RuntimeError("cuBLAS error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")
    )
    for msg in (
        "CUDA error: device-side assert triggered",
        "CUDA error: an illegal memory access was encountered",
        "CUDA error: misaligned address",
        "CUDA error: unspecified launch failure",
    ):
        assert is_fatal_cuda_error(RuntimeError(msg)) and not is_oom(RuntimeError(msg))
    assert is_fatal_cuda_error(
        torch.AcceleratorError("CUDA error: an illegal instruction was encountered")
    )
    assert not is_cuda_error(ValueError("CUDA out of memory"))  # not a RuntimeError: a user's error
    assert not is_cuda_error(RuntimeError("shape mismatch"))
    assert empty_cache() is False  # no CUDA context here: does nothing, raises nothing

    class Big:
        pass

    def fails():
        pinned = Big()
        ref.append(weakref.ref(pinned))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    ref: list = []
    try:
        fails()
    except Exception as e:
        err = e
    gc.collect()
    assert ref[0]() is not None, "the traceback pins the frame's locals"
    drop_traceback(err)
    gc.collect()
    assert ref[0]() is None


def test_import_does_no_io_and_no_torch():
    code = textwrap.dedent("""
        import socket, sys
        def refuse(*a, **k):
            raise AssertionError("a socket was opened at import time")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        import gpulock_service.app as m
        app = m.app                      # what gunicorn --preload does in the master
        import gpulock.fastapi, gpulock.cuda
        import typer
        from gpulock_service.cli import register
        t = typer.Typer(); register(t)
        names = sorted(c.name for c in t.registered_commands)
        heavy = [x for x in ("torch", "sentence_transformers", "transformers", "gunicorn") if x in sys.modules]
        print(names, heavy)
    """)
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"GPULOCK_REDIS_URL": "redis://10.255.255.1:1/0", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "['loadtest', 'serve'] []", r.stdout


def test_decide_capacity(monkeypatch):
    from gpulock_service.serve import decide_capacity

    import gpulock.cuda

    assert decide_capacity("3GiB", 0.9, "auto") == (3 * GiB, "--capacity / GPULOCK_CAPACITY", True)
    cap, src, explicit = decide_capacity(None, 0.9, "cpu")
    assert cap == 2 * GiB and "CPU default" in src and not explicit
    monkeypatch.setattr(
        gpulock.cuda,
        "device_memory",
        lambda idx=0, **k: DeviceMemory(80 * GiB, 79 * GiB, "nvml", "H100"),
    )
    cap, src, explicit = decide_capacity(None, 0.9, "auto")
    assert cap == int(80 * GiB * 0.9) and "H100" in src and "nvml" in src and not explicit
    monkeypatch.setattr(gpulock.cuda, "device_memory", lambda idx=0, **k: None)
    assert decide_capacity(None, 0.9, "auto")[0] == 2 * GiB


def test_settings_from_environment(monkeypatch):
    from gpulock_service.settings import Settings

    monkeypatch.setenv("GPULOCK_CAPACITY", "6GiB")
    monkeypatch.setenv("GPULOCK_RESIDENT", "0")
    monkeypatch.setenv("GPULOCK_ACQUIRE_TIMEOUT", "2.5")
    s = Settings()
    assert s.capacity == "6GiB" and s.resident_bytes() == 0 and s.acquire_timeout == 2.5
    monkeypatch.setenv("GPULOCK_CAPACITY", "lots")
    with pytest.raises(Exception, match="capacity"):
        Settings()


# ---- a user's app ----------------------------------------------------------------------------------


def _app(url: str, pool: str, **kw) -> tuple[FastAPI, GpuLimiter, dict]:
    kw.setdefault("capacity", 4 * GiB)
    kw.setdefault("configure", "set")
    gpu = GpuLimiter(url, pool, **kw)
    app = FastAPI(lifespan=gpu.lifespan)
    seen: dict = {"inside": 0, "max_inside": 0, "tokens": []}
    lock = threading.Lock()

    def work(seconds: float, fail: str = "") -> dict:
        lease = current_lease()
        assert lease is not None and not lease.lost
        seen["tokens"].append(lease.token)
        with lock:
            seen["inside"] += 1
            seen["max_inside"] = max(seen["max_inside"], seen["inside"])
        try:
            if fail == "oom":
                import torch

                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
            if fail == "assert":
                raise RuntimeError("CUDA error: device-side assert triggered")
            time.sleep(seconds)
            return {"ok": True, "seconds": seconds}
        finally:
            with lock:
                seen["inside"] -= 1

    @app.post("/run")
    async def run(
        body: dict, call: GpuCall = Depends(gpu.guard("run", estimate=lambda seconds, fail="": GiB))
    ):
        if "gib" in body:
            return await call(
                work, body.get("seconds", 0.0), body.get("fail", ""), amount=body["gib"] * GiB
            )
        return await call(work, body.get("seconds", 0.0), body.get("fail", ""))

    @app.post("/sync")
    @gpu.endpoint("sync", estimate=lambda body: body.get("gib", 1) * GiB)
    def sync_route(body: dict) -> dict:
        return work(body.get("seconds", 0.0), body.get("fail", ""))

    @app.get("/health")
    async def health():
        return {"ok": True}

    return app, gpu, seen


_Running = Running  # the lifespan + in-process client harness (tests/support/apps.py)


async def _used(url: str, pool: str, *, settle_at: int | None = None) -> int:
    """The pool's used bytes; with ``settle_at``, wait up to 2 s for that value (the release
    is sent right after the response, so it can land a moment after the client got it)."""
    p = AsyncPool.from_url(url, pool)
    try:
        deadline = time.monotonic() + 2
        while True:
            used = (await p.status()).used
            if settle_at is None or used == settle_at or time.monotonic() > deadline:
                return used
            await asyncio.sleep(0.01)
    finally:
        await p.aclose()


async def test_guarded_call_runs_under_a_lease_and_releases(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "it1")
    async with _Running(app) as c:
        r = await c.post("/sync", json={"seconds": 0.05})
        assert r.status_code == 200 and r.json() == {"ok": True, "seconds": 0.05}
        assert "gpulock-wait" in r.headers["server-timing"]
        r = await c.post("/run", json={"seconds": 0.05})
        assert r.status_code == 200
        assert await _used(redis_proc1.url, "it1", settle_at=0) == 0
        assert len(seen["tokens"]) == 2 and seen["tokens"][1] > seen["tokens"][0]


async def test_capacity_never_exceeded_and_health_free(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "it2", executor_threads=8, acquire_timeout=20)
    async with _Running(app) as c:

        async def probe():
            worst = 0.0
            for _ in range(15):
                t0 = time.monotonic()
                assert (await c.get("/health")).status_code == 200
                worst = max(worst, time.monotonic() - t0)
                await asyncio.sleep(0.03)
            return worst

        rs = await asyncio.gather(
            *(c.post("/sync", json={"seconds": 0.1, "gib": 2}) for _ in range(10)), probe()
        )
        assert [r.status_code for r in rs[:-1]] == [200] * 10
        assert seen["max_inside"] == 2  # 4 GiB / 2 GiB, although 8 threads were free
        assert rs[-1] < 0.1


async def test_errors_map_to_http(redis_proc1):
    import torch  # noqa: F401  here, not first inside the guarded work: that import can outlast 0.3 s

    app, gpu, seen = _app(
        redis_proc1.url,
        "it3",
        acquire_timeout=0.5,
        inference_timeout=0.3,
        exit_on_fatal=False,
        park_timeout=0,
    )
    m = metrics()
    async with _Running(app) as c:
        r = await c.post("/sync", json={"gib": 5})
        assert r.status_code == 413
        assert "5.0GiB" in r.json()["detail"] and "4.0GiB" in r.json()["detail"]

        # queue timeout: one request holds the whole pool, the next waits 0.5 s then gets 503
        # (3 s of work: the checks below run while its thread still holds the lease, however
        # slowly this machine answers; the holder's grant is seen in Redis before the next one.)
        hold = asyncio.create_task(c.post("/sync", json={"seconds": 3.0, "gib": 4}))
        for _ in range(200):
            if await _used(redis_proc1.url, "it3") == 4 * GiB:
                break
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        r = await c.post("/sync", json={"gib": 4})
        assert r.status_code == 503 and 0.4 < time.monotonic() - t0 < 2.5  # not at the hold's end
        assert int(r.headers["retry-after"]) >= 1 and r.headers["x-queue-position"] == "1"
        assert (await hold).status_code == 504  # 3 s of work, 0.3 s inference timeout
        # c05: the 504 did not free the lease; it goes when the thread returns
        assert await _used(redis_proc1.url, "it3") == 4 * GiB
        for _ in range(200):
            if await _used(redis_proc1.url, "it3") == 0:
                break
            await asyncio.sleep(0.05)
        assert await _used(redis_proc1.url, "it3") == 0

        before = m.oom.labels("sync")._value.get()
        r = await c.post("/sync", json={"fail": "oom"})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
        assert m.oom.labels("sync")._value.get() == before + 1

        r = await c.post("/sync", json={"fail": "assert"})
        assert r.status_code == 500 and "device-side assert" in r.json()["detail"]
        assert gpu.ready.fatal_error and not gpu.readiness()[0]
        r = await c.post("/sync", json={})
        assert r.status_code == 503 and "not ready" in r.json()["detail"]
        assert await _used(redis_proc1.url, "it3", settle_at=0) == 0


async def test_cancelled_requests_leak_nothing(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "it4", acquire_timeout=10, park_timeout=0)
    async with _Running(app) as c:
        # 3 s of work: still held when the checks below run, however slow this machine is.
        hold = asyncio.create_task(c.post("/sync", json={"seconds": 3.0, "gib": 4}))
        await status_until(redis_proc1.url, "it4", lambda st: st.used == 4 * GiB)
        waiters = [asyncio.create_task(c.post("/sync", json={"gib": 1})) for _ in range(20)]
        await status_until(redis_proc1.url, "it4", lambda st: st.waiter_count >= 1)
        await asyncio.sleep(0.2)  # more of them queue meanwhile (not needed for the checks)
        for w in waiters:  # clients going away while queued
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        await status_until(redis_proc1.url, "it4", lambda st: st.waiter_count == 0)  # withdrawn
        p = AsyncPool.from_url(redis_proc1.url, "it4")
        try:
            st = await p.status()
            assert st.waiter_count == 0 and st.used == 4 * GiB
            assert (await hold).status_code == 200
            assert await _used(redis_proc1.url, "it4", settle_at=0) == 0
        finally:
            await p.aclose()
        r = await c.post("/sync", json={"gib": 4})
        assert r.status_code == 200


async def test_request_id_makes_retries_idempotent(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "it5")
    async with _Running(app) as c:
        h = {"X-Request-ID": "my request / 1"}
        a, b = await asyncio.gather(
            c.post("/sync", json={"seconds": 0.3}, headers=h),
            c.post("/sync", json={"seconds": 0.3}, headers=h),
        )
        assert a.status_code == b.status_code == 200 and a.json() == b.json()
        assert len(seen["tokens"]) == 1, "two requests with one id ran once"
        assert a.headers["x-request-id"] == "my request / 1"
        again = await c.post("/sync", json={"seconds": 0.3}, headers=h)
        assert again.status_code == 200 and again.headers["x-idempotent-replay"] == "true"
        assert len(seen["tokens"]) == 1
        other = await c.post("/sync", json={"seconds": 0.2}, headers=h)
        assert other.status_code == 409


async def test_503_with_request_id_keeps_the_place(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "it6", acquire_timeout=0.3, park_timeout=10)
    async with _Running(app) as c:
        # 3 s of work, granted before the others ask (seen in Redis): both 503s below come
        # while it holds the pool, however slow this machine is.
        hold = asyncio.create_task(c.post("/sync", json={"seconds": 3.0, "gib": 4}))
        await status_until(redis_proc1.url, "it6", lambda st: st.used == 4 * GiB)
        h = {"X-Request-ID": "parked"}
        r = await c.post("/sync", json={"seconds": 0.0, "gib": 4}, headers=h)
        assert r.status_code == 503 and r.headers["x-queue-position"] == "1"
        assert "keeps its place" in r.json()["detail"]
        late = await c.post("/sync", json={"seconds": 0.0, "gib": 4})  # behind the parked one
        assert late.status_code == 503 and late.headers["x-queue-position"] == "2"
        assert (await hold).status_code == 200
        # the parked request ran when its turn came: granted (the second grant) and released
        await status_until(
            redis_proc1.url,
            "it6",
            lambda st: st.grants >= 2 and st.used == 0 and st.waiter_count == 0,
        )
        r = await c.post("/sync", json={"seconds": 0.0, "gib": 4}, headers=h)
        assert r.status_code == 200 and r.headers["x-idempotent-replay"] == "true"


async def test_a_parked_request_keeps_its_place_for_as_long_as_it_retries(redis_proc1):
    """Each 503 extends the place (gpulock.http.places): a client that keeps coming back keeps
    its rank however long the queue takes, well past ``acquire_timeout + park_timeout``
    from its first arrival (when the place used to run out and the retry queued again at the
    back, behind a later request)."""
    app, gpu, seen = _app(redis_proc1.url, "it6b", acquire_timeout=0.3, park_timeout=1.0)
    async with _Running(app) as c:
        holder = AsyncPool.from_url(redis_proc1.url, "it6b")
        lease = await holder.acquire(4 * GiB, ttl=30)  # the pool is full until released below
        try:
            h = {"X-Request-ID": "keeps-coming-back"}
            first = time.monotonic()
            r = await c.post("/sync", json={"gib": 4}, headers=h)
            assert r.status_code == 503 and r.headers["x-queue-position"] == "1"
            later = await c.post("/sync", json={"gib": 4}, headers={"X-Request-ID": "later"})
            assert later.status_code == 503 and later.headers["x-queue-position"] == "2"
            retries = 0
            while time.monotonic() - first < 3 * (0.3 + 1.0):
                r = await c.post("/sync", json={"gib": 4}, headers=h)
                assert r.status_code == 503, r.text
                assert r.headers["x-queue-position"] == "1", (retries, r.headers)
                retries += 1
        finally:
            await lease.release()
            await holder.aclose()
        # its turn came: it ran (the first grant after the holder's), and a retry collects it
        await status_until(redis_proc1.url, "it6b", lambda st: st.grants >= 2 and st.used == 0)
        r = await c.post("/sync", json={"gib": 4}, headers=h)
        assert r.status_code == 200 and r.headers["x-idempotent-replay"] == "true"
        assert retries >= 3


async def test_retry_after_follows_the_grant_rate(redis_proc1):
    gpu = GpuLimiter(redis_proc1.url, "it7", ttl=30, max_retry_after=60, park_timeout=30)
    assert gpu.retry.retry_after(3) == 3  # nothing measured: one second per place
    assert gpu.retry.retry_after(3, server_hint=2.2) == 3  # ... or the server's hint when shorter
    assert gpu.retry.retry_after(3, server_hint=1.2) == 2
    gpu.retry.pool_rate.rate = 4.0
    assert [gpu.retry.retry_after(p) for p in (1, 4, 5, 40, 1000)] == [1, 1, 2, 10, 60]
    # A parked request keeps its place for park_timeout: never tell it to come back later.
    assert [gpu.retry.retry_after(p, parked=True) for p in (5, 40, 1000)] == [2, 10, 15]
    gpu.retry.local_rate.rate = 1.0  # this worker drains its own thread queue at 1/s
    assert gpu.retry.retry_after(4, local=3) == 4  # 4/4 + 3/1
    gpu.retry.pool_rate.rate = 0.0
    gpu.retry.hold_ewma = 2.0
    from gpulock import PoolStatus

    gpu.backend.status = PoolStatus("it7", 10, 4, 0, 0, 10, 4, 0, 0, 0, 0)
    assert gpu.retry.grant_rate() == 2.0  # Little's law: 4 leases / 2 s
    assert gpu.retry.retry_after(6) == 3


async def test_calibrated_estimates_are_shared(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "it8")
    formula = BertEstimator()
    async with _Running(app):
        assert gpu.estimate("embeddings", 20, 30, formula) == formula(20, 30)
        assert gpu.estimates.key == "gpulock:{it8}:estimates"
        await gpu.backend.redis.hset(gpu.estimates.key, "embeddings|b32|s32", 12345678)
        await gpu.estimates.refresh()
        assert gpu.estimate("embeddings", 20, 30, formula) == 12345678  # bucket (32, 32)
        assert gpu.estimate("embeddings", 40, 30, formula) == formula(40, 30)
        with pytest.raises(RuntimeError, match="CUDA"):
            await gpu.calibrate("embeddings", lambda b, s: None, [(1, 8)], "cpu", formula)


async def test_metrics_read_the_pool_from_redis(redis_proc1):
    from prometheus_client.parser import text_string_to_metric_families

    app, gpu, seen = _app(redis_proc1.url, "it9")

    @app.get("/metrics")
    async def m():
        return await gpu.metrics_response()

    async with _Running(app) as c:
        hold = asyncio.create_task(
            c.post("/sync", json={"seconds": 3.0, "gib": 3})
        )  # held while we read
        await status_until(redis_proc1.url, "it9", lambda st: st.used == 3 * GiB)
        text = (await c.get("/metrics")).text
        vals = {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.labels.get("pool") == "it9"
        }
        assert vals["gpulock_pool_capacity_bytes"] == 4 * GiB
        assert vals["gpulock_pool_used_bytes"] == 3 * GiB
        assert vals["gpulock_pool_leases"] == 1 and vals["gpulock_pool_up"] == 1
        assert (await hold).status_code == 200
        assert "gpulock_requests_total" in text and "gpulock_acquire_wait_seconds_bucket" in text


async def test_not_ready_until_conditions_hold(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "it10")
    async with _Running(app) as c:
        gpu.set_condition("model", False, "loading")
        r = await c.post("/sync", json={})
        assert (
            r.status_code == 503
            and "loading" in r.json()["detail"]
            and r.headers["retry-after"] == "1"
        )
        ready, checks = gpu.readiness()
        assert not ready and checks["model"] == {"ok": False, "message": "loading"}
        gpu.set_condition("model", True)
        assert gpu.readiness()[0]
        assert (await c.post("/sync", json={})).status_code == 200


async def test_resident_lease_waits_without_blocking_requests(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "it11", capacity=10 * GiB)
    other = AsyncPool.from_url(redis_proc1.url, "it11")
    async with _Running(app) as c:
        residents = [
            await other.acquire(3 * GiB, holder={"purpose": "resident:model"}, resident=True)
            for _ in range(3)
        ]
        task = asyncio.create_task(gpu.acquire_resident(3 * GiB))
        for _ in range(500):  # until the resident request found it does not fit (not a sleep)
            if "shortfall" in gpu.readiness()[1].get("resident_lease", {}).get("message", ""):
                break
            await asyncio.sleep(0.01)
        assert not task.done()
        ready, checks = gpu.readiness()
        assert not ready and "shortfall 2.0GiB" in checks["resident_lease"]["message"]
        st = await other.status()
        assert st.waiter_count == 0, "a resident request that cannot fit must not sit in the queue"
        gpu.set_condition("model", True)
        gpu.resident.wanted = 0  # let requests through for this check
        r = await c.post("/sync", json={"gib": 1})
        assert r.status_code == 200
        gpu.resident.wanted = 3 * GiB
        await residents[0].release()
        lease = await asyncio.wait_for(task, 5)
        assert lease.amount == 3 * GiB and gpu.readiness()[0]
        for lz in residents[1:]:
            await lz.release()
    await other.aclose()


def _documented_acls() -> tuple[str, str]:
    """The library's ACL line and the service's extra rules, as docs/RELIABILITY.md gives them."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "RELIABILITY.md").read_text()
    core = re.search(r"^ACL SETUSER gpulock (.+)$", doc, re.M)
    extra = re.search(r"^SERVICE-ACL (.+)$", doc, re.M)
    assert core and extra, "docs/RELIABILITY.md lost its ACL lines"
    return core.group(1).strip(), extra.group(1).strip()


async def _run_under_acl(url: str, admin_url: str, pool: str) -> list[str]:
    """Configure the pool as admin, then drive the service as the limited user; returns the
    problems seen (responses that were not 200, log records of failed Redis calls)."""
    import logging

    import redis as sync_redis

    admin = AsyncPool.from_url(admin_url, pool)
    await admin.configure(4 * GiB)
    await admin.aclose()
    problems: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING or "NOPERM" in record.getMessage():
                problems.append(record.getMessage())

    h = Catch()
    logging.getLogger("gpulock").addHandler(h)
    try:
        app, gpu, _ = _app(url, pool, capacity=None, acquire_timeout=5)
        async with _Running(app) as c:

            async def post(
                what: str, headers: dict | None = None, replay: bool = False, seconds: float = 0.0
            ) -> None:
                try:
                    r = await c.post(
                        "/sync", json={"gib": 1, "seconds": seconds}, headers=headers or {}
                    )
                except Exception as e:  # noqa: BLE001 - the app raised: a refused command
                    problems.append(f"{what}: {type(e).__name__}: {e}")
                    return
                if r.status_code != 200 or (
                    replay and r.headers.get("x-idempotent-replay") != "true"
                ):
                    problems.append(f"{what}: {r.status_code} {r.text}")

            if not gpu.readiness()[0]:
                problems.append(f"not ready: {gpu.readiness()[1]}")
            await post("plain request")
            await post("idempotent request", {"X-Request-ID": "acl-1"})
            await asyncio.sleep(0.3)  # the job's own clean-up (release, claim) after the answer
            await post("replay", {"X-Request-ID": "acl-1"}, replay=True)

            async def tick_during_a_request() -> None:
                await asyncio.sleep(0.2)
                try:
                    await gpu.reaper.tick(full=True)  # refreshes the running request's claim
                    await gpu.backend.redis.hgetall(gpu.estimates.key)
                except Exception as e:  # noqa: BLE001 - a refused command is what we look for
                    problems.append(f"tick: {e}")

            await asyncio.gather(
                post("slow idempotent request", {"X-Request-ID": "acl-2"}, seconds=0.5),
                tick_during_a_request(),
            )
            await asyncio.sleep(0.3)
            admin = sync_redis.Redis.from_url(admin_url)
            left = [k.decode() for k in admin.scan_iter(f"gpulock:{{{pool}}}:req:*")]
            admin.close()
            if left:
                problems.append(f"request claims not dropped: {left}")
            if gpu.backend.redis_error:
                problems.append(f"redis error: {gpu.backend.redis_error}")
    finally:
        logging.getLogger("gpulock").removeHandler(h)
    return problems


async def test_service_runs_under_the_documented_acl(redis_proc1):
    import redis as sync_redis

    core, extra = _documented_acls()
    admin = sync_redis.Redis.from_url(redis_proc1.url)
    host, port = redis_proc1.host, redis_proc1.port
    try:
        admin.execute_command("ACL", "SETUSER", "svc", "reset", *core.split(), *extra.split())
        url = f"redis://svc:PASSWORD@{host}:{port}/0"
        problems = await _run_under_acl(url, redis_proc1.url, "it-acl")
        assert not problems, problems
        # Each extra rule is needed: without it something above fails.
        needless = []
        for rule in extra.split():
            admin.execute_command(
                "ACL",
                "SETUSER",
                "svc",
                "reset",
                *core.split(),
                *[r for r in extra.split() if r != rule],
            )
            if not await _run_under_acl(
                url, redis_proc1.url, f"it-acl-{rule.strip('+').replace('|', '-')}"
            ):
                needless.append(rule)
        assert not needless, f"documented but not needed: {needless}"
    finally:
        admin.execute_command("ACL", "DELUSER", "svc")
        admin.close()


async def test_retry_after_of_a_withdrawn_request_counts_the_queue_behind_it(redis_proc1):
    """Without X-Request-ID a 503 withdraws the request; its retry joins at the back, so
    Retry-After must cover the whole queue as it is now, not the old place. (A burst whose
    requests each timed out at the head used to be told "retry in 1 s" one after the other.)"""
    # acquire_timeout 3 s: all six must be queued before the first times out (with 0.6 s a
    # loaded machine let the first time out while the sixth was still on its way: a chance
    # failure); the holder outlasts all six timeouts.
    app, gpu, _ = _app(
        redis_proc1.url, "it-tail", acquire_timeout=3.0, park_timeout=0, executor_threads=8
    )
    async with _Running(app) as c:
        hold = asyncio.create_task(c.post("/sync", json={"seconds": 7.0, "gib": 4}))
        await status_until(redis_proc1.url, "it-tail", lambda st: st.used == 4 * GiB)
        waiting = []
        for i in range(
            6
        ):  # queued one after the other (each seen in Redis before the next is sent)
            waiting.append(asyncio.create_task(c.post("/sync", json={"gib": 4})))
            await status_until(
                redis_proc1.url,
                "it-tail",
                lambda st, n=i + 1: (
                    st.waiter_count >= n or st.reaped_waiters or any(t.done() for t in waiting)
                ),
            )
        rs = await asyncio.gather(*waiting)
        assert [r.status_code for r in rs] == [503] * 6
        first = rs[0]
        assert first.headers["x-queue-position"] == "1"
        # Nothing measured yet (no grant has finished): one second per place of the 6 queued.
        assert int(first.headers["retry-after"]) >= 6, first.headers
        assert (await hold).status_code == 200


async def test_a_job_cancelled_during_its_release_is_not_a_failed_release(
    redis_proc1, tmp_path, caplog
):
    """The job task is cancelled (overload: a 503, a client gone, a shutdown) while the
    shielded release of its lease is on its way (here: Redis paused). That is not a failed
    release: nothing is logged, and the release completes once Redis answers. (It logged
    "release failed (); the lease expires after its ttl": the CancelledError, with no text.)"""
    import logging

    caplog.set_level(logging.WARNING, logger="gpulock")
    import os

    hist = tmp_path / f"history.{os.getpid()}.jsonl"  # GpuLimiter appends ".<pid>.jsonl"
    gpu = GpuLimiter(
        redis_proc1.url,
        "it-cancel-release",
        capacity=4 * GiB,
        configure="set",
        history_file=str(tmp_path / "history"),
        reaper_interval=30,
        exit_on_fatal=False,
    )
    app = FastAPI(lifespan=gpu.lifespan)
    entered, go = threading.Event(), threading.Event()

    @app.post("/sync")
    @gpu.endpoint("sync", estimate=lambda body: GiB)
    def sync_route(body: dict) -> dict:
        entered.set()
        go.wait(10)
        return {"ok": True}

    async with _Running(app) as c:
        req = asyncio.create_task(c.post("/sync", json={}))
        await async_wait_until(entered.is_set, timeout=10)
        (job,) = list(gpu.jobs.all)
        redis_proc1.pause()
        try:
            go.set()
            await async_wait_until(lambda: '"e":"release"' in hist.read_text(), timeout=10)
            assert job.task is not None
            job.task.cancel()  # the release is in flight, shielded
            await asyncio.wait({job.task}, timeout=10)
        finally:
            redis_proc1.resume()
        assert (await req).status_code == 200
        assert (
            await _used(redis_proc1.url, "it-cancel-release", settle_at=0) == 0
        )  # the release completed
    failed = [r.getMessage() for r in caplog.records if "release failed" in r.getMessage()]
    assert not failed, failed
