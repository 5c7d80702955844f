"""``install_http_guards(app, detail=, too_large_hint=)``: a surface's own error body and 413
wording for the guards' 400, 408 and 413 (the broker passes ``{"error", "message"}``; the
default is the message, FastAPI's shape). A real uvicorn server on a free port."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

from gpulock.http.guards import install_http_guards
from support.ports import free_port


class Body(BaseModel):
    items: list[str]


def _app(**kw) -> FastAPI:
    app = FastAPI()
    install_http_guards(app, max_body_bytes=65536, read_timeout=1.0, **kw)

    @app.post("/items")
    async def items(b: Body) -> dict:
        return {"n": len(b.items)}

    @app.post("/mine")
    async def mine() -> dict:
        try:
            int("x")
        except ValueError as e:
            raise HTTPException(400, "my own message") from e
        return {}

    @app.get("/bug")
    async def bug() -> dict:
        def f(n: int) -> int:
            return f(n + 1)

        return {"n": f(0)}

    return app


@pytest.fixture
def serve():
    import uvicorn

    servers = []

    def start(app: FastAPI) -> str:
        port = free_port()
        s = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off")
        )
        t = threading.Thread(target=s.run, daemon=True)
        t.start()
        servers.append((s, t))
        deadline = time.monotonic() + 10
        while not s.started:
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.01)
        return f"http://127.0.0.1:{port}"

    yield start
    for s, t in servers:
        s.should_exit = True
        t.join(10)


def _slow_body(url: str) -> bytes:
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(
            b"POST /items HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n{"
        )
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


DEEP = b'{"items": ' + b"[" * 5000 + b"]" * 5000 + b"}"


@pytest.mark.timeout(60)
def test_the_default_shape_is_the_message(serve):
    url = serve(_app())
    r = httpx.post(
        url + "/items", content=b'{"items": ["\xff"]}', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "UTF-8" in r.json()["detail"]
    r = httpx.post(url + "/items", content=DEEP, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON nested too deeply" in r.json()["detail"], r.text
    r = httpx.post(
        url + "/items",
        content=b"{" + b" " * 100_000 + b"}",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["detail"].endswith("send fewer or shorter inputs")
    assert b'"detail":"the request body did not arrive' in _slow_body(url)


@pytest.mark.timeout(60)
def test_a_surface_shape_and_hint(serve):
    url = serve(
        _app(
            detail=lambda code, message: {"code": code, "text": message}, too_large_hint="send less"
        )
    )
    jh = {"content-type": "application/json"}
    r = httpx.post(url + "/items", content=b'{"items": ["\xff"]}', headers=jh)
    assert r.status_code == 400 and r.json()["detail"]["code"] == "invalid_utf8"
    r = httpx.post(url + "/items", content=DEEP, headers=jh)
    assert r.status_code == 400 and r.json()["detail"]["code"] == "nested_too_deeply"
    r = httpx.post(url + "/items", content=b"{" + b" " * 100_000 + b"}", headers=jh)
    assert r.status_code == 413 and r.json()["detail"]["code"] == "request_too_large"
    assert r.json()["detail"]["text"].endswith("; send less")
    got = _slow_body(url)
    assert got.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in got, got
    # 422 stays FastAPI's list; an input nested hundreds of levels deep is echoed bounded
    r = httpx.post(
        url + "/items",
        content=b'{"items": ' + b'{"a":' * 400 + b"1" + b"}" * 400 + b"}",
        headers=jh,
    )
    assert (
        r.status_code == 422 and isinstance(r.json()["detail"], list) and len(r.content) < 4096
    ), r.text[:300]


@pytest.mark.timeout(60)
def test_an_apps_own_errors_are_left_alone(serve):
    url = serve(_app(detail=lambda code, message: {"code": code, "text": message}))
    r = httpx.post(url + "/mine", content=b"{}", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json() == {"detail": "my own message"}
    # a RecursionError without a body is a bug, not input nested too deeply: still a 500
    assert httpx.get(url + "/bug").status_code == 500
