"""``GpuLimiter(keep=...)`` (the service's ``GPULOCK_KEEP``; docs/SEMANTICS.md, "Kept bytes"):
with keep on, a worker's sequential requests of one size after the first grant are granted
from its kept lease with no acquire in Redis (the pool's own grant counter stays at 1, the
worker's ``gpulock_kept_grants_total`` grows); a request of another pool object that does not
fit while the bytes are kept is granted once the worker gives them back; a request with
``X-Request-ID`` never uses kept bytes; with keep off nothing is kept; a bad value is refused
naming ``keep`` (``GPULOCK_KEEP`` for the service)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from support.apps import Running, one_route_app
from support.waiting import async_wait_until

from gpulock import AsyncPool, InvalidArgument
from gpulock.fastapi._kept import kept_counts

GiB = 2**30
pytestmark = pytest.mark.timeout(90)


def _app(url: str, pool: str, **kw: Any) -> tuple[Any, Any]:
    app, gpu = one_route_app(url, pool, **kw)

    @app.get("/metrics")
    async def metrics_route() -> Any:
        return await gpu.metrics_response()

    return app, gpu


def _sample(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics:\n{text[:2000]}"
    return float(m.group(1))


async def _kept_idle(gpu: Any, n: int) -> dict[str, Any]:
    """Wait until the worker's pool object has ``n`` idle kept leases (a request's release
    goes out after its answer)."""
    return await async_wait_until(
        lambda: (c := kept_counts(gpu.backend.pool))["idle"] == n and c,
        10.0,
        f"{n} idle kept lease(s)",
    )


async def test_sequential_requests_are_granted_from_the_kept_lease(redis_proc1):
    url, name = redis_proc1.url, "keep1"
    app, gpu = _app(url, name, keep=30)
    admin = AsyncPool.from_url(url, name)
    try:
        async with Running(app) as c:
            before = _sample((await c.get("/metrics")).text, "gpulock_kept_grants_total")
            r = await c.post("/sync", json={})
            assert r.status_code == 200, r.text
            await _kept_idle(gpu, 1)  # released in keep mode: nobody waited, so kept
            for _ in range(5):
                r = await c.post("/sync", json={})
                assert r.status_code == 200, r.text
                await _kept_idle(gpu, 1)
            st = await admin.status()
            # one acquire reached Redis; the five after it were granted from the kept lease
            assert st.grants == 1, st
            assert st.used == GiB and st.lease_count == 1  # the kept bytes stay leased
            counts = kept_counts(gpu.backend.pool)
            assert counts["grants"] == 5 and counts["kept"] == 1, counts
            text = (await c.get("/metrics")).text
            assert _sample(text, "gpulock_kept_grants_total") - before == 5
            assert _sample(text, "gpulock_kept_idle_bytes") == GiB
            # a request with X-Request-ID (idempotent) never takes kept bytes
            r = await c.post("/sync", json={}, headers={"X-Request-ID": "keep-rid-1"})
            assert r.status_code == 200, r.text
            assert (await admin.status()).grants == 2
            assert kept_counts(gpu.backend.pool)["grants"] == 5
        # the worker's stop gave its idle kept lease back
        st = await admin.status()
        assert st.used == 0 and st.lease_count == 0, st
    finally:
        await admin.aclose()


async def test_a_request_of_another_pool_object_gets_the_kept_bytes(redis_proc1):
    """The pool has 4 GiB, the worker keeps 1 GiB idle: another pool object's request for the
    whole pool does not fit, queues, and the server tells the worker to give the kept bytes
    back; it is granted. The worker then asks Redis again, and keeps again once nobody
    waits."""
    url, name = redis_proc1.url, "keep2"
    app, gpu = _app(url, name, keep=30)
    other = AsyncPool.from_url(url, name)
    try:
        async with Running(app) as c:
            assert (await c.post("/sync", json={})).status_code == 200
            await _kept_idle(gpu, 1)
            lease = await other.acquire(4 * GiB, timeout=20)
            counts = await _kept_idle(gpu, 0)
            assert counts["given_back"] == 1 and counts["draining"], counts
            text = (await c.get("/metrics")).text
            assert _sample(text, "gpulock_kept_idle_bytes") == 0
            await lease.release()
            # draining: the next request asks Redis; its release, with nobody waiting, is kept
            assert (await c.post("/sync", json={})).status_code == 200
            counts = await _kept_idle(gpu, 1)
            assert counts["grants"] == 0 and counts["kept"] == 2 and not counts["draining"]
            assert (await other.status()).grants == 3
    finally:
        await other.aclose()


async def test_with_keep_off_every_request_asks_redis(redis_proc1):
    url, name = redis_proc1.url, "keep3"
    app, gpu = _app(url, name)
    admin = AsyncPool.from_url(url, name)
    try:
        async with Running(app) as c:
            assert gpu.settings.keep == 0.0 and gpu.backend.pool.keep == 0.0
            for _ in range(4):
                assert (await c.post("/sync", json={})).status_code == 200
            st = await admin.status()
            assert st.grants == 4, st
            counts = kept_counts(gpu.backend.pool)
            assert counts["grants"] == 0 and counts["kept"] == 0 and counts["idle"] == 0
            text = (await c.get("/metrics")).text
            assert _sample(text, "gpulock_kept_idle_bytes") == 0
    finally:
        await admin.aclose()


@pytest.mark.parametrize("bad", [0.05, -1, 3601, "abc", True, float("nan")])
def test_a_bad_keep_fails_when_the_limiter_is_made(bad):
    with pytest.raises(InvalidArgument, match=r"^keep must .*\(0: off"):
        one_route_app("redis://127.0.0.1:1/0", "p", keep=bad)


def test_keep_reaches_the_pool_object():
    _, gpu = one_route_app("redis://127.0.0.1:1/0", "p", keep="2.5")
    assert gpu.settings.keep == 2.5
    gpu.backend.connect(gpu.settings)  # no I/O
    try:
        assert gpu.backend.pool.keep == 2.5
    finally:
        gpu.backend.executor.shutdown(wait=False)


def test_the_services_keep_setting(monkeypatch):
    from pydantic import ValidationError

    from gpulock_service.serve import check_options
    from gpulock_service.settings import Settings
    from gpulock_service.state import make_limiter

    monkeypatch.setenv("GPULOCK_KEEP", "30")
    assert Settings().keep == 30.0
    assert make_limiter(Settings()).settings.keep == 30.0
    monkeypatch.setenv("GPULOCK_KEEP", "")
    assert Settings().keep == 0.0
    monkeypatch.delenv("GPULOCK_KEEP")
    assert make_limiter(Settings()).settings.keep == 0.0  # off by default
    for bad in ("0.05", "abc", "7200"):
        monkeypatch.setenv("GPULOCK_KEEP", bad)
        with pytest.raises(ValidationError, match="keep must"):
            Settings()
    monkeypatch.delenv("GPULOCK_KEEP")
    from gpulock.embedded import free_port

    kw = dict(redis_url=None, pool="p", model="sleep", log_level="info", host="127.0.0.1")
    problem = check_options(port=free_port(), keep="0.01", **kw)
    assert problem is not None and problem.startswith("bad setting: GPULOCK_KEEP: "), problem
    assert "keep must be between 0.1 and 3600 seconds" in problem, problem
    assert check_options(port=free_port(), keep="10", **kw) is None


def test_serve_refuses_a_bad_keep_before_it_starts_anything():
    import typer
    from typer.testing import CliRunner

    from gpulock.embedded import free_port
    from gpulock_service.cli import register

    app = typer.Typer()
    register(app)
    r = CliRunner().invoke(
        app, ["serve", "--keep", "0.05", "--model", "sleep", "--port", str(free_port())]
    )
    assert r.exit_code == 2, r.output
    out = r.output + (r.stderr if r.stderr_bytes is not None else "")
    assert "bad setting: GPULOCK_KEEP: " in out and "keep must be between 0.1 and 3600" in out
