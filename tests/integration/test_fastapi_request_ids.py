"""The idempotency header of a user's GpuLimiter app (in-process, a real Redis): an id over
128 bytes is the idempotency key cut by no one: a 400 ``invalid_request_id`` naming the bound,
never echoed, nothing run; also under a header of the app's own naming and without
``install_http_guards`` (which refuses an ``X-Request-ID`` over the bound before the app)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from support.apps import Running

from gpulock.http.access_log import MAX_REQUEST_ID_BYTES
from gpulock.fastapi import GpuLimiter

pytestmark = pytest.mark.timeout(60)


def _app(url: str, header: str) -> tuple[FastAPI, list[str]]:
    gpu = GpuLimiter(url, "rid", capacity="4GiB", request_id_header=header)
    app = FastAPI(lifespan=gpu.lifespan)
    ran: list[str] = []

    @app.post("/work")
    @gpu.endpoint("work", estimate=lambda body: 2**20)
    def work(body: dict) -> dict:
        ran.append(body["x"])
        return {"x": body["x"]}

    return app, ran


@pytest.mark.parametrize("header", ["X-Request-ID", "Idempotency-Key"])
async def test_an_id_over_the_bound_is_400_and_runs_nothing(redis_proc1, header):
    app, ran = _app(redis_proc1.url, header)
    async with Running(app) as c:
        long_id = "k" * (MAX_REQUEST_ID_BYTES + 1)
        r = await c.post("/work", json={"x": "a"}, headers={header: long_id})
        assert r.status_code == 400, r.text
        msg = r.json()["detail"]
        assert f"{header} is {MAX_REQUEST_ID_BYTES + 1} bytes long" in msg
        assert f"at most {MAX_REQUEST_ID_BYTES} bytes" in msg and long_id not in msg
        assert header.lower() not in r.headers and ran == []
        ok = await c.post("/work", json={"x": "b"}, headers={header: long_id[:-1]})
        assert ok.status_code == 200 and ok.headers[header] == long_id[:-1]
        assert ran == ["b"]
