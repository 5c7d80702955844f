"""FastAPI integration: lease GPU memory from a gpulock pool before every CUDA call.

Copy-paste shape (the README shows it whole)::

    from fastapi import FastAPI
    from gpulock.fastapi import GpuLimiter

    gpu = GpuLimiter("redis://localhost:6379/0", pool="gpu0", capacity="20GiB")
    app = FastAPI(lifespan=gpu.lifespan)          # connects to Redis in each worker, after fork

    @app.post("/generate")
    @gpu.endpoint("generate", estimate=lambda req: 2**30 * len(req.prompts))
    def generate(req: GenerateRequest) -> GenerateResponse:   # a plain def: runs in gpulock's
        return model(req.prompts)                              # bounded executor, under a lease

What one request goes through (``GpuLimiter.call``)::

    arrival ── wait for a thread slot (local, FIFO) ── acquire(amount) in the pool's queue
            ── granted ── ensure_valid() ── fn() in the executor thread ── thread returned
            ── release ── response

* The lease is taken before the function runs, so before any tensor of the request touches
  the GPU, and released only after the executor thread has returned, even when
  the HTTP side already answered 504 (case c05).
* Waiting happens in the event loop, never in a thread: ``/health`` keeps answering while
  hundreds of requests queue (case c02). The executor has ``executor_threads`` threads and a
  request takes its thread slot *before* it leases, so no bytes sit leased while their request
  waits for a thread.
* Errors map to HTTP (see :class:`GpuLockHTTPException`): no grant within ``acquire_timeout``
  or a full queue → 503 with ``Retry-After`` and ``X-Queue-Position``; amount > capacity → 413
  naming both numbers, and so is an amount larger than the room the workers' resident leases
  leave (at once, not after a wait at the head of the queue); the work ran past
  ``inference_timeout`` → 504 (the lease stays held until the thread returns); CUDA OOM → traceback dropped, ``empty_cache()``, counted, 503 with
  ``Retry-After``; another CUDA error (device-side assert, illegal address) → 500, the worker
  marks itself not ready and exits (SIGTERM to itself) so gunicorn starts a fresh one.
* ``X-Request-ID`` makes retries idempotent (case c08): the header value is hashed into the
  lease request id, one worker owns it at a time (a claim key in Redis), a retry that arrives
  while the first attempt is queued or running joins it (same place in the queue, one
  execution), and a result is kept ``result_ttl`` seconds for retries that come later. A 503
  to a request that carries ``X-Request-ID`` does not give up its place: the request stays
  queued up to ``park_timeout`` more seconds and runs when granted, so the retry sent after
  ``Retry-After`` collects the result.
* A client that closes its connection while its request waits (uvicorn does not cancel the
  handler) is noticed at once (:func:`watch_disconnect`, the ASGI ``http.disconnect``): the
  request leaves the thread-slot wait or the pool's queue and is never granted; work already
  running finishes under its lease and its result is dropped. Both answer 499 (never sent) and
  are counted in ``gpulock_client_disconnected_total``.
* :func:`install_http_guards` gives any app the service's HTTP guards: 400 for a body that is
  not UTF-8, 422 that always renders, 413 over a size bound, 408 for a slow body.

``Retry-After`` (whole seconds, 1..``max_retry_after``) is computed from the queue, never a
constant::

    retry_after = ceil(position / grant_rate + local_position / local_grant_rate)

where ``position`` is the request's place in the pool's FIFO queue and ``grant_rate`` the
pool's grants per second while it is busy: an exponentially weighted moving average (time
constant 10 s) of the pool's ``grants`` counter, sampled from Redis every ``reaper_interval``,
that counts only the intervals that began with waiters queued (an idle pool grants nothing
because nobody asks, not because it is slow: averaging idle time in would tell the first
clients of a burst to wait many times too long) and starts at its first busy sample. A request
that timed out still waiting for one of its worker's threads is not in the pool's queue yet:
its ``position`` is the pool's queue length (read at that moment) and ``local_position`` its
place among the worker's waiters, drained at ``local_grant_rate`` (the same busy-time average
over this worker's own grants). Before any busy interval was seen, ``grant_rate`` falls back to
``leases / mean_hold`` (Little's law: leases held at once over this worker's moving-average
hold time), and with no measurement at all to one second per place (or the server's hint,
the time to the nearest lease expiry, when shorter): a retry that comes too early costs one
cheap lookup, one that comes too late costs latency. A 503 that keeps its place (parked, see
above) never says more than ``park_timeout / 2``, so the retry arrives while the place is
still kept, also after the client's jitter. In a grace period after Redis lost the pool
(nothing is granted before it ends) every Retry-After is at least the time left in it (capped
at ``max_retry_after``), and a request parked in it keeps its place until the grace ends and
``park_timeout`` after.
``X-Queue-Position`` is ``position + local_position``.

Metrics (``/metrics``, Prometheus text; multiprocess mode when ``PROMETHEUS_MULTIPROC_DIR`` is
set, as under gunicorn): pool gauges are read from Redis at scrape time; counters and
histograms are per process and summed by prometheus-client's multiprocess collector. See
``docs/SERVICE.md`` for the list.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import contextvars
import functools
import hashlib
import inspect
import json
import logging
import math
import os
import re
import signal
import socket
import time
import typing
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from fastapi import HTTPException, Request, Response

from ._async import AsyncLease, AsyncPool
from ._keys import pool_key, pool_keys
from ._protocol import PoolStatus
from .cuda import drop_traceback, empty_cache, is_fatal_cuda_error, is_oom
from .errors import (
    AcquireTimeout,
    BackendUnavailable,
    CapacityExceeded,
    GpuLockError,
    InvalidArgument,
    LeaseLost,
    PoolNotFound,
    QueueFull,
)
from .units import format_size, parse_size
from ._failure_log import FailureLog
from ._disconnect import _Gone, _is_gone, _wait_or_gone, watch_disconnect
from ._http_guards import (
    RequestLimits,
    install_error_handlers,
    install_http_guards,
    utf8_error,
)

__all__ = [
    "BertEstimator",
    "GpuCall",
    "GpuLimiter",
    "GpuLockHTTPException",
    "RequestLimits",
    "current_lease",
    "install_error_handlers",
    "install_http_guards",
    "next_bucket",
    "request_ticket",
    "utf8_error",
    "watch_disconnect",
]

log = logging.getLogger("gpulock.fastapi")

_current_lease: contextvars.ContextVar[AsyncLease | None] = contextvars.ContextVar(
    "gpulock_lease", default=None
)


def current_lease() -> AsyncLease | None:
    """The lease the current executor thread runs under (None outside a guarded call). Work
    that makes several CUDA calls should call ``current_lease().ensure_valid()`` before each."""
    return _current_lease.get()


# ---------------------------------------------------------------------------------------------
# Request ids


def request_ticket(route: str, header_value: str) -> str:
    """The lease request id for an ``X-Request-ID`` header value on a route: any header value
    (any length, any characters) hashes to ``rq.<32 hex>``, which matches the core's pattern
    ``[A-Za-z0-9._:-]{1,128}``. Every worker computes the same ticket for the same value."""
    h = hashlib.sha256(f"{route}\n{header_value}".encode("utf-8", "surrogatepass")).hexdigest()
    return f"rq.{h[:32]}"


# ---------------------------------------------------------------------------------------------
# Estimates


def next_bucket(n: int, *, minimum: int = 1) -> int:
    """The next power of two ≥ n (and ≥ minimum): the shape buckets calibration measures."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class BertEstimator:
    """Bytes of GPU memory one forward pass of a BERT-style encoder needs beyond its weights,
    for ``batch`` sequences padded to ``tokens``.

    Assumption: inference mode (``torch.inference_mode()``/``no_grad``) frees each layer's
    activations before the next layer runs, so the peak is one layer's live tensors, not the sum
    over layers. One layer keeps alive at its peak:

    * hidden states in and out, Q, K, V, attention context: ``6 * B*S*H`` elements
    * the feed-forward intermediate and its activation: ``2 * B*S*I`` elements
    * attention scores and softmax probabilities: ``2 * B*A*S*S`` elements

    ``peak = e * (B*S*(6H + 2I) + 2*B*A*S^2)`` with ``e`` bytes per element, and the estimate is
    ``max(floor, ceil(safety * peak))``. ``safety`` (2.0) covers the caching allocator's
    rounding (512 B blocks under 1 MiB, 2 MiB segments above) and the tokenizer's padding;
    ``floor`` (2 MiB) is the allocator's smallest segment for large tensors. The constants of
    all-MiniLM-L6-v2 (H=384, I=1536, A=12 heads, 6 layers, fp32) come from its ``config.json``.
    On CUDA, :meth:`GpuLimiter.calibrate` replaces the formula by measured peaks.
    """

    hidden: int = 384
    intermediate: int = 1536
    heads: int = 12
    layers: int = 6
    bytes_per_element: int = 4
    safety: float = 2.0
    floor: int = 2 * 2**20

    def peak(self, batch: int, tokens: int) -> int:
        b, s = max(1, int(batch)), max(1, int(tokens))
        elems = b * s * (6 * self.hidden + 2 * self.intermediate) + 2 * b * self.heads * s * s
        return elems * self.bytes_per_element

    def __call__(self, batch: int, tokens: int) -> int:
        return max(self.floor, math.ceil(self.safety * self.peak(batch, tokens)))


# ---------------------------------------------------------------------------------------------
# HTTP errors


class GpuLockHTTPException(HTTPException):
    """An HTTPException raised by the integration; ``reason`` is a short machine-readable
    cause (``queue_timeout``, ``queue_full``, ``capacity``, ``inference_timeout``,
    ``cuda_oom``, ``cuda_error``, ``lease_lost``, ``backend``, ``not_ready``, ``conflict``,
    ``invalid_argument``)."""

    def __init__(
        self, status_code: int, detail: str, reason: str, headers: dict[str, str] | None = None
    ):
        super().__init__(status_code=status_code, detail=detail, headers=headers)
        self.reason = reason


class _CudaOOM(Exception):
    """Replaces a CUDA OOM (whose traceback pinned tensors) once it left the thread."""


class _CudaFatal(Exception):
    """Replaces a sticky CUDA error once it left the thread."""


# ---------------------------------------------------------------------------------------------
# Metrics (one set per process; prometheus-client's multiprocess mode aggregates them)

_BYTES_BUCKETS = tuple(float(2**k) for k in range(20, 38, 2))  # 1 MiB .. 64 GiB
_WAIT_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.requests = Counter(
            "gpulock_requests",
            "Guarded requests answered, by route and HTTP status",
            ["route", "status"],
        )
        self.acquire_wait = Histogram(
            "gpulock_acquire_wait_seconds",
            "Seconds from arrival until the lease was granted",
            ["route"],
            buckets=_WAIT_BUCKETS,
        )
        self.hold = Histogram(
            "gpulock_hold_seconds",
            "Seconds a request's lease was held (grant to release)",
            ["route"],
            buckets=_WAIT_BUCKETS,
        )
        self.run = Histogram(
            "gpulock_inference_seconds",
            "Seconds the guarded work ran in its thread",
            ["route"],
            buckets=_WAIT_BUCKETS,
        )
        self.grants = Counter(
            "gpulock_grants", "Leases granted to this service's requests", ["route"]
        )
        self.timeouts = Counter(
            "gpulock_acquire_timeouts", "Requests answered 503: no grant in time", ["route"]
        )
        self.queue_full = Counter(
            "gpulock_queue_full", "Requests refused: the pool's queue was full", ["route"]
        )
        self.lost = Counter(
            "gpulock_leases_lost",
            "Leases found lost (before or during the guarded work)",
            ["route"],
        )
        self.oom = Counter(
            "gpulock_cuda_oom", "CUDA out-of-memory errors inside a lease", ["route"]
        )
        self.fatal = Counter(
            "gpulock_cuda_fatal_errors", "Sticky CUDA errors that made the worker exit", ["route"]
        )
        self.inference_timeouts = Counter(
            "gpulock_inference_timeouts", "Requests answered 504", ["route"]
        )
        self.disconnected = Counter(
            "gpulock_client_disconnected",
            "Guarded requests whose client closed the connection before the answer, by "
            "phase: 'waiting' (left the queue, never granted) or 'running' (the work "
            "finished, its result was dropped)",
            ["route", "phase"],
        )
        self.replays = Counter(
            "gpulock_idempotent_replays",
            "Requests answered from a stored result or by joining a running attempt (X-Request-ID)",
            ["route", "how"],
        )
        self.estimate = Histogram(
            "gpulock_request_estimate_bytes",
            "Bytes leased per request (the estimate)",
            ["route"],
            buckets=_BYTES_BUCKETS,
        )
        self.resident = Gauge(
            "gpulock_worker_resident_bytes",
            "Bytes held by live workers' resident leases",
            multiprocess_mode="livesum",
        )
        self.ready = Gauge(
            "gpulock_workers_ready", "Live workers that are ready", multiprocess_mode="livesum"
        )
        self.workers = Gauge("gpulock_workers", "Live workers", multiprocess_mode="livesum")


_metrics: _Metrics | None = None


def metrics() -> _Metrics:
    global _metrics
    if _metrics is None:
        _metrics = _Metrics()
    return _metrics


def _multiproc_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


_LIVE_FILE = re.compile(r"^gauge_live[a-z]*_(\d+)\.db$")


def _sweep_dead_processes(path: str) -> None:
    """Remove the live-gauge files of processes that are gone (what gunicorn's ``child_exit``
    hook does; this covers ``uvicorn --workers N`` and workers killed with -9)."""
    from prometheus_client import multiprocess

    try:
        names = os.listdir(path)
    except OSError:
        return
    dead = set()
    for n in names:
        m = _LIVE_FILE.match(n)
        if m:
            pid = int(m.group(1))
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                dead.add(pid)
            except PermissionError:
                pass
    for pid in dead:
        multiprocess.mark_process_dead(pid, path)


def _pool_families(pool: str, st: PoolStatus | None, error: str | None):
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    up = GaugeMetricFamily(
        "gpulock_pool_up",
        "1 when the pool's status was read from Redis for this scrape",
        labels=["pool"],
    )
    up.add_metric([pool], 0.0 if st is None else 1.0)
    yield up
    if st is None:
        return
    for name, doc, v in (
        (
            "gpulock_pool_capacity_bytes",
            "Pool capacity, read from Redis at scrape time",
            st.capacity,
        ),
        (
            "gpulock_pool_used_bytes",
            "Bytes leased in the pool, read from Redis at scrape time",
            st.used,
        ),
        (
            "gpulock_pool_leases",
            "Live leases in the pool, read from Redis at scrape time",
            st.lease_count,
        ),
        (
            "gpulock_pool_waiters",
            "Requests queued in the pool, read from Redis at scrape time",
            st.waiter_count,
        ),
    ):
        g = GaugeMetricFamily(name, doc, labels=["pool"])
        g.add_metric([pool], float(v))
        yield g
    for name, doc, v in (
        ("gpulock_pool_grants", "Leases the pool has granted (all clients), from Redis", st.grants),
        (
            "gpulock_pool_reaped_leases",
            "Expired leases the pool has reaped, from Redis",
            st.reaped_leases,
        ),
        (
            "gpulock_pool_reaped_waiters",
            "Dead waiters the pool has dropped, from Redis",
            st.reaped_waiters,
        ),
    ):
        c = CounterMetricFamily(name, doc, labels=["pool"])
        c.add_metric([pool], float(v))
        yield c


class _StaticCollector:
    def __init__(self, families):
        self._families = list(families)

    def collect(self):
        return iter(self._families)


# ---------------------------------------------------------------------------------------------
# Thread slots: a FIFO semaphore that knows each waiter's place


_UNMEASURED_SECONDS_PER_PLACE = 1.0  # Retry-After per queue place before any rate was measured


class BusyRate:
    """Events per second while a queue is busy: an exponentially weighted moving average
    (time constant ``tau`` seconds) of a monotonic counter, fed one sample per status read.

    Only intervals that began busy (waiters queued at their first sample) count: the rate a
    waiter cares about is how fast the queue drains when there is a queue, and an idle interval
    (no grants because nobody asked) would drag the average toward zero and make the first
    Retry-After of a burst many times too long; so would the interval in which a burst begins,
    since it is mostly idle. The first busy interval sets the rate outright instead of being
    blended with a made-up prior; before any, the interval in which a burst began does, when
    it saw grants (an underestimate, but better than no rate). A counter that went backwards
    (a Redis restart) restarts the sampling. ``rate`` is None until an interval counted.
    """

    def __init__(self, tau: float = 10.0):
        self.tau = float(tau)
        self.rate: float | None = None
        self._last: tuple[float, int, bool] | None = None  # (time, counter, busy)

    def sample(self, now: float, count: int, *, busy: bool) -> None:
        last, self._last = self._last, (now, count, busy)
        if last is None:
            return
        t0, c0, busy0 = last
        dt = now - t0
        if dt <= 0 or count < c0:
            return
        inst = (count - c0) / dt
        if self.rate is None:
            if busy0 or (busy and inst > 0):
                self.rate = inst
        elif busy0:
            self.rate += (1.0 - math.exp(-dt / self.tau)) * (inst - self.rate)


def _resident_held(st: PoolStatus) -> int:
    """Bytes held by resident leases (the workers' models) in a status that lists the leases."""
    return sum(
        lz.amount for lz in st.leases if str(lz.holder.get("purpose", "")).startswith("resident")
    )


class _Slots:
    def __init__(self, n: int):
        self.free = n
        self.waiters: collections.deque[asyncio.Future] = collections.deque()

    def position(self, fut: asyncio.Future | None) -> int:
        if fut is None:
            return 0
        try:
            return self.waiters.index(fut) + 1
        except ValueError:
            return 0

    async def acquire(self, on_wait: Callable[[asyncio.Future], None]) -> None:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        on_wait(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed to us just as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self.waiters.remove(fut)
            raise

    def release(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


# ---------------------------------------------------------------------------------------------
# Jobs: one per guarded call; runs as its own task so the HTTP side can answer 503/504 while
# the job stays queued (X-Request-ID) or its thread still runs (c05).


@dataclass(eq=False)
class _Job:
    route: str
    amount: int
    ticket: str | None
    fingerprint: str
    arrival: float
    phase: str = "slot"  # slot → queued → running → done
    position: int = 0  # place in the pool's queue while queued (0: unknown)
    slot_future: asyncio.Future | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)  # set when running or done
    task: asyncio.Task | None = None
    wait_s: float | None = None
    run_s: float | None = None
    server_retry_after: float | None = None
    place_until: float = 0.0  # a parked job: when its place in the queue runs out (monotonic)
    abandoned: bool = False  # the HTTP side gave up on it (503 without parking, client gone)
    attached: int = 0  # HTTP requests waiting on it now (a retry with the same X-Request-ID joins)
    # Result or error, set as soon as known: the response goes out while the release (one more
    # Redis round trip, after the thread returned) is still on its way.
    outcome: asyncio.Future | None = None


_CLAIM_TTL_MS = 10_000
_UNLOCK = """
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class GpuLimiter:
    """Leases GPU memory from a gpulock pool around the CUDA work of FastAPI routes.

    Create it at import time (it does no I/O then); ``lifespan`` (or ``start()``/``stop()``)
    connects to Redis, creates the executor and starts the background reaper in each worker,
    after fork.

    Args:
        redis_url: ``redis://``/``rediss://``/``unix://``/``redis+sentinel://`` URL of the Redis holding the pool.
        pool: pool name (one GPU).
        capacity: bytes or a size ("20GiB"); when given the pool is created with it if it does
            not exist (``configure="create"``, the default) or set to it (``configure="set"``).
        acquire_timeout: seconds a request may wait for a thread slot and a grant → else 503.
        inference_timeout: seconds the guarded work may run → else 504 (the lease is released
            only when the thread really returned).
        ttl: lease time to live in seconds (the heartbeat renews it at ttl/3); bounded by the
            pool's ``max_ttl`` as last read (:attr:`lease_ttl`, one warning when it clamps).
        executor_threads: threads running guarded work in this worker.
        park_timeout: seconds a request that carries ``X-Request-ID`` stays queued after its
            503, so that its retry joins its place (0 disables).
        result_ttl: seconds a finished result stays in Redis for retries of the same request.
        max_retry_after: cap of the Retry-After header, seconds.
        reaper_interval: seconds between the background status reads (reap, wake waiters,
            queue rate for Retry-After, readiness).
        history_file: prefix of a per-process JSON-lines file of grant/release events, for
            tests (default: env ``GPULOCK_HISTORY_FILE``).
        enabled: False runs the work without leases (for measuring the lease's overhead).
        exit_on_fatal: after a sticky CUDA error, SIGTERM this process once the 500 is sent.
        request_id_header: the idempotency header.
    """

    def __init__(
        self,
        redis_url: str,
        pool: str = "gpu0",
        *,
        capacity: int | str | None = None,
        configure: str = "create",
        acquire_timeout: float = 10.0,
        inference_timeout: float = 30.0,
        ttl: float = 30.0,
        executor_threads: int = 2,
        park_timeout: float = 30.0,
        result_ttl: float = 60.0,
        max_retry_after: float = 120.0,
        max_waiters: int | None = None,
        reaper_interval: float = 1.0,
        history_file: str | None = None,
        enabled: bool = True,
        exit_on_fatal: bool = True,
        request_id_header: str = "X-Request-ID",
    ):
        if configure not in ("create", "set"):
            raise InvalidArgument(f"configure must be 'create' or 'set', got {configure!r}")
        self.redis_url = redis_url
        self.pool_name = pool
        self.capacity = None if capacity in (None, "") else parse_size(capacity, name="capacity")
        self.configure_mode = configure
        self.acquire_timeout = float(acquire_timeout)
        self.inference_timeout = float(inference_timeout)
        self.ttl = float(ttl)
        self._ttl_clamped: tuple[float, float] | None = None
        self.executor_threads = int(executor_threads)
        if self.executor_threads < 1:
            raise InvalidArgument(f"executor_threads must be >= 1, got {executor_threads!r}")
        self.park_timeout = float(park_timeout)
        self.result_ttl = float(result_ttl)
        self.max_retry_after = float(max_retry_after)
        self.max_waiters = max_waiters
        self.reaper_interval = float(reaper_interval)
        self.history_file = (
            history_file if history_file is not None else os.environ.get("GPULOCK_HISTORY_FILE")
        )
        self.enabled = enabled
        self.exit_on_fatal = exit_on_fatal
        self.request_id_header = request_id_header

        self.pool: AsyncPool | None = None
        self.redis: aioredis.Redis | None = None  # set by start()
        self.executor: ThreadPoolExecutor | None = None
        self.status: PoolStatus | None = None  # last status read
        self.status_at = 0.0
        self.redis_error: str | None = "not connected yet"
        self.conditions: dict[str, tuple[bool, str]] = {}
        self.fatal_error: str | None = None
        self.resident_leases: list[AsyncLease] = []
        self.resident_wanted = 0
        self._resident_waiting: int = 0
        self._resident_mode = ""
        self._resident_bytes: int | None = None  # all workers' resident leases, last read
        self._pool_rate = BusyRate()  # the pool's grants/s while waiters are queued
        self._local_grants = 0  # grants to this worker's requests (for its own drain rate)
        self._local_rate = BusyRate()  # ... this worker's grants/s while its threads are all taken
        self._hold_ewma: float | None = None
        self._slots = _Slots(self.executor_threads)
        self._jobs: dict[str, _Job] = {}
        # Repeated failures of the background loops (Redis down) log one line, then a summary.
        self._tick_log = FailureLog(f"reaper tick for pool {self.pool_name}")
        self._claims_log = FailureLog(f"request-claim refresh for pool {self.pool_name}")
        self._all_jobs: set[_Job] = set()
        self._tasks: set[asyncio.Task] = set()
        self._ticker: asyncio.Task | None = None
        self._estimates: dict[str, int] = {}
        self._owner = f"{socket.gethostname()}:{os.getpid()}"
        self._history: typing.TextIO | None = None
        self._started = False
        self._stopping = False

    # ---- keys -----------------------------------------------------------------------------
    def _key(self, suffix: str) -> str:
        return pool_key(self.pool_name, suffix)

    @property
    def estimates_key(self) -> str:
        """``gpulock:{pool}:estimates``: hash of calibrated per-shape peaks, field
        ``<route>|b<batch bucket>|s<token bucket>`` → bytes."""
        return self._key("estimates")

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect (in this process: call it after fork), configure the pool when a capacity
        was given, start the executor and the background reaper. No error if Redis is down:
        readiness says so and the reaper keeps trying."""
        if self._started:
            return
        from ._connect import async_client

        self._owner = f"{socket.gethostname()}:{os.getpid()}"
        self.redis = async_client(
            self.redis_url,
            socket_timeout=5.0,
            socket_connect_timeout=2.0,
            health_check_interval=10,
            client_name=f"gpulock-service-{os.getpid()}",
        )
        kw: dict[str, Any] = {"capacity": self.capacity, "default_ttl": self.ttl}
        if self.max_waiters is not None:
            kw["max_waiters"] = self.max_waiters
        self.pool = AsyncPool(self.redis, self.pool_name, **kw)
        self.executor = ThreadPoolExecutor(self.executor_threads, thread_name_prefix="gpulock-work")
        if self.history_file:
            path = f"{self.history_file}.{os.getpid()}.jsonl"
            self._history = await asyncio.to_thread(lambda: open(path, "a", buffering=1))
        self._started = True
        m = metrics()
        m.workers.set(1)
        m.ready.set(0)
        if self.capacity is not None:
            try:
                await self.pool.configure(
                    self.capacity, create_only=self.configure_mode == "create"
                )
            except GpuLockError as e:
                log.warning("gpulock: could not configure pool %s yet: %s", self.pool_name, e)
        await self._tick()
        self._ticker = asyncio.get_running_loop().create_task(
            self._tick_loop(), name="gpulock-reaper"
        )

    async def stop(self, *, grace_s: float = 10.0) -> None:
        """Cancel queued requests (they leave the queue at once), wait up to ``grace_s`` for
        running work, release the resident leases, close the connection."""
        if not self._started:
            return
        self._stopping = True
        m = metrics()
        m.ready.set(0)
        if self._ticker:
            self._ticker.cancel()
            with contextlib.suppress(BaseException):
                await self._ticker
        for job in list(self._all_jobs):
            if job.phase in ("slot", "queued") and job.task is not None:
                job.task.cancel()
        for t in list(self._tasks):
            t.cancel()
        pending = [j.task for j in self._all_jobs if j.task is not None and not j.task.done()]
        if pending:
            await asyncio.wait(pending, timeout=grace_s)
        for lease in self.resident_leases:
            self._record("release", lease, route="resident")  # written before the release is sent
            with contextlib.suppress(BaseException):
                await lease.release()
        self.resident_leases.clear()
        m.resident.set(0)
        m.workers.set(0)
        if self.pool is not None:
            await self.pool.aclose()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.aclose()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        if self._history:
            self._history.close()
            self._history = None
        self._started = False

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any = None):
        """``FastAPI(lifespan=limiter.lifespan)``: start in each worker, stop at shutdown."""
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task:
        """Run a background coroutine that ``stop()`` cancels."""
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    # ---- readiness --------------------------------------------------------------------------
    def set_condition(self, name: str, ok: bool, message: str = "") -> None:
        """An application condition for readiness (e.g. ``"model"``). Guarded calls are refused
        with 503 while any condition is false."""
        self.conditions[name] = (ok, message)
        self._publish_ready()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, details)``: Redis answered the last status read (within 3 reaper
        intervals), every condition holds, every resident lease is valid, no fatal CUDA
        error."""
        checks: dict[str, Any] = {}
        fresh = self.status is not None and (time.monotonic() - self.status_at) < max(
            3 * self.reaper_interval, 3.0
        )
        checks["redis"] = {
            "ok": bool(fresh and self.redis_error is None),
            "message": self.redis_error or ("" if fresh else "no recent status from Redis"),
        }
        for k, (ok, msg) in self.conditions.items():
            checks[k] = {"ok": ok, "message": msg}
        if self.resident_wanted:
            held = sum(lz.amount for lz in self.resident_leases if not lz.lost and not lz.released)
            ok = held >= self.resident_wanted
            checks["resident_lease"] = {
                "ok": ok,
                "held_bytes": held,
                "wanted_bytes": self.resident_wanted,
                "message": "" if ok else self._resident_message(),
            }
        if self.fatal_error:
            checks["cuda"] = {"ok": False, "message": self.fatal_error}
        ready = all(c["ok"] for c in checks.values())
        return ready, checks

    def _accepting(self) -> tuple[bool, str]:
        if self.fatal_error:
            return False, f"worker is exiting after a CUDA error: {self.fatal_error}"
        if self._stopping or not self._started:
            return False, "worker is not started or is shutting down"
        for k, (ok, msg) in self.conditions.items():
            if not ok:
                return False, f"{k}: {msg}" if msg else f"{k} not ready"
        if self.resident_wanted:
            held = sum(lz.amount for lz in self.resident_leases if not lz.lost and not lz.released)
            if held < self.resident_wanted:
                return False, self._resident_message()
        return True, ""

    def _publish_ready(self) -> None:
        with contextlib.suppress(Exception):
            metrics().ready.set(1 if (self._started and self.readiness()[0]) else 0)

    def _resident_message(self) -> str:
        held = sum(lz.amount for lz in self.resident_leases if not lz.lost and not lz.released)
        need = self.resident_wanted - held
        st = self.status
        if st is None:
            return f"waiting for a resident lease of {format_size(need)}; pool status unknown ({self.redis_error})"
        free = max(0, st.capacity - st.used)
        short = max(0, need - free)
        msg = (
            f"waiting for a resident lease of {format_size(need)} ({need} bytes) for this worker's model: "
            f"pool {self.pool_name!r} has {format_size(free)} free of {format_size(st.capacity)} "
            f"({st.lease_count} leases hold {format_size(st.used)}"
        )
        if short:
            msg += f"); shortfall {format_size(short)} ({short} bytes)"
        else:
            msg += f"; {st.waiter_count} queued)"
        if self._resident_mode:
            msg += f"; {self._resident_mode}"
        return msg

    # ---- resident leases --------------------------------------------------------------------
    async def acquire_resident(
        self, amount: int | str, *, purpose: str = "model", ttl: float | None = None
    ) -> AsyncLease:
        """Take a long-lived lease for what this worker keeps on the GPU (weights, CUDA
        context). Waits as long as it takes (readiness reports the shortfall meanwhile); the
        lease is released by ``stop()`` and, if the worker dies, reaped after its ttl. If the
        lease is lost later (Redis restarted without data, a long pause), readiness turns false
        and it is taken again in the background."""
        amount = parse_size(amount, name="resident amount")
        self.resident_wanted += amount
        self._resident_waiting += 1
        self._publish_ready()
        try:
            lease = await self._acquire_resident_once(amount, purpose, ttl)
        finally:
            self._resident_waiting -= 1
        return lease

    async def _resident_room(self) -> tuple[int, int]:
        """``(capacity, bytes held by resident leases)`` read from Redis now."""
        assert self.pool is not None
        st = await self.pool.status(limit=100_000)
        self.status, self.status_at = st, time.monotonic()  # fresh: readiness quotes it
        self._resident_bytes = _resident_held(st)
        return st.capacity, self._resident_bytes

    def _clamp_ttl(self, ttl: float) -> float:
        """``ttl`` bounded by the pool's ``max_ttl`` as last read (the operator's bound wins:
        ``gpulock pool set --max-ttl``); one warning line each time the clamp changes."""
        st = self.status
        mttl = st.max_ttl if st is not None else 0.0
        if mttl and ttl > mttl:
            if self._ttl_clamped != (ttl, mttl):
                self._ttl_clamped = (ttl, mttl)
                log.warning(
                    "gpulock: lease ttl %gs (GPULOCK_TTL / ttl=) exceeds pool %s's max_ttl %gs; "
                    "using %gs (renewed every %gs)",
                    ttl,
                    self.pool_name,
                    mttl,
                    mttl,
                    mttl / 3,
                )
            return mttl
        if self._ttl_clamped is not None and self._ttl_clamped[0] == ttl:
            self._ttl_clamped = None
        return ttl

    @property
    def lease_ttl(self) -> float:
        """The ttl requests lease with: ``ttl`` bounded by the pool's ``max_ttl``."""
        return self._clamp_ttl(self.ttl)

    async def _check_room(self, amount: int) -> None:
        """413 at once for a request that fits the capacity but not the room the workers'
        resident leases (their models) leave: FIFO would otherwise keep it at the head of the
        queue for its whole timeout, stalling every request behind it, and then answer an
        unwinnable 503. The cached resident total (refreshed every ``10 × reaper_interval``) only
        picks the suspects; the refusal is decided on a fresh read."""
        st = self.status
        if st is None or not self._resident_bytes:
            return
        if amount > st.capacity or amount <= st.capacity - self._resident_bytes:
            return  # > capacity: the core raises CapacityExceeded (413) itself
        try:
            capacity, held = await self._resident_room()
        except GpuLockError:
            return  # the acquire reports the backend's state
        room = capacity - held
        if room < amount <= capacity:
            raise GpuLockHTTPException(
                413,
                f"this request needs {format_size(amount)} ({amount} bytes) of GPU memory but pool "
                f"{self.pool_name!r} leaves {format_size(max(0, room))} ({max(0, room)} bytes) for requests: a "
                f"capacity of {format_size(capacity)} ({capacity} bytes) minus {format_size(held)} held by the "
                f"workers' resident leases (their models); send a smaller batch",
                "capacity",
            )

    async def _acquire_resident_once(
        self, amount: int, purpose: str, ttl: float | None
    ) -> AsyncLease:
        """Take a resident lease without ever blocking the pool's request traffic.

        A FIFO queue would let a resident request that can never fit (the other workers'
        resident leases leave too little room: case c07's 4th worker) sit at the head of the
        queue and stall every request behind it. So: while ``capacity - resident bytes of
        others >= amount`` (it fits once the short request leases drain) we wait in the queue
        like anyone else; otherwise we only *try* (``timeout=0``: never queue, never jump the
        queue) once per reaper interval, and move into the queue as soon as room appears (a
        worker died and its lease was reaped). Re-checked every reaper interval."""
        assert self.pool is not None
        backoff = 0.5
        holder = {"purpose": f"resident:{purpose}"}
        self._resident_mode = ""
        while True:
            try:
                capacity, others = await self._resident_room()
                ttl_s = self._clamp_ttl(
                    ttl or self.ttl
                )  # the pool's max_ttl, as just read, bounds it
                if capacity - others < amount:
                    self._resident_mode = (
                        f"the other workers' resident leases hold {format_size(others)}, "
                        f"so {format_size(amount)} cannot fit until one of them ends; "
                        f"trying every {self.reaper_interval:g}s without queueing"
                    )
                    try:
                        lease = await self.pool.acquire(amount, ttl=ttl_s, timeout=0, holder=holder)
                        break
                    except AcquireTimeout:
                        await asyncio.sleep(self.reaper_interval)
                        continue
                self._resident_mode = "queued behind the requests ahead of it"
                acq = asyncio.ensure_future(
                    self.pool.acquire(amount, ttl=ttl_s, timeout=None, holder=holder)
                )
                try:
                    while True:
                        done, _ = await asyncio.wait({acq}, timeout=max(self.reaper_interval, 0.5))
                        if done:
                            break
                        capacity, others = await self._resident_room()
                        if (
                            capacity - others < amount
                        ):  # another resident took the room: stop blocking
                            acq.cancel()
                            with contextlib.suppress(BaseException):
                                await acq
                            break
                except BaseException:
                    acq.cancel()
                    raise
                if acq.done() and not acq.cancelled():
                    lease = acq.result()
                    break
            except CapacityExceeded:
                raise
            except (BackendUnavailable, PoolNotFound) as e:
                log.warning(
                    "gpulock: resident lease of %s not acquired yet: %s", format_size(amount), e
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        self._resident_mode = ""
        self.resident_leases.append(lease)
        self._record("grant", lease, route="resident")
        metrics().resident.inc(amount)
        self._publish_ready()

        def lost(lz: AsyncLease) -> None:
            log.warning(
                "gpulock: resident lease of %s lost; worker not ready until it is taken again",
                format_size(lz.amount),
            )
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            loop.call_soon(self._replace_resident, lz, purpose, ttl)

        lease.on_lost(lost)
        return lease

    def _replace_resident(self, lz: AsyncLease, purpose: str, ttl: float | None) -> None:
        if self._stopping or lz not in self.resident_leases:
            return
        self.resident_leases.remove(lz)
        metrics().resident.dec(lz.amount)
        self._publish_ready()
        self.spawn(self._acquire_resident_once(lz.amount, purpose, ttl), name="gpulock-resident")

    # ---- background ---------------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(self.reaper_interval)
            n += 1
            try:
                await self._tick(full=(n % 10 == 0))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._tick_log.failed(e, exc_info=True)
            else:
                self._tick_log.ok()

    async def _tick(self, full: bool = True) -> None:
        """Read the pool's status (which reaps expired leases and wakes the waiters that now
        fit: the background reaper), update the grant rate, refresh our claims."""
        assert self.pool is not None
        now = time.monotonic()
        try:  # a full tick lists the leases too, for the resident total
            st = await self.pool.status(limit=100_000 if full else 0)
        except PoolNotFound as e:
            self.status, self.redis_error = None, str(e)
            if self.capacity is not None:
                with contextlib.suppress(GpuLockError):
                    await self.pool.configure(self.capacity, create_only=True)
            self._publish_ready()
            return
        except GpuLockError as e:
            self.redis_error = str(e)
            self._publish_ready()
            return
        self.redis_error = None
        self.status, self.status_at = st, now
        if full:
            self._resident_bytes = _resident_held(st)
        self._pool_rate.sample(now, st.grants, busy=st.waiter_count > 0)
        self._local_rate.sample(now, self._local_grants, busy=bool(self._slots.waiters))
        jobs = [(t, j) for t, j in self._jobs.items() if j.phase != "done"]
        if jobs:
            tickets = [t for t, _ in jobs]
            try:
                assert self.redis is not None  # made with the pool, in start()
                pipe = self.redis.pipeline(transaction=False)
                for (
                    t,
                    j,
                ) in jobs:  # a thread-slot place moves as the waiters ahead leave: rewrite it
                    if j.phase == "slot":
                        pipe.set(
                            self._key(f"req:{t}"), self._claim_value(j), xx=True, px=_CLAIM_TTL_MS
                        )
                    else:
                        pipe.pexpire(self._key(f"req:{t}"), _CLAIM_TTL_MS)
                await pipe.execute()
            except Exception as e:  # noqa: BLE001 - the claims expire in 10 s; say why they were not kept
                self._claims_log.failed(RuntimeError(f"{len(tickets)} claim(s) not refreshed: {e}"))
            else:
                self._claims_log.ok()
        if full:
            with contextlib.suppress(Exception):
                await self.refresh_estimates()
            d = _multiproc_dir()
            if d:
                _sweep_dead_processes(d)
        self._publish_ready()

    def _release_done(self, route: str, rel: asyncio.Future) -> None:
        """Report how a job's release ended when it did not succeed: a lease lost meanwhile
        (counted), or a real failure (Redis unreachable: the lease expires after its ttl)."""
        if rel.cancelled():
            log.warning("gpulock: release cancelled; the lease expires after its ttl")
            return
        e = rel.exception()
        if e is None:
            return
        if isinstance(e, LeaseLost):
            metrics().lost.labels(route).inc()
            return
        log.warning(
            "gpulock: release failed (%s%s); the lease expires after its ttl",
            type(e).__name__,
            f": {e}" if str(e) else "",
        )

    # ---- Retry-After ------------------------------------------------------------------------
    def grant_rate(self) -> float | None:
        """Grants per second of the pool while busy (see :class:`BusyRate`), or the
        Little's-law fallback ``leases / mean_hold``; None when nothing was measured yet."""
        rate = self._pool_rate.rate
        if rate is not None and rate > 0.01:
            return rate
        st = self.status
        if self._hold_ewma and st is not None and st.lease_count > 0:
            return max(1, st.lease_count - len(self.resident_leases)) / self._hold_ewma
        return None

    def grace_left(self) -> float:
        """Seconds left in the pool's grace period after Redis lost it (nothing is granted
        before it ends), from the last status read; 0 outside one."""
        st = self.status
        if st is None or st.grace_left <= 0:
            return 0.0
        return max(0.0, st.grace_left - (time.monotonic() - self.status_at))

    def retry_after(
        self,
        position: int,
        server_hint: float | None = None,
        *,
        local: int = 0,
        parked: bool = False,
    ) -> int:
        """Seconds a client should wait before retrying a request at ``position`` (1-based)
        in the pool's queue: ``ceil(position / grant_rate)``, clamped to [1, max_retry_after].
        A request still waiting for one of this worker's threads adds ``local /
        local_grant_rate`` (its place among this worker's waiters over this worker's own busy
        grant rate). Without a rate yet: one second per place, or ``server_hint`` (the core's
        time to the nearest lease expiry) when shorter. ``parked``: the request keeps its place
        for ``park_timeout`` seconds, so the answer is at most ``park_timeout / 2``. In a grace
        period after Redis lost the pool (nothing is granted before it ends) the answer is at
        least the time left in it, also for a parked request (whose place lasts past the
        grace); always at most ``max_retry_after``."""
        p = max(0, int(position))
        rate = self.grant_rate()
        if rate:
            secs = p / rate
            if local:
                lrate = self._local_rate.rate
                secs += local / (lrate if lrate and lrate > 0.01 else rate)
        else:
            secs = float(max(1, p + local)) * _UNMEASURED_SECONDS_PER_PLACE
            if server_hint is not None and server_hint > 0:
                secs = min(secs, server_hint)
        grace = self.grace_left()
        secs = max(secs, grace)
        cap = self.max_retry_after
        if parked and self.park_timeout > 0:
            cap = min(cap, max(self.park_timeout / 2, grace))
        return int(max(1.0, min(cap, math.ceil(secs))))

    def _retry_after_for(self, job: _Job, position: int, pool_queue: int | None) -> int:
        """Retry-After for a job whose wait ran out. A parked job keeps its place: the time for
        its own ``position`` to come up. Any other job leaves the queue, and its retry joins at
        the back, behind everything queued now (in the pool, and for this worker's threads):
        the time for that whole queue to drain. (Quoting its old place told a burst of
        requests that each timed out at the head "retry in 1 s", inviting a retry storm.)"""
        parked = job.ticket is not None and self.park_timeout > 0
        if parked:
            local = max(1, self._slots.position(job.slot_future)) if job.phase == "slot" else 0
            return self._retry_after_parked(position, local, job.server_retry_after)
        if pool_queue is None:
            pool_queue = self.status.waiter_count if self.status is not None else 0
        if job.phase != "slot":
            pool_queue = max(pool_queue, position)
        return self.retry_after(pool_queue, job.server_retry_after, local=len(self._slots.waiters))

    def _retry_after_parked(
        self, position: int, local: int, server_hint: float | None = None
    ) -> int:
        """Retry-After for a request that keeps its place (X-Request-ID), on whichever worker
        answers: ``position`` counts the pool's queue and, while the request still waits for
        one of its owner's threads, its ``local`` place among that worker's waiters."""
        if local:
            return self.retry_after(max(0, position - local), server_hint, local=local, parked=True)
        return self.retry_after(position, server_hint, parked=True)

    def _job_position(self, job: _Job, queued: int | None = None) -> int:
        """The job's place: in the pool's queue when it is there, else (still waiting for a
        local thread) the pool's queue length plus its place among the local waiters."""
        if job.phase == "queued" and job.position:
            return job.position
        if queued is None:
            queued = self.status.waiter_count if self.status is not None else 0
        return queued + max(1, self._slots.position(job.slot_future))

    async def _position_now(self, job: _Job) -> tuple[int, int | None]:
        """``(the job's place now, the pool queue's length now or None)``: one ZCARD, not the
        last reaper tick's length (the Retry-After of a request that leaves the queue needs it)."""
        try:
            assert self.redis is not None  # set by start()
            queued = int(
                await asyncio.wait_for(self.redis.zcard(pool_keys(self.pool_name).queue), 0.5)
            )
        except Exception:
            queued = None
        if job.phase == "queued" and job.position:
            return job.position, queued
        return self._job_position(job, queued), queued

    # ---- history (tests) ----------------------------------------------------------------------
    def _record(self, event: str, lease: AsyncLease | None, **kw: Any) -> None:
        if self._history is None:
            return
        rec = {"e": event, "pid": os.getpid(), "t": time.time(), **kw}
        if lease is not None:
            rec.update(
                lease_id=lease.id,
                amount=lease.amount,
                token=lease.token,
                server_grant_ms=int(round(lease.expires_at * 1000 - lease.ttl * 1000)),
            )
        try:
            self._history.write(json.dumps(rec, separators=(",", ":")) + "\n")
        except Exception:
            pass

    # ---- estimates ----------------------------------------------------------------------------
    async def refresh_estimates(self) -> dict[str, int]:
        """Reload the calibrated per-shape estimates from Redis into this worker's cache."""
        assert self.redis is not None, "GpuLimiter.start() was not called"
        raw = await self.redis.hgetall(self.estimates_key)
        self._estimates = {
            (k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()
        }
        return self._estimates

    def estimate(
        self, route: str, batch: int, tokens: int, formula: Callable[[int, int], int]
    ) -> int:
        """Bytes for a request of ``batch`` × ``tokens`` on ``route``: the calibrated peak of
        its shape bucket (next power of two of each) when one was measured, else
        ``formula(batch, tokens)``."""
        b, s = next_bucket(batch), next_bucket(tokens, minimum=8)
        v = self._estimates.get(f"{route}|b{b}|s{s}")
        if v is not None:
            return max(1, v)
        return int(formula(batch, tokens))

    async def calibrate(
        self,
        route: str,
        run_shape: Callable[[int, int], Any],
        shapes: list[tuple[int, int]],
        device: str,
        formula: Callable[[int, int], int],
        *,
        margin: float = 1.1,
    ) -> dict[str, int]:
        """Measure the peak CUDA memory of ``run_shape(batch, tokens)`` for each shape (under a
        lease of the formula's estimate × 2, so nothing runs unleased) with
        ``torch.cuda.max_memory_allocated``, and store ``ceil(peak × margin)`` per shape bucket
        in the pool's estimates hash, where every worker's :meth:`estimate` finds it.

        Raises: RuntimeError on a CPU device."""
        from .cuda import measure_peak

        if not device.startswith("cuda"):
            raise RuntimeError("calibration measures CUDA peaks; the device is " + device)
        assert self.pool is not None and self.executor is not None and self.redis is not None
        out: dict[str, int] = {}
        for batch, tokens in shapes:
            b, s = next_bucket(batch), next_bucket(tokens, minimum=8)
            amount = min(
                2 * int(formula(b, s)),
                self.status.capacity if self.status else 2 * int(formula(b, s)),
            )
            async with self.pool.lease(
                amount, timeout=self.acquire_timeout * 6, holder={"purpose": "calibration"}
            ) as lease:
                lease.ensure_valid()
                peak = await asyncio.get_running_loop().run_in_executor(
                    self.executor, measure_peak, functools.partial(run_shape, b, s), device
                )
            out[f"{route}|b{b}|s{s}"] = max(1, math.ceil(peak * margin))
        if out:
            # redis-py types the mapping's keys as a union, and a Mapping's key type is invariant,
            # so it refuses a dict[str, int] that it takes at run time.
            await self.redis.hset(self.estimates_key, mapping=out)  # type: ignore[arg-type]
            self._estimates.update(out)
        return out

    # ---- the guarded call ---------------------------------------------------------------------
    def guard(
        self, route: str, *, estimate: Callable[..., int] | None = None
    ) -> Callable[..., GpuCall]:
        """A FastAPI dependency: ``call: GpuCall = Depends(limiter.guard("embed", estimate=f))``
        then ``result = await call(fn, *args)``: ``f(*args, **kwargs)`` gives the bytes (or
        pass ``amount=`` to ``call``), ``fn(*args, **kwargs)`` runs in the executor under the
        lease."""

        def dependency(request: Request, response: Response) -> GpuCall:
            return GpuCall(self, route, estimate, request, response)

        return dependency

    def endpoint(
        self, route: str, *, estimate: Callable[..., int]
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorate a plain ``def`` route handler: FastAPI sees an ``async def`` with the same
        parameters; the handler's body runs in the bounded executor under a lease of
        ``estimate(**params)`` bytes (``estimate`` receives the handler's parameters by name,
        only those it declares). Put it *below* ``@app.post(...)``."""

        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if inspect.iscoroutinefunction(fn):
                raise TypeError(
                    "gpulock endpoint() wraps a plain def handler (its body runs in a thread); "
                    "in an async handler use Depends(limiter.guard(...)) and await call(fn, ...)"
                )
            sig = inspect.signature(fn)
            try:
                hints = typing.get_type_hints(fn, include_extras=True)
            except Exception:
                hints = {}
            params = [
                p.replace(annotation=hints.get(p.name, p.annotation))
                for p in sig.parameters.values()
            ]
            names = {p.name for p in params}
            req_name = next((p.name for p in params if p.annotation is Request), None)
            resp_name = next((p.name for p in params if p.annotation is Response), None)
            extra = []
            if req_name is None:
                req_name = "_gpulock_request"
                extra.append(
                    inspect.Parameter(req_name, inspect.Parameter.KEYWORD_ONLY, annotation=Request)
                )
            if resp_name is None:
                resp_name = "_gpulock_response"
                extra.append(
                    inspect.Parameter(
                        resp_name, inspect.Parameter.KEYWORD_ONLY, annotation=Response
                    )
                )
            est_params = inspect.signature(estimate).parameters
            takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in est_params.values())

            @functools.wraps(fn)
            async def wrapper(**kw: Any) -> Any:
                request: Request = kw[req_name]
                response: Response = kw[resp_name]
                user_kw = {k: v for k, v in kw.items() if k in names}
                try:
                    self.check_accepting()
                except GpuLockHTTPException as e:
                    metrics().requests.labels(route, str(e.status_code)).inc()
                    raise
                est_kw = (
                    user_kw if takes_all else {k: v for k, v in user_kw.items() if k in est_params}
                )
                amount = estimate(**est_kw)
                return await self.call(
                    functools.partial(fn, **user_kw),
                    route=route,
                    amount=amount,
                    request=request,
                    response=response,
                    fingerprint_of=lambda: _fingerprint(route, user_kw),
                )

            ret = hints.get("return", sig.return_annotation)
            # Functions take any attribute, and inspect.signature (so FastAPI) reads this one;
            # typeshed's functools._Wrapped does not declare it.
            wrapper.__signature__ = sig.replace(  # type: ignore[attr-defined]
                parameters=_order_params(params + extra), return_annotation=ret
            )
            wrapper.__annotations__ = {
                **{p.name: p.annotation for p in params + extra},
                "return": ret,
            }
            return wrapper

        return deco

    async def call(
        self,
        fn: Callable[[], Any],
        *,
        route: str,
        amount: int | str,
        request: Request | None = None,
        response: Response | None = None,
        request_id: str | None = None,
        fingerprint_of: Callable[[], str] | None = None,
    ) -> Any:
        """Run ``fn()`` in the executor under a lease of ``amount`` bytes; see the module
        docstring for the sequence and the errors (raised as :class:`GpuLockHTTPException`).
        ``request_id`` defaults to the request's ``X-Request-ID`` header."""
        m = metrics()
        if request_id is None and request is not None:
            request_id = request.headers.get(self.request_id_header)
        if response is not None and request_id:
            response.headers[self.request_id_header] = request_id
        gone: asyncio.Task | None = None
        try:
            self.check_accepting()
            amount = parse_size(amount, name="estimate")
            m.estimate.labels(route).observe(amount)
            arrival = time.monotonic()
            if not self.enabled:
                result = await self._call_unguarded(fn, route, arrival)
            else:
                await self._check_room(amount)
                # Uvicorn does not cancel a handler whose client went away: watch for it, so a
                # request nobody waits for leaves the queue at once and is never granted.
                gone = watch_disconnect(request) if request is not None else None
                if request_id:
                    result = await self._call_idempotent(
                        fn,
                        route,
                        amount,
                        request_id,
                        arrival,
                        fingerprint_of() if fingerprint_of else "",
                        response,
                        gone,
                    )
                else:
                    job = self._start_job(fn, route, amount, None, "", arrival, park=0.0)
                    result = await self._await_job(job, arrival, response, gone)
        except GpuLockHTTPException as e:
            m.requests.labels(route, str(e.status_code)).inc()
            if request_id:
                e.headers = {**(e.headers or {}), self.request_id_header: request_id}
            raise
        except asyncio.CancelledError:
            m.requests.labels(route, "499").inc()
            raise
        except BaseException:
            m.requests.labels(route, "500").inc()
            raise
        finally:
            if gone is not None:
                gone.cancel()
        m.requests.labels(route, "200").inc()
        if isinstance(result, Response) and response is not None:
            for (
                k,
                v,
            ) in (
                response.headers.items()
            ):  # FastAPI ignores the sub-response when a Response is returned
                if k.lower() not in ("content-length", "content-type"):
                    result.headers[k] = v
        return result

    def check_accepting(self) -> None:
        """Raise 503 (not ready) unless this worker takes guarded calls now."""
        ok, why = self._accepting()
        if not ok:
            raise GpuLockHTTPException(
                503, f"worker not ready: {why}", "not_ready", {"Retry-After": "1"}
            )

    async def _call_unguarded(self, fn: Callable[[], Any], route: str, arrival: float) -> Any:
        assert self.executor is not None
        fut = asyncio.get_running_loop().run_in_executor(self.executor, fn)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.inference_timeout)
        except asyncio.TimeoutError:
            raise GpuLockHTTPException(
                504, f"inference ran past {self.inference_timeout}s", "inference_timeout"
            ) from None

    # ---- idempotent requests (X-Request-ID) -----------------------------------------------------
    async def _call_idempotent(
        self, fn, route, amount, request_id, arrival, fp, response, gone=None
    ) -> Any:
        ticket = request_ticket(route, request_id)
        m = metrics()
        while True:
            local = self._jobs.get(ticket)
            if local is not None and local.phase != "done":
                if local.fingerprint != fp:
                    raise self._conflict(request_id)
                m.replays.labels(route, "joined").inc()
                return await self._await_job(local, arrival, response, gone)
            stored = await self._get_result(ticket, fp, request_id)
            if stored is not _MISSING:
                m.replays.labels(route, "stored").inc()
                if response is not None:
                    response.headers["X-Idempotent-Replay"] = "true"
                return stored
            assert self.redis is not None  # set by start()
            claimed = await self.redis.set(
                self._key(f"req:{ticket}"), f"{self._owner}|{fp}|slot|0", nx=True, px=_CLAIM_TTL_MS
            )
            if claimed:
                stored = await self._get_result(
                    ticket, fp, request_id
                )  # stored just before we claimed?
                if stored is not _MISSING:
                    await self.redis.eval(_UNLOCK, 1, self._key(f"req:{ticket}"), f"{self._owner}|")
                    m.replays.labels(route, "stored").inc()
                    return stored
                job = self._start_job(
                    fn, route, amount, ticket, fp, arrival, park=self.park_timeout
                )
                return await self._await_job(job, arrival, response, gone)
            outcome = await self._follow(ticket, fp, request_id, route, arrival, response, gone)
            if outcome is not _MISSING:
                m.replays.labels(route, "joined").inc()
                return outcome
            # The owner finished without a result (an error) or died: take over.

    async def _get_result(self, ticket: str, fp: str, request_id: str) -> Any:
        assert self.redis is not None  # set by start()
        raw = await self.redis.get(self._key(f"res:{ticket}"))
        if raw is None:
            return _MISSING
        return self._decode_result(raw, fp, request_id)

    def _decode_result(self, raw: bytes | str, fp: str, request_id: str) -> Any:
        rec = json.loads(raw)
        if rec.get("fp", "") != fp:
            raise self._conflict(request_id)
        if "response" in rec:
            r = rec["response"]
            return Response(
                base64.b64decode(r["body"]), status_code=r["status"], media_type=r["media_type"]
            )
        return rec["result"]

    def _conflict(self, request_id: str) -> GpuLockHTTPException:
        return GpuLockHTTPException(
            409,
            f"{self.request_id_header} {request_id!r} was already used for a "
            f"different request; use a new id for new work",
            "conflict",
        )

    async def _follow(self, ticket, fp, request_id, route, arrival, response, gone=None) -> Any:
        """Another worker owns this request id: wait for its result, reporting its place."""
        acq_deadline = arrival + self.acquire_timeout
        end = acq_deadline + self.inference_timeout
        delay = 0.02
        claim_key, res_key, queue_key = (
            self._key(f"req:{ticket}"),
            self._key(f"res:{ticket}"),
            pool_keys(self.pool_name).queue,
        )
        while True:
            assert self.redis is not None  # set by start()
            pipe = self.redis.pipeline(transaction=False)
            pipe.get(res_key)
            pipe.get(claim_key)
            pipe.zrank(queue_key, ticket)
            pipe.zcard(queue_key)
            raw, claim, rank, queued = await pipe.execute()
            if raw is not None:
                return self._decode_result(raw, fp, request_id)
            if claim is None:
                return _MISSING
            claim = claim.decode() if isinstance(claim, bytes) else claim
            _, cfp, phase, pos = (claim.rsplit("|", 3) + ["", "", "0"])[:4]
            if cfp != fp:
                raise self._conflict(request_id)
            now = time.monotonic()
            # The place as its owner counts it (_job_position): the rank in the pool's queue,
            # or, while it waits for one of the owner's threads, the pool's queue length now
            # plus its place among the owner's waiters (published in the claim).
            local = int(pos) if phase == "slot" and pos.isdigit() else 0
            if rank is not None:
                position, local = rank + 1, 0
            elif local:
                position = int(queued) + local
            else:
                position = int(pos) if phase == "queued" and pos.isdigit() else 0
            if now >= acq_deadline and phase in ("slot", "queued"):
                metrics().timeouts.labels(route).inc()
                p = position or int(queued) + 1
                ra = (
                    self._retry_after_parked(p, local)
                    if self.park_timeout > 0
                    else self.retry_after(p)
                )
                headers = {"Retry-After": str(ra)}
                if position:
                    headers["X-Queue-Position"] = str(position)
                raise GpuLockHTTPException(
                    503,
                    f"request {request_id!r} is still queued (position {position or 'unknown'}); "
                    f"it keeps its place: retry with the same {self.request_id_header}",
                    "queue_timeout",
                    headers,
                )
            if now >= end:
                metrics().inference_timeouts.labels(route).inc()
                raise GpuLockHTTPException(
                    504,
                    f"request {request_id!r} is still running; retry with the same "
                    f"{self.request_id_header} to collect its result",
                    "inference_timeout",
                )
            if gone is None:
                await asyncio.sleep(delay)
            else:
                await asyncio.wait((gone,), timeout=delay)
                if _is_gone(gone):  # this retry's client left; the owner's request goes on
                    raise self._client_gone(
                        route, "waiting" if phase in ("slot", "queued") else "running"
                    )
            delay = min(delay * 1.5, 0.2)

    def _claim_value(self, job: _Job) -> str:
        """``owner|fingerprint|phase|place``: what another worker's retry reads to follow the
        request. The place is the rank in the pool's queue once queued, and while the job
        waits for one of this worker's threads its place among them (the follower adds the
        pool's queue length, as :meth:`_job_position` does)."""
        pos = self._slots.position(job.slot_future) if job.phase == "slot" else job.position
        return f"{self._owner}|{job.fingerprint}|{job.phase}|{pos}"

    async def _set_phase(self, job: _Job, phase: str) -> None:
        job.phase = phase
        if job.ticket is None:
            return
        with contextlib.suppress(Exception):
            assert self.redis is not None  # set by start()
            await self.redis.set(
                self._key(f"req:{job.ticket}"), self._claim_value(job), xx=True, px=_CLAIM_TTL_MS
            )

    async def _publish_slot_place(self, job: _Job) -> None:
        if job.phase == "slot" and job.ticket is not None:  # not yet moved on
            await self._set_phase(job, "slot")

    # ---- jobs -------------------------------------------------------------------------------------
    def _start_job(self, fn, route, amount, ticket, fp, arrival, *, park: float) -> _Job:
        job = _Job(route, amount, ticket, fp, arrival)
        job.outcome = asyncio.get_running_loop().create_future()
        job.outcome.add_done_callback(_consume)
        job.outcome.add_done_callback(lambda _: job.started.set())
        if ticket is not None:
            self._jobs[ticket] = job
        self._all_jobs.add(job)
        # Without parking the job's own deadline is a little later than the HTTP answer's, so
        # the 503 is decided in one place (_await_job) and the job is then cancelled.
        # A parked job in a grace period (nothing is granted before it ends) keeps its place
        # until the grace ends and park_timeout after, so the retry sent after Retry-After (at
        # least the grace left) finds it.
        if park:
            park += self.grace_left()
        timeout_s = self.acquire_timeout + (park or 0.5)
        job.place_until = arrival + timeout_s
        job.task = asyncio.get_running_loop().create_task(
            self._run_job(job, fn, timeout_s), name=f"gpulock-job-{route}"
        )
        job.task.add_done_callback(_consume)  # its outcome is read from job.outcome
        return job

    async def _run_job(self, job: _Job, fn: Callable[[], Any], timeout_s: float) -> Any:
        try:
            return await self._run_job_inner(job, fn, timeout_s)
        finally:
            job.started.set()

    async def _run_job_inner(self, job: _Job, fn: Callable[[], Any], timeout_s: float) -> Any:
        m = metrics()
        assert self.pool is not None and self.executor is not None
        deadline = job.arrival + timeout_s
        have_slot = False
        lease: AsyncLease | None = None
        granted_at = 0.0
        try:

            def waiting(fut: asyncio.Future) -> None:
                job.slot_future = fut
                if job.ticket is not None:  # its place among this worker's waiters, for followers
                    self.spawn(self._publish_slot_place(job), name="gpulock-claim")

            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AcquireTimeout("no thread slot in time", position=0)
            try:
                await asyncio.wait_for(self._slots.acquire(waiting), remaining)
            except asyncio.TimeoutError:
                raise AcquireTimeout(
                    f"no free thread in this worker within {timeout_s}s", position=0
                ) from None
            have_slot = True
            job.slot_future = None
            if job.abandoned:  # a cancellation that raced the slot hand-off (3.11 wait_for)
                raise asyncio.CancelledError()
            await self._set_phase(job, "queued")

            def on_queued(pos: int) -> None:
                job.position = pos

            remaining = max(0.001, deadline - time.monotonic())
            ttl_s = self.lease_ttl
            try:
                try:
                    lease = await self.pool.acquire(
                        job.amount,
                        ttl=ttl_s,
                        timeout=remaining,
                        request_id=job.ticket,
                        holder={"route": job.route},
                        on_queued=on_queued,
                    )
                except InvalidArgument:
                    # max_ttl lowered since our last status read: read it now, retry once if it clamps
                    await self._tick(full=False)
                    if self.lease_ttl >= ttl_s:
                        raise
                    remaining = max(0.001, deadline - time.monotonic())
                    lease = await self.pool.acquire(
                        job.amount,
                        ttl=self.lease_ttl,
                        timeout=remaining,
                        request_id=job.ticket,
                        holder={"route": job.route},
                        on_queued=on_queued,
                    )
            except AcquireTimeout as e:
                job.server_retry_after = e.retry_after
                raise
            granted_at = time.monotonic()
            self._record("grant", lease, route=job.route)
            if job.abandoned:
                # The answer (503) went out while the grant was on its way: Python 3.11's
                # wait_for can return a result that raced a cancellation. Run nothing.
                raise asyncio.CancelledError()
            job.wait_s = granted_at - job.arrival
            m.acquire_wait.labels(job.route).observe(job.wait_s)
            m.grants.labels(job.route).inc()
            self._local_grants += 1
            await self._set_phase(job, "running")
            job.started.set()
            cf = self.executor.submit(self._in_thread, lease, fn, job)
            afut = asyncio.wrap_future(cf)
            cancelled = False
            while True:  # the lease is released only after the thread returned (c05)
                try:
                    result = await asyncio.shield(afut)
                    break
                except asyncio.CancelledError:
                    if afut.done():
                        raise
                    cancelled = True  # keep waiting for the thread; re-raise afterwards
            if cancelled:
                raise asyncio.CancelledError()
            if job.ticket is not None:
                await self._store_result(job, result)
            _settle(job.outcome, result=result)
            return result
        except _CudaOOM as e:
            m.oom.labels(job.route).inc()
            _settle(job.outcome, exc=e)
            raise
        except _CudaFatal as e:
            m.fatal.labels(job.route).inc()
            self._fatal(str(e))
            _settle(job.outcome, exc=e)
            raise
        except LeaseLost as e:
            m.lost.labels(job.route).inc()
            _settle(job.outcome, exc=e)
            raise
        except BaseException as e:
            _settle(job.outcome, exc=e)
            raise
        finally:
            if lease is not None:
                self._record("release", lease, route=job.route)
                # A task of its own: it goes on when this one is cancelled meanwhile (a 503, a
                # client gone, a shutdown), which is not a failed release; its outcome is
                # reported once it is known.
                rel = asyncio.ensure_future(lease.release())
                try:
                    await asyncio.shield(rel)
                except asyncio.CancelledError:
                    rel.add_done_callback(functools.partial(self._release_done, job.route))
                except Exception:  # noqa: BLE001 - reported by _release_done
                    self._release_done(job.route, rel)
                if job.wait_s is not None:
                    hold = time.monotonic() - granted_at
                    m.hold.labels(job.route).observe(hold)
                    self._hold_ewma = (
                        hold if self._hold_ewma is None else 0.8 * self._hold_ewma + 0.2 * hold
                    )
            if have_slot:
                self._slots.release()
            job.phase = "done"
            job.started.set()
            self._all_jobs.discard(job)
            if job.ticket is not None:
                if self._jobs.get(job.ticket) is job:
                    del self._jobs[job.ticket]
                try:
                    assert self.redis is not None  # set by start()
                    await asyncio.shield(
                        self.redis.eval(
                            _UNLOCK, 1, self._key(f"req:{job.ticket}"), f"{self._owner}|"
                        )
                    )
                except Exception as e:  # noqa: BLE001 - the claim expires in 10 s; until then retries follow it
                    log.warning(
                        "gpulock: could not drop the claim of request %s: %s", job.ticket, e
                    )
                except BaseException:  # cancelled: the claim expires on its own
                    pass

    def _in_thread(self, lease: AsyncLease, fn: Callable[[], Any], job: _Job) -> Any:
        tok = _current_lease.set(lease)
        try:
            lease.ensure_valid()  # the last check before the CUDA call (invariant 5 in docs/SEMANTICS.md)
            t0 = time.monotonic()
            self._record(
                "cuda_start", None, lease_id=lease.id, amount=lease.amount, route=job.route
            )
            try:
                return fn()
            except BaseException as e:
                if is_oom(e):
                    msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
                    drop_traceback(e)
                    del e
                    empty_cache()
                    raise _CudaOOM(msg) from None
                if is_fatal_cuda_error(e):
                    msg = str(e).splitlines()[0][:300]
                    drop_traceback(e)
                    raise _CudaFatal(msg) from None
                raise
            finally:
                job.run_s = time.monotonic() - t0
                metrics().run.labels(job.route).observe(job.run_s)
                self._record(
                    "cuda_end", None, lease_id=lease.id, amount=lease.amount, route=job.route
                )
        finally:
            _current_lease.reset(tok)

    async def _store_result(self, job: _Job, result: Any) -> None:
        try:
            from fastapi.encoders import jsonable_encoder

            if isinstance(result, Response):
                body = bytes(result.body)
                rec = {
                    "fp": job.fingerprint,
                    "response": {
                        "status": result.status_code,
                        "media_type": result.media_type,
                        "body": base64.b64encode(body).decode(),
                    },
                }
            else:
                rec = {"fp": job.fingerprint, "result": jsonable_encoder(result)}
            raw = json.dumps(rec, separators=(",", ":"))
        except Exception as e:
            log.debug("gpulock: result of %s not stored for replay (%s)", job.route, e)
            return
        with contextlib.suppress(Exception):
            assert self.redis is not None  # set by start()
            await self.redis.set(
                self._key(f"res:{job.ticket}"), raw, px=max(1, int(self.result_ttl * 1000))
            )

    def _fatal(self, message: str) -> None:
        """A sticky CUDA error: not ready from now on; exit so the process manager restarts
        us (after the 500 has been sent: uvicorn's graceful shutdown finishes it)."""
        if self.fatal_error is None:
            self.fatal_error = message
            log.error("gpulock: CUDA error, this worker is exiting: %s", message)
        self._publish_ready()
        if self.exit_on_fatal:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)

    async def _await_job(
        self, job: _Job, arrival: float, response: Response | None, gone: asyncio.Task | None = None
    ) -> Any:
        """Wait for a job with this request's deadlines: 503 if it has not started running by
        ``arrival + acquire_timeout``, 504 if it has not finished ``inference_timeout`` later.
        The job goes on after either answer (parked, or until its thread returns). ``gone``
        (see :func:`watch_disconnect`) ends when the client hung up: 499, and a job nobody
        else waits for leaves the queue at once (it is never granted); running work goes on
        until its thread returns, its result dropped."""
        job.attached += 1
        try:
            return await self._await_job_attached(job, arrival, response, gone)
        finally:
            job.attached -= 1

    def _client_gone(self, route: str, phase: str) -> GpuLockHTTPException:
        metrics().disconnected.labels(route, phase).inc()
        what = (
            "it left the queue and will not run"
            if phase == "waiting"
            else "its work goes on until it returns (the lease is held until then); the result is dropped"
        )
        return GpuLockHTTPException(
            499, f"the client closed the connection: {what}", "client_disconnected"
        )

    async def _await_job_attached(
        self, job: _Job, arrival: float, response: Response | None, gone: asyncio.Task | None
    ) -> Any:
        m = metrics()
        remaining = arrival + self.acquire_timeout - time.monotonic()
        try:
            if not job.started.is_set():
                await _wait_or_gone(job.started.wait(), max(0.0, remaining), gone)
        except _Gone:
            if job.attached == 1 and job.phase in ("slot", "queued") and job.task is not None:
                job.abandoned = True  # before any await: a grant arriving now must not run
                job.task.cancel()  # leaves the thread-slot wait or the pool's queue now
            raise self._client_gone(
                job.route, "waiting" if not job.started.is_set() else "running"
            ) from None
        except asyncio.TimeoutError:
            timed_out = not job.started.is_set()  # granted just as the deadline passed: go on
        except asyncio.CancelledError:
            if job.ticket is None and job.phase in ("slot", "queued") and job.task is not None:
                job.abandoned = True
                job.task.cancel()  # the client went away before a grant: leave the queue
            raise
        else:
            timed_out = False
        if timed_out:
            parked = job.ticket is not None and self.park_timeout > 0
            if not parked:
                job.abandoned = True  # before any await: a grant arriving now must not run
            position, queued = await self._position_now(job)
            ra = self._retry_after_for(job, position, queued)
            m.timeouts.labels(job.route).inc()
            if not parked and job.task is not None:
                job.task.cancel()  # leaves the queue now (the core cancels the ticket)
            keep = (
                (
                    " It keeps its place for up to %.0fs: retry after Retry-After with the same %s."
                    % (max(0.0, job.place_until - time.monotonic()), self.request_id_header)
                )
                if parked
                else ""
            )
            if (
                job.phase == "slot"
            ):  # never reached the pool's queue: this worker's threads were busy
                what = (
                    f"no free inference thread in this worker within {self.acquire_timeout}s "
                    f"(all {self.executor_threads} busy; queue position {position}, counting the "
                    f"pool's queue and this worker's own)"
                )
            else:
                what = (
                    f"no GPU memory for {format_size(job.amount)} within {self.acquire_timeout}s "
                    f"(queue position {position})"
                )
            raise GpuLockHTTPException(
                503,
                f"{what}.{keep}",
                "queue_timeout",
                {"Retry-After": str(ra), "X-Queue-Position": str(position)},
            )
        assert job.outcome is not None
        if not job.outcome.done():
            try:
                await _wait_or_gone(asyncio.shield(job.outcome), self.inference_timeout, gone)
            except _Gone:
                raise self._client_gone(job.route, "running") from None
            except asyncio.TimeoutError:
                m.inference_timeouts.labels(job.route).inc()
                extra = (
                    f" Retry with the same {self.request_id_header} to collect the result."
                    if job.ticket is not None
                    else ""
                )
                raise GpuLockHTTPException(
                    504,
                    f"inference ran past {self.inference_timeout}s; its GPU lease stays held until the "
                    f"work really finishes.{extra}",
                    "inference_timeout",
                ) from None
            except asyncio.CancelledError:
                raise
            except BaseException:
                pass  # mapped below
        if response is not None and job.wait_s is not None:
            response.headers["Server-Timing"] = (
                f"gpulock-wait;dur={job.wait_s * 1000:.3f}, "
                f"gpulock-run;dur={(job.run_s or 0) * 1000:.3f}"
            )
        return self._job_result(job)

    def _job_result(self, job: _Job) -> Any:
        out = job.outcome
        assert out is not None and out.done()
        if out.cancelled():
            raise GpuLockHTTPException(
                503,
                "the request was cancelled (worker shutting down)",
                "not_ready",
                {"Retry-After": "1"},
            )
        exc = out.exception()
        if exc is None:
            return out.result()
        m = metrics()
        if isinstance(exc, CapacityExceeded):
            raise GpuLockHTTPException(
                413,
                f"this request needs {format_size(exc.amount)} ({exc.amount} bytes) of GPU memory but pool "
                f"{self.pool_name!r} has a capacity of {format_size(exc.capacity)} ({exc.capacity} bytes); "
                f"send a smaller batch",
                "capacity",
            ) from None
        if isinstance(exc, QueueFull):
            m.queue_full.labels(job.route).inc()
            ra = self.retry_after(exc.queue_length + 1)
            raise GpuLockHTTPException(
                503,
                f"GPU queue is full ({exc.queue_length} waiting)",
                "queue_full",
                {"Retry-After": str(ra), "X-Queue-Position": str(exc.queue_length + 1)},
            ) from None
        if isinstance(exc, AcquireTimeout):
            m.timeouts.labels(job.route).inc()
            position = exc.position or self._job_position(job)
            ra = self.retry_after(position, exc.retry_after)
            raise GpuLockHTTPException(
                503,
                f"no GPU memory for {format_size(job.amount)} in time (queue position {position})",
                "queue_timeout",
                {"Retry-After": str(ra), "X-Queue-Position": str(position)},
            ) from None
        if isinstance(exc, LeaseLost):
            raise GpuLockHTTPException(
                503,
                f"the GPU lease was lost before the work ran ({exc.reason}); retry",
                "lease_lost",
                {"Retry-After": str(self.retry_after(1))},
            ) from None
        if isinstance(exc, _CudaOOM):
            ra = self.retry_after(self._job_position(job))
            raise GpuLockHTTPException(
                503,
                "the GPU ran out of memory for this request; retry later",
                "cuda_oom",
                {"Retry-After": str(ra)},
            ) from None
        if isinstance(exc, _CudaFatal):
            raise GpuLockHTTPException(
                500, f"CUDA error; this worker restarts: {exc}", "cuda_error"
            ) from None
        if isinstance(exc, (BackendUnavailable, PoolNotFound)):
            raise GpuLockHTTPException(
                503,
                f"GPU budget unavailable: {exc}",
                "backend",
                {"Retry-After": str(max(1, int(self.reaper_interval * 2)))},
            ) from None
        if isinstance(exc, InvalidArgument):  # never a bare 500: say what the pool refused
            raise GpuLockHTTPException(
                500, f"pool {self.pool_name!r} refused the lease request: {exc}", "invalid_argument"
            ) from None
        raise exc

    # ---- metrics endpoint --------------------------------------------------------------------
    async def metrics_response(self) -> Response:
        """The ``/metrics`` response: this process's (or, in multiprocess mode, all workers')
        counters and histograms, plus the pool's gauges read from Redis now."""
        from prometheus_client import (
            CONTENT_TYPE_LATEST,
            REGISTRY,
            CollectorRegistry,
            generate_latest,
        )

        st, err = None, None
        if self.pool is not None:
            try:
                st = await asyncio.wait_for(self.pool.status(limit=0), 2.0)
            except Exception as e:  # noqa: BLE001 — reported as gpulock_pool_up 0
                err = str(e)
        metrics()
        d = _multiproc_dir()
        if d:
            from prometheus_client import multiprocess

            _sweep_dead_processes(d)
            reg = CollectorRegistry(auto_describe=False)
            multiprocess.MultiProcessCollector(reg, d)
            body = generate_latest(reg)
        else:
            body = generate_latest(REGISTRY)
        extra = CollectorRegistry(auto_describe=False)
        extra.register(_StaticCollector(_pool_families(self.pool_name, st, err)))
        body += generate_latest(extra)
        return Response(body, media_type=CONTENT_TYPE_LATEST)


_MISSING = object()


def _settle(
    fut: asyncio.Future | None, *, result: Any = None, exc: BaseException | None = None
) -> None:
    if fut is None or fut.done():
        return
    if exc is None:
        fut.set_result(result)
    elif isinstance(exc, asyncio.CancelledError):
        fut.cancel()
    else:
        fut.set_exception(exc)


def _consume(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: no "exception was never retrieved" log for abandoned jobs


def _order_params(params: list[inspect.Parameter]) -> list[inspect.Parameter]:
    """Parameters in an order ``inspect.Signature`` accepts (positional ones first, keyword
    ones after); our handlers are called by keyword only."""
    return [
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        else p
        for p in params
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]


def _fingerprint(route: str, kwargs: dict[str, Any]) -> str:
    try:
        from fastapi.encoders import jsonable_encoder

        text = json.dumps(
            jsonable_encoder(kwargs), sort_keys=True, separators=(",", ":"), default=repr
        )
    except Exception:
        text = repr(sorted(kwargs.items()))
    return hashlib.sha256(f"{route}\n{text}".encode()).hexdigest()[:16]


class GpuCall:
    """What ``Depends(limiter.guard(route, estimate=...))`` gives a handler: call it with the
    function and its arguments; the result comes back after the thread returned."""

    def __init__(
        self,
        limiter: GpuLimiter,
        route: str,
        estimate: Callable[..., int] | None,
        request: Request,
        response: Response,
    ):
        self.limiter, self.route, self._estimate = limiter, route, estimate
        self.request, self.response = request, response

    async def __call__(
        self, fn: Callable[..., Any], *args: Any, amount: int | str | None = None, **kwargs: Any
    ) -> Any:
        if inspect.iscoroutinefunction(fn):
            raise TypeError("GpuCall runs a plain function in a thread; got a coroutine function")
        if amount is None:
            if self._estimate is None:
                raise TypeError("give amount= or an estimate to guard()")
            amount = self._estimate(*args, **kwargs)
        return await self.limiter.call(
            functools.partial(fn, *args, **kwargs),
            route=self.route,
            amount=amount,
            request=self.request,
            response=self.response,
            fingerprint_of=lambda: _fingerprint(self.route, {"args": args, **kwargs}),
        )


# ---------------------------------------------------------------------------------------------
