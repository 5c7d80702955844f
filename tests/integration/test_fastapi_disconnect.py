"""A GpuLimiter app served by a real uvicorn server (in a thread of the test process, on a free
loopback port, against a real Redis): clients that close their connection while their request
waits for the worker's only thread slot leave that wait at once and never run; the one behind
them runs next."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from support.ports import free_port
from gpulock.fastapi import metrics

from .test_fastapi import _app

pytestmark = pytest.mark.timeout(60)


def _until(pred, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _open_post(port: int, path: str, body: dict) -> socket.socket:
    raw = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return s


def test_hung_up_requests_leave_the_thread_slot_wait_at_once(redis_proc1):
    import uvicorn

    app, gpu, seen = _app(redis_proc1.url, "disc-slot", executor_threads=1, acquire_timeout=30)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        _until(lambda: server.started, "the server")
        url = f"http://127.0.0.1:{port}"
        waiting = metrics().disconnected.labels("sync", "waiting")
        before = waiting._value.get()
        hold = {}
        ht = threading.Thread(
            target=lambda: hold.setdefault(
                "r", httpx.post(url + "/sync", json={"seconds": 1.5}, timeout=30)
            )
        )
        ht.start()
        _until(lambda: gpu.slots.free == 0 and seen["inside"] == 1, "the holder running")
        socks = []
        for i in range(3):
            socks.append(_open_post(port, "/sync", {"seconds": 0, "i": i}))
            _until(lambda: len(gpu.slots.waiters) == i + 1, f"request {i} waiting for the thread")
        t0 = time.monotonic()
        for s in socks:
            s.close()
        _until(lambda: not gpu.slots.waiters, "the thread-slot wait to empty", timeout=5)
        assert time.monotonic() - t0 < 1.0
        assert waiting._value.get() == before + 3
        r = httpx.post(url + "/sync", json={"seconds": 0, "witness": True}, timeout=30)
        ht.join(30)
        assert hold["r"].status_code == 200 and r.status_code == 200
        assert len(seen["tokens"]) == 2, "only the holder and the witness ran"
    finally:
        server.should_exit = True
        t.join(15)
