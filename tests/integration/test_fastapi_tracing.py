"""OpenTelemetry traces of ``gpulock.fastapi`` (docs/TRACING.md), in-process against a real
Redis, the request spans made by opentelemetry-instrumentation-fastapi and every finished span
collected in memory (an SDK tracer provider set for this module: :mod:`support.tracing`):

* a guarded call: its thread-slot wait (``gpulock.admission``) and its work under the lease
  (``gpulock.call``: pool, route, bytes, lease id, fencing token, device) are children of the
  request's span, and a span started in the work's thread is the call's child;
* the wait for a thread slot: position on entry and seconds waited;
* a stream: its call span is current for every chunk (those made while the response is sent
  too) and lasts until the body is closed;
* a batch: one ``gpulock.batch`` span (a trace of its own) linked to each request's span, each
  request's span with a ``gpulock.batched`` event naming it, its call span its child; a CUDA
  OOM split is an event on the call span;
* without a tracer provider (a fresh process) nothing is recorded and the calls still work.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from fastapi import FastAPI, Request, Response
from support.apps import Running
from support.pools import GiB
from support.waiting import async_wait_until

from gpulock.fastapi import GpuLimiter, current_call_span

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.instrumentation.fastapi")
from support.tracing import memory_spans  # noqa: E402 - needs the SDK

pytestmark = pytest.mark.timeout(120)

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def exporter():
    with memory_spans() as e:
        yield e


@pytest.fixture
def spans(exporter):
    """The finished spans, read anew at each call (cleared before the test)."""
    exporter.clear()
    return lambda: list(exporter.get_finished_spans())


def _instrumented(app: FastAPI) -> FastAPI:
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app)
    return app


def _tracer():
    from opentelemetry import trace

    return trace.get_tracer("test")


def _app(url: str, pool: str, **kw):
    """``POST /work``: 1 GiB, holds until the gate opens (``{"hold": true}``), starts a span
    ``model`` in its thread; ``POST /stream``: three chunks, a span ``chunk`` each."""
    gpu = GpuLimiter(
        url, pool, capacity=4 * GiB, configure="set", exit_on_fatal=False, reaper_interval=0.1, **kw
    )
    app = FastAPI(lifespan=gpu.lifespan)
    gate = threading.Event()
    gate.set()
    running: list[int] = []

    @app.post("/work")
    @gpu.endpoint("work", estimate=lambda body: GiB)
    def work(body: dict) -> dict:
        with _tracer().start_as_current_span("model"):
            running.append(1)
            if body.get("hold"):
                assert gate.wait(60)
            if body.get("oom"):
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return {"call_span": current_call_span() is not None}

    @app.post("/stream")
    @gpu.endpoint("stream", estimate=lambda body: GiB, stream="text/plain")
    def stream(body: dict):
        for i in range(3):
            with _tracer().start_as_current_span("chunk", attributes={"i": i}):
                yield f"{i}\n"

    return _instrumented(app), gpu, gate, running


def named(spans, name: str, **attrs):
    """The spans called ``name`` whose attributes include ``attrs`` (dots in attribute names
    written as ``__``: ``gpulock__route="x"``)."""
    want = {k.replace("__", "."): v for k, v in attrs.items()}
    return [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in want.items())
    ]


def server_span(spans, trace_id: int):
    """The one SERVER span (the request's) of trace ``trace_id``."""
    found = [s for s in spans if s.context.trace_id == trace_id and s.kind.name == "SERVER"]
    assert len(found) == 1, [s.name for s in found]
    return found[0]


def _one(found: list, what: str):
    assert len(found) == 1, f"{what}: {[(s.name, dict(s.attributes)) for s in found]}"
    return found[0]


async def test_a_guarded_call_traces_its_wait_and_its_call_under_the_request(redis_proc1, spans):
    app, gpu, _, _ = _app(redis_proc1.url, "tr-call")
    async with Running(app) as c:
        r = await c.post("/work", json={})
        assert r.status_code == 200, r.text
        assert r.json() == {"call_span": True}
        call = await async_wait_until(
            lambda: named(spans(), "gpulock.call"), timeout=30, what="the call span"
        )
    call = _one(call, "call spans")
    tid = call.context.trace_id
    request = server_span(spans(), tid)
    assert call.parent.span_id == request.context.span_id
    a = call.attributes
    assert a["gpulock.pool"] == "tr-call"
    assert a["gpulock.route"] == "work"
    assert a["gpulock.amount_bytes"] == GiB
    assert isinstance(a["gpulock.lease.id"], str) and a["gpulock.lease.id"]
    assert (
        isinstance(a["gpulock.lease.fencing_token"], int) and a["gpulock.lease.fencing_token"] > 0
    )
    assert a["gpulock.device"] == 0
    assert call.status.is_ok
    # the slot wait: none (a thread was free), granted, the request's child
    adm = _one([s for s in named(spans(), "gpulock.admission") if s.context.trace_id == tid], "adm")
    assert adm.parent.span_id == request.context.span_id
    assert adm.attributes["gpulock.local.position"] == 0
    assert adm.attributes["gpulock.outcome"] == "granted"
    assert 0 <= adm.attributes["gpulock.local.wait_s"] < 30
    assert adm.end_time <= call.start_time
    # the work's own span, in the executor thread: the call's child
    model = _one(named(spans(), "model"), "model spans")
    assert model.parent.span_id == call.context.span_id
    assert call.start_time <= model.start_time and model.end_time <= call.end_time


async def test_the_wait_for_a_thread_slot_is_recorded(redis_proc1, spans):
    """One thread: the second request waits for it, first in line (position 1), until the
    first one's work ends."""
    app, gpu, gate, running = _app(redis_proc1.url, "tr-slot", executor_threads=1)
    async with Running(app) as c:
        gate.clear()
        first = asyncio.ensure_future(c.post("/work", json={"hold": True}))
        await async_wait_until(lambda: running, timeout=30, what="the first request running")
        second = asyncio.ensure_future(c.post("/work", json={}))
        await async_wait_until(lambda: gpu.slots.waiters, timeout=30, what="a slot waiter")
        gate.set()
        r1, r2 = await asyncio.gather(first, second)
        assert r1.status_code == r2.status_code == 200
        await async_wait_until(
            lambda: len(named(spans(), "gpulock.call")) == 2, timeout=30, what="two call spans"
        )
    waited = _one(named(spans(), "gpulock.admission", gpulock__local__position=1), "waited")
    assert waited.attributes["gpulock.outcome"] == "granted"
    assert waited.attributes["gpulock.local.wait_s"] > 0
    # it ended after the first call (whose thread it waited for) did
    first_call = next(
        s for s in named(spans(), "gpulock.call") if s.context.trace_id != waited.context.trace_id
    )
    assert waited.end_time >= first_call.end_time
    second_call = next(
        s for s in named(spans(), "gpulock.call") if s.context.trace_id == waited.context.trace_id
    )
    assert second_call.start_time >= waited.end_time


async def test_a_streams_call_span_is_current_for_every_chunk_and_lasts_the_stream(
    redis_proc1, spans
):
    app, gpu, _, _ = _app(redis_proc1.url, "tr-stream")
    async with Running(app) as c:
        r = await c.post("/stream", json={})
        assert r.status_code == 200, r.text
        assert r.text == "0\n1\n2\n"
        call = await async_wait_until(
            lambda: named(spans(), "gpulock.call", gpulock__route="stream"),
            timeout=30,
            what="the stream's call span",
        )
    call = _one(call, "call spans")
    chunks = named(spans(), "chunk")
    assert sorted(s.attributes["i"] for s in chunks) == [0, 1, 2]
    for s in chunks:  # also those made while the response was being sent
        assert s.parent.span_id == call.context.span_id
        assert s.end_time <= call.end_time


def _batch_app(url: str, pool: str):
    gpu = GpuLimiter(
        url, pool, capacity=8 * GiB, configure="set", executor_threads=1, reaper_interval=0.1
    )
    app = FastAPI(lifespan=gpu.lifespan)
    gate = threading.Event()
    gate.set()
    seen: list[list[int]] = []

    def run(items: list[dict]) -> list:
        seen.append([it["i"] for it in items])
        if any(it.get("hold") for it in items):
            assert gate.wait(60)
        if len(items) > 1 and any(it.get("oom") for it in items):
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [{"i": it["i"]} for it in items]

    b = gpu.batcher("b", run, estimate=lambda it: GiB, max_wait_ms=5000.0, max_size=3)

    @app.post("/b")
    async def route(body: dict, request: Request, response: Response):
        return await b.submit(body, request=request, response=response)

    return _instrumented(app), gpu, b, gate, seen


async def _batch_of_three(c, b, gate, seen, bodies):
    """The holder takes the only thread; three requests join one batch (full), run after."""
    gate.clear()
    holder = asyncio.ensure_future(c.post("/b", json={"i": -1, "hold": True}))
    await async_wait_until(lambda: [-1] in seen, timeout=30, what="the holder running")
    tasks = []
    for body in bodies:
        n = b.joined
        tasks.append(asyncio.ensure_future(c.post("/b", json=body)))
        await async_wait_until(lambda: b.joined == n + 1, timeout=30, what=f"{body} joining")
    await async_wait_until(lambda: len(b._inflight) == 2, timeout=30, what="the batch closing")
    gate.set()
    rs = await asyncio.gather(holder, *tasks)
    assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
    return rs


async def test_a_batch_span_links_each_request_and_each_request_names_its_batch(redis_proc1, spans):
    app, gpu, b, gate, seen = _batch_app(redis_proc1.url, "tr-batch")
    async with Running(app) as c:
        await _batch_of_three(c, b, gate, seen, [{"i": i} for i in range(3)])
        found = await async_wait_until(
            lambda: named(spans(), "gpulock.batch", gpulock__batch__size=3),
            timeout=30,
            what="the batch of three's span",
        )
    batch = _one(found, "batch spans of three")
    assert batch.parent is None  # a trace of its own
    assert batch.attributes["gpulock.batch.reason"] == "full"
    assert batch.attributes["gpulock.amount_bytes"] == 3 * GiB
    assert batch.attributes["gpulock.route"] == "b"
    requests = [
        s
        for s in spans()
        if s.kind.name == "SERVER"
        and any(
            e.name == "gpulock.batched"
            and e.attributes["gpulock.batch.span_id"] == f"{batch.context.span_id:016x}"
            for e in s.events
        )
    ]
    assert len(requests) == 3
    linked = {(lk.context.trace_id, lk.context.span_id) for lk in batch.links}
    assert linked == {(s.context.trace_id, s.context.span_id) for s in requests}
    for s in requests:
        (ev,) = [e for e in s.events if e.name == "gpulock.batched"]
        assert ev.attributes["gpulock.batch.trace_id"] == f"{batch.context.trace_id:032x}"
        assert ev.attributes["gpulock.batch.size"] == 3
    # the batch's call (and its slot wait) run in the batch's trace, as its children
    call = _one(
        [s for s in named(spans(), "gpulock.call") if s.context.trace_id == batch.context.trace_id],
        "the batch's call span",
    )
    assert call.parent.span_id == batch.context.span_id
    assert call.attributes["gpulock.amount_bytes"] == 3 * GiB
    adm = [
        s
        for s in named(spans(), "gpulock.admission")
        if s.context.trace_id == batch.context.trace_id
    ]
    assert len(adm) == 1 and adm[0].parent.span_id == batch.context.span_id
    assert batch.end_time >= call.end_time


async def test_an_oom_split_is_an_event_on_the_batchs_call_span(redis_proc1, spans):
    app, gpu, b, gate, seen = _batch_app(redis_proc1.url, "tr-oom")
    async with Running(app) as c:
        rs = await _batch_of_three(c, b, gate, seen, [{"i": 0, "oom": True}, {"i": 1}, {"i": 2}])
        assert [r.json()["i"] for r in rs[1:]] == [0, 1, 2]
        found = await async_wait_until(
            lambda: named(spans(), "gpulock.batch", gpulock__batch__size=3),
            timeout=30,
            what="the batch's span",
        )
    batch = _one(found, "batch spans of three")
    call = _one(
        [s for s in named(spans(), "gpulock.call") if s.context.trace_id == batch.context.trace_id],
        "the batch's call span",
    )
    ooms = [e for e in call.events if e.name == "gpulock.oom"]
    # the three ran out: split into 1 + 2, run in turn under the same lease
    assert [
        (e.attributes["gpulock.oom.retried"], e.attributes["gpulock.batch.size"]) for e in ooms
    ] == [(True, 3)]
    assert [1, 2] in seen and [0] in seen
    assert call.status.is_ok  # every request was answered


async def test_an_oom_that_ends_a_call_is_an_event_and_an_error(redis_proc1, spans):
    app, gpu, _, _ = _app(redis_proc1.url, "tr-oom1")
    async with Running(app) as c:
        r = await c.post("/work", json={"oom": True})
        assert r.status_code == 503, r.text
        found = await async_wait_until(
            lambda: named(spans(), "gpulock.call"), timeout=30, what="the call span"
        )
    call = _one(found, "call spans")
    assert [
        e.attributes["gpulock.oom.retried"] for e in call.events if e.name == "gpulock.oom"
    ] == [False]
    assert not call.status.is_ok


async def test_the_cores_spans_are_children_of_the_request_or_of_its_batch(redis_proc1, spans):
    """The core's ``gpulock.acquire`` and ``gpulock.lease`` (where the core traces) start in
    the job's context: a guarded call's are its request's children, a batch's the batch's."""
    pytest.importorskip("gpulock_common.traces")  # the core's spans
    app, gpu, _, _ = _app(redis_proc1.url, "tr-core")
    async with Running(app) as c:
        assert (await c.post("/work", json={})).status_code == 200
        call = _one(
            await async_wait_until(lambda: named(spans(), "gpulock.call"), timeout=30, what="call"),
            "call spans",
        )
    request = server_span(spans(), call.context.trace_id)
    for name in ("gpulock.acquire", "gpulock.lease"):
        core = _one(named(spans(), name), name)
        assert core.parent.span_id == request.context.span_id, name
        assert core.attributes["gpulock.lease.id"] == call.attributes["gpulock.lease.id"]
    app, gpu, b, gate, seen = _batch_app(redis_proc1.url, "tr-core-b")
    async with Running(app) as c:
        await _batch_of_three(c, b, gate, seen, [{"i": i} for i in range(3)])
        batch = _one(
            await async_wait_until(
                lambda: named(spans(), "gpulock.batch", gpulock__batch__size=3),
                timeout=30,
                what="the batch's span",
            ),
            "batch spans of three",
        )
    for name in ("gpulock.acquire", "gpulock.lease"):
        core = _one(
            [s for s in named(spans(), name) if s.context.trace_id == batch.context.trace_id], name
        )
        assert core.parent.span_id == batch.context.span_id, name
        assert core.attributes["gpulock.amount_bytes"] == 3 * GiB


_UNTRACED = textwrap.dedent(
    """
    import asyncio, json, sys
    sys.path.insert(0, sys.argv[2])  # tests/, for support
    from fastapi import FastAPI
    from opentelemetry import trace
    from gpulock_common import tracing
    from gpulock.fastapi import GpuLimiter, current_call_span
    from support.apps import Running

    gpu = GpuLimiter(sys.argv[1], "tr-none", capacity=2**32, configure="set", exit_on_fatal=False)
    app = FastAPI(lifespan=gpu.lifespan)
    b = gpu.batcher("b", lambda items: [1 for _ in items], estimate=lambda it: 2**30)
    seen = []

    @app.post("/work")
    @gpu.endpoint("work", estimate=lambda body: 2**30)
    def work(body: dict) -> dict:
        seen.append((current_call_span(), trace.get_current_span().is_recording()))
        return {}

    @app.post("/b")
    async def batched(body: dict):
        return await b.submit(body)

    async def main():
        async with Running(app) as c:
            assert (await c.post("/work", json={})).status_code == 200
            assert (await c.post("/b", json={})).status_code == 200
        print(json.dumps({"enabled": tracing.ENABLED, "recording": tracing.recording(),
            "seen": [[s is None, rec] for s, rec in seen]}))

    asyncio.run(main())
    """
)


def test_without_a_tracer_provider_nothing_is_recorded(redis_proc1):
    """A fresh process with OpenTelemetry's API but no SDK set: no span (the call's is None,
    the thread's current one does not record), and a guarded call and a batched one work.
    (FastAPI itself imports OpenTelemetry's API, so an app without it is not tested here.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", _UNTRACED, redis_proc1.url, TESTS],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"enabled": True, "recording": False, "seen": [[True, False]]}
