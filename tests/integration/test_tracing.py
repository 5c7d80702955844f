"""The core's OpenTelemetry spans (docs/TRACING.md, "Core library"), read from an in-memory
exporter of an SDK tracer provider set for this module: a ``gpulock.acquire`` span per acquire
(a grant at once, a queued grant, a timeout, a refusal with its wire code, a cancellation) and
a ``gpulock.lease`` span per lease, a child of the caller's span like the acquire's, ended at
the release or the loss, with renewal and resize events; sync and async. Without an SDK
provider, or without OpenTelemetry at all, nothing is traced and nothing fails (fresh
interpreters)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading

import pytest
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from gpulock import AcquireTimeout, CapacityExceeded, LeaseLost
from gpulock_common import tracing as t
from support.pools import raw
from support.tracing import events, finished, memory_spans, one
from support.waiting import async_wait_until, wait_until

caller_tracer = trace.get_tracer("tests.tracing")


@pytest.fixture(scope="module")
def _exporter():
    with memory_spans() as exporter:
        yield exporter


@pytest.fixture
def spans(_exporter):
    _exporter.clear()
    return _exporter


def _span_id(span) -> int:
    return span.get_span_context().span_id


# ---- the acquire span ---------------------------------------------------------------------
async def test_async_grant_at_once(make_apool, spans, pool_name):
    pool = make_apool(capacity=100)
    with caller_tracer.start_as_current_span("caller") as caller:
        lease = await pool.acquire(40, priority=3, tenant="team-a", ttl=10)
        assert finished(spans, t.HOLD) == []  # held: its span has not ended
        await lease.release()
    acq = one(spans, t.ACQUIRE)
    a = dict(acq.attributes)
    assert a.pop(t.WAIT) >= 0
    assert a == {
        t.POOL: pool_name,
        t.AMOUNT: 40,
        t.PRIORITY: 3,
        t.TENANT: "team-a",
        t.POSITION: 0,
        t.OUTCOME: "granted",
        t.LEASE_ID: lease.id,
        t.FENCING_TOKEN: lease.token,
        t.DEVICE: 0,
    }
    assert acq.parent.span_id == _span_id(caller)
    assert acq.status.status_code is StatusCode.UNSET
    hold = one(spans, t.HOLD)
    assert hold.parent.span_id == _span_id(caller)  # a sibling of the acquire span
    h = hold.attributes
    assert h[t.LEASE_ID] == lease.id and h[t.FENCING_TOKEN] == lease.token
    assert h[t.AMOUNT] == 40 and h[t.POOL] == pool_name and h[t.TENANT] == "team-a"
    assert h[t.OUTCOME] == "released" and hold.status.status_code is StatusCode.UNSET
    assert hold.start_time >= acq.start_time


async def test_async_queued_grant(make_apool, spans):
    pool = make_apool(capacity=100)
    first = await pool.acquire(100)
    task = asyncio.create_task(pool.acquire(60, timeout=60))
    await async_wait_until(lambda: pool.waiting == 1, 60, "the request to queue")
    await first.release()
    lease = await task
    await lease.release()
    acq = one(spans, t.ACQUIRE, {t.LEASE_ID: lease.id})
    assert acq.attributes[t.POSITION] == 1 and acq.attributes[t.WAIT] > 0
    assert acq.attributes[t.OUTCOME] == "granted"
    assert events(acq, t.EVENT_QUEUED) == [{t.POSITION: 1}]


async def test_async_timeout_and_try(make_apool, spans):
    pool = make_apool(capacity=100)
    held = await pool.acquire(100)
    with pytest.raises(AcquireTimeout):
        await pool.acquire(60, timeout=0.2)
    with pytest.raises(AcquireTimeout):
        await pool.acquire(50, timeout=0)
    await held.release()
    waited = one(spans, t.ACQUIRE, {t.AMOUNT: 60})
    assert waited.attributes[t.OUTCOME] == "timeout"
    assert waited.attributes[t.ERROR_CODE] == "queue_timeout"
    assert waited.attributes[t.POSITION] == 1 and waited.attributes[t.WAIT] > 0
    assert waited.status.status_code is StatusCode.ERROR
    tried = one(spans, t.ACQUIRE, {t.AMOUNT: 50})
    assert tried.attributes[t.OUTCOME] == "timeout" and tried.attributes[t.POSITION] == 0
    assert len(finished(spans, t.HOLD)) == 1  # the held lease's only


async def test_async_refusal_has_its_code(make_apool, spans):
    pool = make_apool(capacity=100)
    with pytest.raises(CapacityExceeded):
        await pool.acquire(200)
    acq = one(spans, t.ACQUIRE)
    assert acq.attributes[t.OUTCOME] == "refused"
    assert acq.attributes[t.ERROR_CODE] == "capacity_exceeded"
    assert acq.status.status_code is StatusCode.ERROR
    assert finished(spans, t.HOLD) == []


async def test_async_cancelled(make_apool, spans):
    pool = make_apool(capacity=100)
    held = await pool.acquire(100)
    task = asyncio.create_task(pool.acquire(60))
    await async_wait_until(lambda: pool.waiting == 1, 60, "the request to queue")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await held.release()
    acq = one(spans, t.ACQUIRE, {t.AMOUNT: 60})
    assert acq.attributes[t.OUTCOME] == "cancelled" and t.ERROR_CODE not in acq.attributes


# ---- the lease span -------------------------------------------------------------------------
async def test_async_renewals_are_events(make_apool, spans):
    pool = make_apool(capacity=100)
    lease = await pool.acquire(10, ttl=3)  # renewed every second
    first = lease.expires_at
    await async_wait_until(lambda: lease.expires_at > first, 60, "a renewal")
    second = lease.expires_at
    await async_wait_until(lambda: lease.expires_at > second, 60, "a second renewal")
    await lease.release()
    hold = one(spans, t.HOLD)
    renewals = [e[t.EXPIRES_AT] for e in events(hold, t.EVENT_RENEW)]
    assert len(renewals) >= 2 and renewals == sorted(renewals)
    assert renewals[-1] == lease.expires_at
    assert hold.attributes[t.EXPIRES_AT] == first


async def test_async_loss_ends_the_span(make_apool, rclient, spans, pool_name):
    pool = make_apool(capacity=100)
    lease = await pool.acquire(10, ttl=3)
    raw(rclient, pool_name, "release", lease.id, lease.token)  # gone behind its holder's back
    await async_wait_until(lambda: lease.lost, 60, "the heartbeat to find the lease lost")
    hold = one(spans, t.HOLD)
    assert hold.attributes[t.OUTCOME] == "lost"
    assert [e.name for e in hold.events][-1] == t.EVENT_LOST
    assert hold.status.status_code is StatusCode.ERROR
    with pytest.raises(LeaseLost):
        await lease.release()
    assert len(finished(spans, t.HOLD)) == 1  # ended once


async def test_async_resize_events(make_apool, spans):
    pool = make_apool(capacity=100)
    lease = await pool.acquire(40)
    await lease.resize(70)
    with pytest.raises(CapacityExceeded):
        await lease.resize(200)
    await lease.release()
    resizes = events(one(spans, t.HOLD), t.EVENT_RESIZE)
    assert [(e[t.RESIZE_FROM], e[t.RESIZE_TO], e[t.OUTCOME]) for e in resizes] == [
        (40, 70, "granted"),
        (70, 200, "refused"),
    ]
    assert resizes[1][t.ERROR_CODE] == "capacity_exceeded"
    assert all(e[t.WAIT] >= 0 for e in resizes)
    names = [e.name for e in one(spans, t.HOLD).events]
    # a resize answered at once renews the lease: that renewal's event comes first
    assert names.index(t.EVENT_RENEW) < names.index(t.EVENT_RESIZE), names


# ---- the sync shell ---------------------------------------------------------------------------
def test_sync_grant_at_once_and_renewals(make_pool, spans, pool_name):
    pool = make_pool(capacity=100)
    with caller_tracer.start_as_current_span("caller") as caller:
        lease = pool.acquire(30, ttl=3)
        first = lease.expires_at
        wait_until(lambda: lease.expires_at > first, 60, "a renewal")
        lease.release()
    acq = one(spans, t.ACQUIRE)
    assert acq.attributes[t.OUTCOME] == "granted" and acq.attributes[t.POSITION] == 0
    assert acq.attributes[t.LEASE_ID] == lease.id and acq.attributes[t.POOL] == pool_name
    hold = one(spans, t.HOLD)
    assert acq.parent.span_id == hold.parent.span_id == _span_id(caller)
    assert hold.attributes[t.OUTCOME] == "released"
    assert events(hold, t.EVENT_RENEW)  # renewed by the background thread


def test_sync_queued_grant_in_a_thread(make_pool, spans):
    pool = make_pool(capacity=100)
    first = pool.acquire(100)
    got: dict[str, object] = {}

    def take() -> None:
        with caller_tracer.start_as_current_span("worker") as worker:
            got["span"] = worker
            got["lease"] = pool.acquire(60, timeout=60)

    th = threading.Thread(target=take)
    th.start()
    wait_until(lambda: pool.waiting == 1, 60, "the request to queue")
    first.release()
    th.join(120)
    lease = got["lease"]
    lease.release()
    acq = one(spans, t.ACQUIRE, {t.LEASE_ID: lease.id})
    assert acq.attributes[t.POSITION] == 1 and acq.attributes[t.WAIT] > 0
    assert acq.parent.span_id == _span_id(got["span"])
    hold = one(spans, t.HOLD, {t.LEASE_ID: lease.id})
    assert hold.parent.span_id == _span_id(got["span"])


def test_sync_timeout(make_pool, spans):
    pool = make_pool(capacity=100)
    held = pool.acquire(100)
    with pytest.raises(AcquireTimeout):
        pool.acquire(60, timeout=0.2)
    held.release()
    acq = one(spans, t.ACQUIRE, {t.AMOUNT: 60})
    assert acq.attributes[t.OUTCOME] == "timeout" and acq.attributes[t.POSITION] == 1


# ---- off ---------------------------------------------------------------------------------------
def _run(code: str) -> str:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_no_sdk_provider_traces_nothing(redis_proc, pool_name):
    """A fresh interpreter with the OpenTelemetry API but no SDK provider: every tracing hook
    of the core is made to raise, and an acquire, a queued acquire, a renewal, a resize and a
    release (sync and async) reach none of them."""
    out = _run(
        f"""
        import asyncio, threading, time
        from opentelemetry import trace
        from gpulock import AsyncPool, Pool
        from gpulock_common import traces, tracing

        def boom(*a, **k):
            raise AssertionError("a tracing hook ran with tracing off")

        traces.AcquireSpan.begin = boom
        for name in ("renewed", "resized", "released", "lost", "traced"):
            setattr(traces, name, boom)
        assert tracing.ENABLED and not tracing.recording()

        with trace.get_tracer("t").start_as_current_span("caller") as s:
            assert not s.is_recording()
            pool = Pool.from_url({redis_proc.url!r}, {pool_name!r}, capacity=100)
            lease = pool.acquire(60, ttl=3)
            first = lease.expires_at
            t = threading.Thread(target=lambda: pool.acquire(60, timeout=60).release())
            t.start()
            deadline = time.monotonic() + 60
            while lease.expires_at == first or pool.waiting != 1:
                assert time.monotonic() < deadline, "no renewal, or the request never queued"
                time.sleep(0.01)
            lease.resize(70)
            lease.release()
            t.join(60)
            pool.close()

        async def main():
            apool = AsyncPool.from_url({redis_proc.url!r}, {pool_name!r})
            async with apool.lease(10) as lease:
                await lease.resize(20)
            await apool.aclose()

        asyncio.run(main())
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_without_opentelemetry(redis_proc, pool_name):
    """A fresh interpreter where OpenTelemetry cannot be imported: gpulock imports and leases."""
    out = _run(
        f"""
        import sys
        sys.modules["opentelemetry"] = None  # import opentelemetry... raises ImportError
        from gpulock import Pool
        from gpulock_common import tracing
        assert not tracing.ENABLED and not tracing.recording()
        pool = Pool.from_url({redis_proc.url!r}, {pool_name!r}, capacity=100)
        with pool.lease(10, ttl=3) as lease:
            lease.resize(20)
        pool.close()
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_sync_queued_acquire_carries_the_estimated_wait(make_pool, spans):
    """Once the pool's drain rate is measured, the acquire span of a request that queues has
    the estimated wait its QueuePlace carried (attribute and queued event)."""
    from support.drain import measure_drain

    pool = make_pool(capacity=100)
    measure_drain(pool, 100)
    first = pool.acquire(100)
    got: dict[str, object] = {}

    def take() -> None:
        got["lease"] = pool.acquire(60, timeout=60, on_queued=lambda p: got.setdefault("p", p))

    th = threading.Thread(target=take)
    th.start()
    wait_until(lambda: "p" in got, 60, "the request to queue")
    first.release()
    th.join(120)
    lease = got["lease"]
    lease.release()
    place = got["p"]
    assert place.estimated_wait is not None
    acq = one(spans, t.ACQUIRE, {t.LEASE_ID: lease.id})
    assert acq.attributes[t.POSITION] == 1
    assert acq.attributes[t.ESTIMATED_WAIT] == pytest.approx(place.estimated_wait)
    assert events(acq, t.EVENT_QUEUED) == [
        {t.POSITION: 1, t.ESTIMATED_WAIT: pytest.approx(place.estimated_wait)}
    ]
