"""OpenTelemetry across the broker: the SDK's spans in this process (an in-memory exporter),
the broker's in a ``python -m gpulock_broker`` subprocess configured by the ``OTEL_*``
variables alone (the console exporter, its JSON spans read back from its output); the context
crosses the broker (its request spans are children of the SDK's ``gpulock.acquire``). Also: a
bad ``OTEL_TRACES_EXPORTER`` stops the broker and ``gpulock serve`` with exit 2, and without
OpenTelemetry the SDK and the broker work and print nothing of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from gpulock_client import Pool
from gpulock_client.errors import CapacityExceeded
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpulock_common import tracing
from support.ports import free_port
from support.procs import Proc, broker_argv, gpulock_argv
from support.servers import RedisProcess
from support.tracing import memory_spans

from ._support import ADMIN_TOKEN, TOKENS, USER_TOKEN

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _console_spans import console_spans  # noqa: E402

LEASES_ROUTE = "POST /v1/pools/{pool}/leases"


@pytest.fixture(scope="module")
def spans():
    """This process's spans, in memory (:func:`support.tracing.memory_spans`: an SDK provider
    global for this module, the previous one back after it)."""
    with memory_spans() as exporter:
        yield exporter


@pytest.fixture(scope="module")
def redis_srv(default_binary):
    with RedisProcess(default_binary) as p:
        yield p


def _env(**kw: str) -> dict[str, str]:
    return {"GPULOCK_BROKER_TOKENS": json.dumps(TOKENS), **kw}


@pytest.fixture(scope="module")
def traced_broker(redis_srv, tmp_path_factory):
    """The broker in a subprocess, tracing to the console as ``test-broker``."""
    tmp = tmp_path_factory.mktemp("traced-broker")
    port = free_port()
    env = _env(
        OTEL_TRACES_EXPORTER="console",
        OTEL_SERVICE_NAME="test-broker",
        OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test",
    )
    p = Proc(broker_argv(port, redis_srv.url), env, tmp / "broker.log", port)
    try:
        p.wait_up()
        with httpx.Client(
            base_url=p.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
        ) as c:
            r = c.put("/v1/pools/gpu-t", json={"capacity": "1GiB"})
            assert r.status_code == 200, r.text
        yield p
    finally:
        p.stop()


def broker_spans(p: Proc, trace_id: str, want: int, timeout: float = 60.0) -> list[dict]:
    """The broker's request spans of ``trace_id`` (``0x``-hex) once at least ``want`` are
    printed (each is printed as its request ends)."""
    deadline = time.monotonic() + timeout
    while True:
        got = [
            s
            for s in console_spans(p.log_path.read_text())
            if s["context"]["trace_id"] == trace_id and s["name"] == LEASES_ROUTE
        ]
        if len(got) >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def _hex(n: int, width: int) -> str:
    return f"0x{n:0{width}x}"


def _acquire_spans(exporter: InMemorySpanExporter, lease_id: str) -> list:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.name == tracing.ACQUIRE and (s.attributes or {}).get(tracing.LEASE_ID) == lease_id
    ]


@pytest.mark.timeout(180)
def test_the_brokers_request_span_is_a_child_of_the_sdks_acquire(spans, traced_broker):
    with Pool(traced_broker.url, "gpu-t", token=USER_TOKEN) as pool:
        lease = pool.acquire("64MiB", timeout=30, priority=3)
        lease.renew()
        lease.release()
    (mine,) = _acquire_spans(spans, lease.id)
    assert mine.kind == trace.SpanKind.CLIENT
    a = mine.attributes
    assert a[tracing.POOL] == "gpu-t"
    assert a[tracing.AMOUNT] == 64 << 20
    assert a[tracing.PRIORITY] == 3
    assert a[tracing.OUTCOME] == "granted"
    assert a[tracing.POSITION] == 0
    assert a[tracing.FENCING_TOKEN] == lease.token
    assert a[tracing.WAIT] >= 0

    trace_id = _hex(mine.context.trace_id, 32)
    (theirs,) = broker_spans(traced_broker, trace_id, want=1)
    assert theirs["parent_id"] == _hex(mine.context.span_id, 16)
    assert theirs["kind"] == "SpanKind.SERVER"
    assert theirs["resource"]["attributes"]["service.name"] == "test-broker"
    assert theirs["resource"]["attributes"]["deployment.environment"] == "test"
    ba = theirs["attributes"]
    assert ba[tracing.POOL] == "gpu-t"
    assert ba[tracing.AMOUNT] == 64 << 20
    assert ba[tracing.OUTCOME] == "granted"
    assert ba[tracing.LEASE_ID] == lease.id

    # the lease's span: from the grant to the release, a sibling of the acquire span (the
    # core's design, gpulock_common.traces), the renewal an event on it with the new expiry
    (hold,) = [
        s
        for s in spans.get_finished_spans()
        if s.name == tracing.HOLD and s.attributes[tracing.LEASE_ID] == lease.id
    ]
    renewals = [e for e in hold.events if e.name == tracing.EVENT_RENEW]
    assert renewals and all(e.attributes[tracing.EXPIRES_AT] > 0 for e in renewals)
    assert hold.start_time >= mine.start_time
    assert hold.parent == mine.parent  # None here: no caller's span
    assert hold.attributes[tracing.PRIORITY] == 3
    assert hold.attributes[tracing.OUTCOME] == "released"
    assert hold.attributes[tracing.FENCING_TOKEN] == lease.token


@pytest.mark.timeout(180)
def test_a_long_polled_grant_answers_in_the_callers_trace(spans, traced_broker):
    """A request that waits in the queue: the broker's long poll ends in a grant made by
    another holder's release; that request's span is still the SDK span's child, and the SDK
    span says where it entered the queue. Long polls of 2 s: the first queued answer comes
    then."""
    with Pool(traced_broker.url, "gpu-t", token=USER_TOKEN, max_wait=2.0) as pool:
        first = pool.acquire("1GiB", timeout=30)
        positions: list[int] = []
        got: list = []
        t = threading.Thread(
            target=lambda: got.append(pool.acquire("1GiB", timeout=60, on_queued=positions.append))
        )
        t.start()
        deadline = time.monotonic() + 60
        while not positions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert positions == [1]
        first.release()
        t.join(60)
        (second,) = got
        second.release()
    (mine,) = _acquire_spans(spans, second.id)
    assert mine.attributes[tracing.POSITION] == 1
    assert mine.attributes[tracing.OUTCOME] == "granted"
    assert tracing.EVENT_QUEUED in [e.name for e in mine.events]
    trace_id = _hex(mine.context.trace_id, 32)
    # the queued answer(s), then the long poll the release ended in a grant
    deadline = time.monotonic() + 60
    while True:
        theirs = broker_spans(traced_broker, trace_id, want=1)
        outcomes = [s["attributes"].get(tracing.OUTCOME) for s in theirs]
        if "granted" in outcomes or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert "granted" in outcomes, outcomes
    assert set(outcomes) <= {"granted", "queued"}
    assert {s["parent_id"] for s in theirs} == {_hex(mine.context.span_id, 16)}


def test_a_bad_exporter_name_stops_the_broker_with_exit_2(redis_srv):
    r = subprocess.run(
        broker_argv(free_port(), redis_srv.url),
        env={**os.environ, **_env(OTEL_TRACES_EXPORTER="console,jaegr")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "OTEL_TRACES_EXPORTER='console,jaegr': unknown exporter 'jaegr'" in r.stderr
    assert "console, otlp" in r.stderr


def test_a_bad_exporter_name_stops_serve_with_exit_2():
    r = subprocess.run(
        [*gpulock_argv(), "serve", "--model", "sleep", "--port", str(free_port())],
        env={**os.environ, "OTEL_TRACES_EXPORTER": "zipkin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "unknown exporter 'zipkin'" in r.stdout + r.stderr


# Run with OpenTelemetry packages unimportable, as where they are not installed: the SDK
# process without any (its dependencies include none); the broker without the SDK, the
# exporters and the instrumentation (recent FastAPI, with its own telemetry, requires the API).
_BLOCK = """
import sys
class _NoOtel:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError("blocked: " + name)
        return None
sys.meta_path.insert(0, _NoOtel())
"""

_BROKER = (
    "BLOCKED = ['opentelemetry.sdk', 'opentelemetry.exporter', 'opentelemetry.instrumentation']"
    + _BLOCK
    + "import runpy; runpy.run_module('gpulock_broker', run_name='__main__')"
)

_SDK = (
    "BLOCKED = ['opentelemetry']"
    + _BLOCK
    + """
from gpulock_client import Pool
from gpulock_client.errors import CapacityExceeded
from gpulock_common import tracing
assert not tracing.ENABLED
with Pool(sys.argv[1], "gpu-t", token=sys.argv[2]) as p:
    with p.lease("1MiB", timeout=30) as l:
        l.renew()
print("ok", "opentelemetry" in sys.modules)
"""
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("asked", [False, True], ids=["unconfigured", "asked-for"])
def test_without_opentelemetry_the_sdk_and_the_broker_work(redis_srv, tmp_path, asked):
    port = free_port()
    env = _env(**({"OTEL_TRACES_EXPORTER": "console"} if asked else {}))
    argv = [sys.executable, "-c", _BROKER, *broker_argv(port, redis_srv.url)[3:]]
    p = Proc(argv, env, tmp_path / "broker.log", port)
    try:
        p.wait_up()
        with httpx.Client(
            base_url=p.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
        ) as c:
            assert c.put("/v1/pools/gpu-t", json={"capacity": "1GiB"}).status_code == 200
        r = subprocess.run(
            [sys.executable, "-c", _SDK, p.url, USER_TOKEN],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OTEL_TRACES_EXPORTER": "console"},
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout == "ok False\n"
        assert r.stderr == ""
    finally:
        p.stop()
    log = p.log_path.read_text()
    assert console_spans(log) == []
    warnings = [line for line in log.splitlines() if "OpenTelemetry" in line]
    if asked:  # one line that says what to install
        assert len(warnings) == 1, log
        assert "pip install 'gpulock[otel]'" in warnings[0]
    else:
        assert warnings == [], log


@pytest.mark.timeout(180)
def test_the_brokers_redis_work_runs_in_the_request_spans_context(spans, redis_srv, monkeypatch):
    """The broker's enqueue and its long poll's wait run in tasks of their own
    (``Tasks.spawn``, ``ensure_future``): they see the request's span as current (asyncio
    copies the context into a task), so spans the core makes there are the request's
    children. In process: the broker in a thread, sharing this process's tracer provider."""
    from gpulock.runtime.remote import RemoteHolders

    from ._support import BrokerServer

    seen: dict[str, list[int]] = {"enqueue": [], "wait": []}

    def watched(name, fn):
        async def call(self, *a, **kw):
            seen[name].append(trace.get_current_span().get_span_context().trace_id)
            return await fn(self, *a, **kw)

        return call

    for name in seen:
        monkeypatch.setattr(RemoteHolders, name, watched(name, getattr(RemoteHolders, name)))
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")  # the app gets its request spans
    srv = BrokerServer(redis_srv.url, max_wait=20.0).start()
    try:
        with httpx.Client(
            base_url=srv.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
        ) as c:
            assert c.put("/v1/pools/gpu-w", json={"capacity": "1GiB"}).status_code == 200
        with Pool(srv.url, "gpu-w", token=USER_TOKEN) as pool:
            first = pool.acquire("1GiB", timeout=30)
            positions: list[int] = []
            got: list = []
            t = threading.Thread(
                target=lambda: got.append(
                    pool.acquire("1GiB", timeout=60, on_queued=positions.append)
                )
            )
            t.start()
            deadline = time.monotonic() + 60
            while not seen["wait"] and time.monotonic() < deadline:
                time.sleep(0.05)  # the second acquire's long poll waits in the queue
            first.release()
            t.join(60)
            (second,) = got
            second.release()
    finally:
        srv.stop()
    (mine,) = _acquire_spans(spans, second.id)
    server = [
        s
        for s in spans.get_finished_spans()
        if s.kind == trace.SpanKind.SERVER and s.context.trace_id == mine.context.trace_id
    ]
    assert server and all(s.parent.span_id == mine.context.span_id for s in server)
    assert mine.context.trace_id in seen["enqueue"]
    assert seen["wait"] and set(seen["wait"]) == {mine.context.trace_id}
    refused = [s for s in server if s.attributes.get(tracing.OUTCOME) == "refused"]
    assert refused == []


@pytest.mark.timeout(120)
def test_a_refusal_is_named_on_both_sides(spans, traced_broker):
    with Pool(traced_broker.url, "gpu-t", token=USER_TOKEN) as pool:
        with pytest.raises(CapacityExceeded):
            pool.acquire("2GiB", timeout=5)  # more than the pool's capacity: never fits
    (mine,) = [
        s
        for s in spans.get_finished_spans()
        if s.name == tracing.ACQUIRE
        and s.attributes.get(tracing.OUTCOME) == "refused"
        and s.attributes.get(tracing.AMOUNT) == 2 << 30
    ]
    (theirs,) = broker_spans(traced_broker, _hex(mine.context.trace_id, 32), want=1)
    assert theirs["attributes"][tracing.OUTCOME] == "refused"
    # the same wire code on both sides (gpulock_common.traces.outcome_of, the broker's answer)
    assert theirs["attributes"][tracing.ERROR_CODE] == "capacity_exceeded"
    assert mine.attributes[tracing.ERROR_CODE] == "capacity_exceeded"


@pytest.mark.timeout(120)
async def test_the_async_sdk_carries_its_context_too(spans, traced_broker):
    from gpulock_client import AsyncPool

    async with AsyncPool(traced_broker.url, "gpu-t", token=USER_TOKEN) as pool:
        async with pool.lease("32MiB", timeout=30) as lease:
            pass
    (mine,) = _acquire_spans(spans, lease.id)
    assert mine.kind == trace.SpanKind.CLIENT and mine.attributes[tracing.OUTCOME] == "granted"
    (theirs,) = broker_spans(traced_broker, _hex(mine.context.trace_id, 32), want=1)
    assert theirs["parent_id"] == _hex(mine.context.span_id, 16)
    (hold,) = [
        s
        for s in spans.get_finished_spans()
        if s.name == tracing.HOLD and s.attributes[tracing.LEASE_ID] == lease.id
    ]
    assert hold.end_time is not None


@pytest.mark.timeout(120)
def test_the_sdks_lease_span_has_the_cores_resize_events(spans, traced_broker):
    """The SDK's lease span is the core's design (gpulock_common.traces): a resize answered at
    once is a gpulock.resize event (from, to, outcome, seconds) followed by a renewal, one
    refused names its wire code, and the release ends the span as released."""
    with Pool(traced_broker.url, "gpu-t", token=USER_TOKEN) as pool:
        lease = pool.acquire("32MiB", timeout=30)
        lease.resize("48MiB")
        with pytest.raises(CapacityExceeded):
            lease.resize("2GiB", timeout=0)  # more than the pool's capacity: never fits
        lease.release()
    (hold,) = [
        s
        for s in spans.get_finished_spans()
        if s.name == tracing.HOLD and s.attributes[tracing.LEASE_ID] == lease.id
    ]
    resizes = [dict(e.attributes) for e in hold.events if e.name == tracing.EVENT_RESIZE]
    assert [(r[tracing.RESIZE_FROM], r[tracing.RESIZE_TO]) for r in resizes] == [
        (32 << 20, 48 << 20),
        (48 << 20, 2 << 30),
    ], resizes
    assert resizes[0][tracing.OUTCOME] == "granted" and tracing.ERROR_CODE not in resizes[0]
    assert resizes[1][tracing.OUTCOME] == "refused"
    assert resizes[1][tracing.ERROR_CODE] == "capacity_exceeded"
    assert all(r[tracing.WAIT] >= 0 for r in resizes)
    names = [e.name for e in hold.events]
    assert names.index(tracing.EVENT_RENEW) < names.index(tracing.EVENT_RESIZE)  # the answer
    assert hold.attributes[tracing.OUTCOME] == "released"
    assert hold.attributes[tracing.AMOUNT] == 32 << 20  # as granted


@pytest.mark.timeout(300)
def test_a_grant_within_the_first_long_poll_says_where_it_queued(spans, redis_srv, monkeypatch):
    """A request that queues behind a holder and is granted within its first long poll was
    never answered 503: the 201's place gives the SDK's acquire span its position, a
    gpulock.queued event and the estimate (a measured drain rate), and the broker's request
    span says the same place; on_queued is not called (it is for a request still waiting).
    One granted at once says position 0 on both sides, with no event. In process (the broker
    in a thread, sharing this process's tracer provider); long polls of 120 s, so the
    release lands within the first."""
    from gpulock import Pool as CorePool
    from support.drain import measure_drain
    from support.waiting import wait_until

    from ._support import BrokerServer

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")  # the app gets its request spans
    srv = BrokerServer(redis_srv.url, max_wait=120.0).start()
    core = None
    try:
        with httpx.Client(
            base_url=srv.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
        ) as c:
            assert c.put("/v1/pools/gpu-p", json={"capacity": "1GiB"}).status_code == 200
            core = CorePool.from_url(redis_srv.url, "gpu-p")
            measure_drain(core, 1 << 30)  # so the place carries an estimate
            with Pool(srv.url, "gpu-p", token=USER_TOKEN, max_wait=120.0) as pool:
                first = pool.acquire("1GiB", timeout=30)
                told: list[int] = []
                got: list = []
                t = threading.Thread(
                    target=lambda: got.append(
                        pool.acquire("1GiB", timeout=200, on_queued=told.append)
                    )
                )
                t.start()
                wait_until(
                    lambda: c.get("/v1/pools/gpu-p").json()["waiter_count"] == 1,
                    60,
                    "the second acquire to queue",
                )
                first.release()
                t.join(120)
                (second,) = got
                second.release()
    finally:
        if core is not None:
            core.close()
        srv.stop()
    assert told == []  # never called after the grant

    def server_spans(acquire_span) -> list:
        return [
            s
            for s in spans.get_finished_spans()
            if s.kind == trace.SpanKind.SERVER
            and s.context.trace_id == acquire_span.context.trace_id
            and s.name == LEASES_ROUTE
        ]

    (mine,) = _acquire_spans(spans, second.id)
    a = mine.attributes
    assert a[tracing.OUTCOME] == "granted" and a[tracing.POSITION] == 1, dict(a)
    est = a[tracing.ESTIMATED_WAIT]
    assert est >= 0, dict(a)
    (ev,) = [dict(e.attributes) for e in mine.events if e.name == tracing.EVENT_QUEUED]
    assert ev == {tracing.POSITION: 1, tracing.ESTIMATED_WAIT: est}, ev
    (theirs,) = server_spans(mine)  # one long poll: queued, then granted
    ta = theirs.attributes
    assert ta[tracing.OUTCOME] == "granted" and ta[tracing.POSITION] == 1, dict(ta)
    assert ta[tracing.ESTIMATED_WAIT] == est, dict(ta)

    (at_once,) = _acquire_spans(spans, first.id)
    assert at_once.attributes[tracing.POSITION] == 0
    assert tracing.ESTIMATED_WAIT not in at_once.attributes
    assert tracing.EVENT_QUEUED not in [e.name for e in at_once.events]
    (theirs,) = server_spans(at_once)
    assert theirs.attributes[tracing.POSITION] == 0, dict(theirs.attributes)
    assert tracing.ESTIMATED_WAIT not in theirs.attributes
