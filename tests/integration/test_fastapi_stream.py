"""Streams under a lease (gpulock.fastapi._stream): a GpuLimiter app served by a real uvicorn
server (in a thread of the test process, on a free loopback port, against a real Redis), read by
a real HTTP client. The lease is held until the last chunk went out; a client that hangs up
stops the generator (its ``finally`` runs) and the lease goes back; a lost lease ends the
stream with an error event; each chunk of a sync body is made in an executor thread after
``ensure_valid()``; heartbeats keep a stream longer than its ttl; queued streams wait their turn
within the pool's capacity. Decorator and Depends styles both."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from fastapi import Depends, FastAPI, Request
from support.pools import GiB
from support.ports import free_port
from support.waiting import wait_until

from gpulock import Pool
from gpulock.fastapi import (
    GpuCall,
    GpuLimiter,
    GpuLockHTTPException,
    StreamLease,
    current_lease,
)
from gpulock.protocol.keys import pool_keys

pytestmark = pytest.mark.timeout(60)

GATE_S = 20  # the longest a test's generator waits for its permit (a failed test frees it)


class Seen:
    """What the app's generators did, read by the test (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gate = threading.Semaphore(0)  # a gated chunk takes one permit
        self.chunks: list[tuple[str, int, int]] = []  # (route, chunk index, thread id)
        self.finally_ran: list[tuple[str, int]] = []  # (route, thread id)
        self.leases: dict[str, Any] = {}  # route -> the AsyncLease its stream got
        self.running = 0
        self.max_running = 0
        self.loop_thread = 0
        self.outcomes: list[str] = []  # what a growth in /grows ended with

    def chunk(self, route: str, i: int) -> None:
        with self.lock:
            self.chunks.append((route, i, threading.get_ident()))

    def count(self, route: str) -> int:
        with self.lock:
            return sum(1 for c in self.chunks if c[0] == route)


def _app(url: str, pool: str, **kw: Any) -> tuple[FastAPI, GpuLimiter, Seen]:
    kw.setdefault("capacity", 4 * GiB)
    kw.setdefault("configure", "set")
    kw.setdefault("ttl", 1.0)  # renewed every ~0.33 s: a 4 s stream outlives several ttls
    kw.setdefault("executor_threads", 4)
    gpu = GpuLimiter(url, pool, exit_on_fatal=False, **kw)
    app = FastAPI(lifespan=gpu.lifespan)
    seen = Seen()

    @app.middleware("http")  # Starlette's BaseHTTPMiddleware: streams pass through it
    async def on_the_loop(request: Request, call_next: Any) -> Any:
        seen.loop_thread = threading.get_ident()  # the event loop's thread
        return await call_next(request)

    def body(route: str, n: int, gated: bool, work_s: float, stream: StreamLease) -> Iterator:
        """n chunks (n < 0: no end), each after one permit of the gate (``gated``) or
        ``work_s`` seconds of work."""
        seen.leases[route] = stream.lease
        assert current_lease() is stream.lease
        with seen.lock:
            seen.running += 1
            seen.max_running = max(seen.max_running, seen.running)
        try:
            i = 0
            while n < 0 or i < n:
                if gated:
                    assert seen.gate.acquire(timeout=GATE_S)
                elif work_s:
                    time.sleep(work_s)  # the chunk's "GPU work"
                seen.chunk(route, i)
                yield {"i": i, "lease": stream.lease and stream.lease.id}
                i += 1
        finally:
            with seen.lock:
                seen.running -= 1
                seen.finally_ran.append((route, threading.get_ident()))

    @app.post("/dec")
    @gpu.endpoint("dec", estimate=lambda b: b.get("gib", 1) * GiB, stream="sse")
    def dec(b: dict, stream: StreamLease) -> Iterator[dict]:
        yield from body("dec", b.get("n", 3), b.get("gated", False), b.get("work_s", 0), stream)

    @app.post("/dep")
    async def dep(
        b: dict, call: GpuCall = Depends(gpu.guard("dep", estimate=lambda b: b.get("gib", 1) * GiB))
    ):
        def gen(b: dict, stream: StreamLease) -> Iterator[dict]:
            return body("dep", b.get("n", 3), b.get("gated", False), b.get("work_s", 0), stream)

        return await call.stream(gen, b, media_type="application/x-ndjson")

    def first_fails(b: dict) -> Iterator[dict]:
        if b.get("at", 0) == 0:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
        yield {"i": 0}
        raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")

    @app.post("/oom")
    @gpu.endpoint("oom", estimate=lambda b: GiB, stream="sse")
    def oom(b: dict) -> Iterator[dict]:
        return first_fails(b)

    @app.post("/fails-plain")
    async def fails_plain(b: dict, call: GpuCall = Depends(gpu.guard("fails-plain"))):
        def gen() -> Iterator[str]:
            yield "one\n"
            raise ValueError("a bug with a secret in it")

        return await call.stream(gen, amount=GiB, media_type="text/plain")

    @app.post("/v1/chat/completions")
    @gpu.endpoint("chat", estimate=lambda b: GiB, stream="sse")
    def chat(b: dict) -> Iterator[dict]:
        yield {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": b["model"],
            "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}],
        }
        raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")

    @app.post("/grows")
    @gpu.endpoint("grows", estimate=lambda b: GiB, stream="sse")
    def grows(b: dict, stream: StreamLease) -> Iterator[dict]:
        """A chunk, then the lease grown to ``to`` GiB (from the executor thread), then a chunk
        with the amount; the growth's outcome is kept in ``seen.outcomes``."""
        seen.leases["grows"] = stream.lease
        try:
            yield {"i": 0}
            assert stream.lease is not None
            try:
                stream.run(stream.lease.resize(b["to"] * GiB, timeout=GATE_S))
            except BaseException as e:
                seen.outcomes.append(type(e).__name__)
                raise
            seen.outcomes.append("grown")
            yield {"i": 1, "amount": stream.lease.amount}
        finally:
            seen.finally_ran.append(("grows", threading.get_ident()))

    @app.post("/own-error")
    @gpu.endpoint("own-error", estimate=lambda b: GiB, stream="sse")
    def own_error(b: dict) -> Iterator[dict]:
        yield {"i": 0}
        raise GpuLockHTTPException(503, "the next tokens need more than the pool gave", "my_code")

    @app.post("/agen")
    @gpu.endpoint("agen", estimate=lambda b: GiB, stream="text/plain")
    async def agen(b: dict, request: Request, stream: StreamLease):
        seen.leases["agen"] = stream.lease
        try:
            for i in range(b.get("n", 3)):
                seen.chunk("agen", i)
                yield f"{i}\n"
        finally:
            seen.finally_ran.append(("agen", threading.get_ident()))

    return app, gpu, seen


class Served:
    """``with Served(app) as base_url``: a uvicorn server on a free port in a thread."""

    def __init__(self, app: FastAPI):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        wait_until(lambda: self.server.started, 15, "the server")
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def _used(url: str, pool: str) -> int:
    p = Pool.from_url(url, pool)
    try:
        return p.status().used
    finally:
        p.close()


def _events(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    """``(event name or None, data)`` of each server-sent event in ``lines``."""
    event, data = None, []
    for line in lines:
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data.append(line[6:])


def _open_post(port: int, path: str, body: dict) -> socket.socket:
    raw = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    return s


def test_a_stream_holds_its_lease_until_its_last_chunk_decorator_sse(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "st-hold")
    with Served(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        seen.gate.release()  # the first chunk is made before the answer starts
        with c.stream("POST", "/dec", json={"n": 3, "gated": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _events(r.iter_lines())
            got = [next(events)]
            for _ in range(2):
                assert _used(redis_proc1.url, "st-hold") == GiB  # held while streaming
                seen.gate.release()
                got.append(next(events))
            got += list(events)
        assert [json.loads(d)["i"] for _, d in got[:3]] == [0, 1, 2]
        assert got[3] == (None, "[DONE]") and len(got) == 4
        lease = seen.leases["dec"]
        wait_until(lambda: lease.released, 2, "the release")
        assert _used(redis_proc1.url, "st-hold") == 0 and not lease.lost
        assert {json.loads(d)["lease"] for _, d in got[:3]} == {lease.id}
        assert [r for r, _ in seen.finally_ran] == ["dec"]


def test_a_stream_holds_its_lease_until_its_last_chunk_depends_plain(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "st-dep")
    with Served(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        seen.gate.release()
        with c.stream("POST", "/dep", json={"n": 2, "gated": True, "gib": 2}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("application/x-ndjson")
            lines = r.iter_lines()
            assert json.loads(next(lines))["i"] == 0
            assert _used(redis_proc1.url, "st-dep") == 2 * GiB
            seen.gate.release()
            assert json.loads(next(lines))["i"] == 1
            assert list(lines) == []  # a plain stream ends with no marker
        wait_until(lambda: _used(redis_proc1.url, "st-dep") == 0, 2, "the release")
        # every chunk (and the generator's finally) ran in the executor, not on the loop
        threads = {t for r, _, t in seen.chunks} | {t for _, t in seen.finally_ran}
        assert seen.loop_thread and seen.loop_thread not in threads
        names = {t.ident: t.name for t in threading.enumerate()}
        assert all(names.get(t, "").startswith("gpulock-work") for t in threads), names


@pytest.mark.parametrize("path", ["/dec", "/dep"])
def test_a_client_that_hangs_up_stops_the_generator_and_frees_the_lease(redis_proc1, path):
    route = path[1:]
    app, gpu, seen = _app(redis_proc1.url, f"st-gone-{route}")
    with Served(app) as url:
        port = int(url.rsplit(":", 1)[1])
        s = _open_post(port, path, {"n": -1, "work_s": 0.02})  # no end: 20 ms a chunk
        wait_until(lambda: seen.count(route) >= 3, 10, "a few chunks")
        assert _used(redis_proc1.url, f"st-gone-{route}") == GiB
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        s.close()
        wait_until(lambda: seen.finally_ran, 1.0, "the generator's finally")
        wait_until(lambda: _used(redis_proc1.url, f"st-gone-{route}") == 0, 1.0, "the release")
        assert time.monotonic() - t0 < 1.0
        made = seen.count(route)
        wait_until(lambda: seen.leases[route].released, 1.0, "the lease's release to return")
        assert not seen.leases[route].lost
        # closed in an executor thread, and no chunk started after it
        assert seen.finally_ran[0][1] != seen.loop_thread
        assert seen.count(route) == made and seen.running == 0


def test_a_lost_lease_ends_the_stream_with_an_error_event(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "st-lost")
    rc = redis.Redis.from_url(redis_proc1.url)
    with rc, Served(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        seen.gate.release()
        with c.stream("POST", "/dec", json={"n": 5, "gated": True}) as r:
            events = _events(r.iter_lines())
            assert json.loads(next(events)[1])["i"] == 0
            lease = seen.leases["dec"]
            # the server expires it: its next renewal (ttl/3) finds it gone
            assert rc.zadd(pool_keys("st-lost").leases, {lease.id: 1}, xx=True) == 0
            wait_until(lambda: lease.lost, 3, "the lease lost")
            seen.gate.release()  # chunk 1 was already in progress: it finishes and is sent
            rest = list(events)
        assert json.loads(rest[0][1])["i"] == 1
        assert len(rest) == 2, rest  # then the error, and no [DONE]
        event, data = rest[1]
        err = json.loads(data)["error"]
        assert event == "error"
        assert err["code"] == "lease_lost" and err["type"] == "server_error"
        assert "lost" in err["message"]
        assert seen.count("dec") == 2  # chunk 2 never started
        wait_until(lambda: seen.finally_ran, 2, "the generator's finally")
        assert _used(redis_proc1.url, "st-lost") == 0


def test_a_stream_longer_than_several_ttls_keeps_its_lease(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "st-long", ttl=1.0)
    with Served(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        t0 = time.monotonic()
        with c.stream("POST", "/dec", json={"n": 9, "work_s": 0.45}) as r:
            got = list(_events(r.iter_lines()))
        took = time.monotonic() - t0
        assert took > 3.5  # > 3 ttls
        assert [json.loads(d)["i"] for _, d in got[:-1]] == list(range(9))
        assert got[-1] == (None, "[DONE]")
        lease = seen.leases["dec"]
        assert lease.ttl <= 1.0 and not lease.lost
        wait_until(lambda: _used(redis_proc1.url, "st-long") == 0, 2, "the release")


def test_concurrent_streams_never_exceed_the_capacity(redis_proc1):
    # ttl 5 s: this test is about the capacity, not renewals; the sampler below reads the
    # status in this process, and with a 1 s ttl a loaded machine could starve the heartbeat
    app, gpu, seen = _app(
        redis_proc1.url, "st-cap", executor_threads=8, acquire_timeout=30, capacity=4 * GiB, ttl=5.0
    )
    with Served(app) as url:
        worst = [0]
        stop = threading.Event()

        def sample() -> None:
            p = Pool.from_url(redis_proc1.url, "st-cap")
            try:
                while not stop.wait(0.005):  # a sampler, not a busy loop that takes the GIL
                    worst[0] = max(worst[0], p.status().used)
            finally:
                p.close()

        out: list[Any] = []

        def one(i: int) -> None:
            with httpx.Client(base_url=url, timeout=30) as c:
                with c.stream("POST", "/dec", json={"n": 3, "gated": True, "gib": 2}) as r:
                    out.append((r.status_code, list(_events(r.iter_lines()))))

        sampler = threading.Thread(target=sample)
        sampler.start()
        clients = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in clients:
            t.start()
        # two streams hold the 4 GiB (each waits for its first chunk's permit), four queue
        p = Pool.from_url(redis_proc1.url, "st-cap")
        try:
            wait_until(
                lambda: seen.running == 2 and p.status().waiter_count == 4,
                10,
                "2 running, 4 queued",
            )
        finally:
            p.close()
        for _ in range(6 * 3):
            seen.gate.release()
        for t in clients:
            t.join(30)
        stop.set()
        sampler.join(10)
    assert len(out) == 6
    for status, events in out:
        assert status == 200 and events[-1] == (None, "[DONE]") and len(events) == 4
    assert 2 * GiB <= worst[0] <= 4 * GiB
    assert seen.max_running == 2  # 4 GiB / 2 GiB: the others waited in the pool's queue


def test_an_error_before_the_first_chunk_is_an_http_error_after_it_an_event(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "st-err")
    with Served(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/oom", json={"at": 0})
        assert r.status_code == 503 and "retry-after" in r.headers
        with c.stream("POST", "/oom", json={"at": 1}) as r:
            assert r.status_code == 200
            got = list(_events(r.iter_lines()))
        assert json.loads(got[0][1]) == {"i": 0}
        assert got[1][0] == "error" and json.loads(got[1][1])["error"]["code"] == "cuda_oom"
        assert len(got) == 2
        wait_until(lambda: _used(redis_proc1.url, "st-err") == 0, 2, "the release")


def test_a_plain_stream_ends_with_an_error_line(redis_proc1, caplog):
    app, gpu, seen = _app(redis_proc1.url, "st-plain-err")
    with Served(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/fails-plain", json={})
        assert r.status_code == 200
        first, last = r.text.splitlines()
        assert first == "one"
        err = json.loads(last)["error"]
        assert err["code"] == "internal_error" and "secret" not in err["message"]
        wait_until(lambda: _used(redis_proc1.url, "st-plain-err") == 0, 2, "the release")
    assert any("a bug with a secret" in str(r.exc_info) for r in caplog.records if r.exc_info)


def test_an_async_generator_streams_under_the_lease(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "st-agen")
    with Served(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/agen", json={"n": 3})
        assert r.status_code == 200 and r.text == "0\n1\n2\n"
        assert r.headers["content-type"].startswith("text/plain")
        wait_until(lambda: seen.leases["agen"].released, 2, "the release")
        assert [r for r, _ in seen.finally_ran] == ["agen"]
        assert _used(redis_proc1.url, "st-agen") == 0


def test_the_openai_sdk_raises_the_error_event(redis_proc1):
    openai = pytest.importorskip("openai")
    app, gpu, seen = _app(redis_proc1.url, "st-sdk")
    with Served(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = []
        with pytest.raises(openai.APIError, match="ran out of memory mid-stream") as e:
            for chunk in client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], stream=True
            ):
                got.append(chunk.choices[0].delta.content)
        assert got == ["hi"] and e.value.body["code"] == "cuda_oom"


def test_a_disabled_limiter_streams_without_a_lease(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "st-off", enabled=False)
    with Served(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        with c.stream("POST", "/dec", json={"n": 2}) as r:
            got = list(_events(r.iter_lines()))
        assert [d for _, d in got] == ['{"i":0,"lease":null}', '{"i":1,"lease":null}', "[DONE]"]
        assert seen.leases["dec"] is None and _used(redis_proc1.url, "st-off") == 0


def test_a_body_grows_its_lease_and_a_hang_up_during_the_growth_ends_it_at_once(redis_proc1):
    """StreamLease.run(lease.resize(n)) from the body's thread: granted, the next chunk sees
    the new amount; queued (the pool full), a client that hangs up cancels the growth (it
    leaves the queue) and the lease goes back within a second, not at the growth's timeout."""
    app, gpu, seen = _app(redis_proc1.url, "st-grow")
    other = Pool.from_url(redis_proc1.url, "st-grow")
    with Served(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        got = [d for _, d in _events(c.post("/grows", json={"to": 2}).text.splitlines())]
        assert got == ['{"i":0}', f'{{"i":1,"amount":{2 * GiB}}}', "[DONE]"]
        assert seen.outcomes == ["grown"]
        wait_until(lambda: _used(redis_proc1.url, "st-grow") == 0, 2, "the release")
        held = other.acquire(3 * GiB, timeout=5)  # 1 GiB left: the stream's first lease
        try:
            port = int(url.rsplit(":", 1)[1])
            s = _open_post(port, "/grows", {"to": 2})
            assert s.recv(4096).startswith(b"HTTP/1.1 200")

            def growing() -> bool:
                st = other.status()
                return any(w.request_id.startswith("grow:") for w in st.waiters)

            wait_until(growing, 10, "the growth queued")
            t0 = time.monotonic()
            s.close()
            wait_until(lambda: len(seen.outcomes) == 2, 1.0, "the growth to end")
            assert seen.outcomes[1] == "CancelledError"
            wait_until(
                lambda: other.status().used == 3 * GiB and not other.status().waiters,
                1.0,
                "the release, and the growth out of the queue",
            )
            assert time.monotonic() - t0 < 1.0
            wait_until(lambda: len(seen.finally_ran) == 2, 1.0, "the generator's finally")
            assert seen.leases["grows"].amount == GiB  # it kept its amount until the release
        finally:
            held.release()
            other.close()


def test_a_body_that_raises_gpulock_http_exception_ends_the_stream_with_its_code(redis_proc1):
    app, gpu, seen = _app(redis_proc1.url, "st-own")
    with Served(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        r = c.post("/own-error", json={})
        assert r.status_code == 200
        got = list(_events(r.text.splitlines()))
        assert got[0] == (None, '{"i":0}') and len(got) == 2  # no [DONE]
        event, data = got[1]
        assert event == "error"
        assert json.loads(data)["error"] == {
            "message": "the next tokens need more than the pool gave",
            "type": "server_error",
            "param": None,
            "code": "my_code",
        }
        wait_until(lambda: _used(redis_proc1.url, "st-own") == 0, 2, "the release")
