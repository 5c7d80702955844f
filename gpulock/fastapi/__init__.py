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

What one request goes through (``GpuLimiter.calls.call``)::

    arrival ── wait for a thread slot (local) ── acquire(amount) in the pool's queue
            ── granted ── ensure_valid() ── fn() in the executor thread ── thread returned
            ── release ── response

* The lease is taken before the function runs, so before any tensor of the request touches
  the GPU, and released only after the executor thread has returned, even when
  the HTTP side already answered 504.
* Both waits are ordered by priority (the route's ``priority=``, or a request's
  ``priority_header`` up to the route's ``max_priority``: :mod:`._priority`), then first come
  first served; a waiter gains one level per second waited.
* Waiting happens in the event loop, never in a thread: ``/health`` keeps answering while
  hundreds of requests queue. The executor has ``executor_threads`` threads and a
  request takes its thread slot *before* it leases, so no bytes sit leased while their request
  waits for a thread.
* Errors map to HTTP (see :class:`GpuLockHTTPException`): no grant within ``acquire_timeout``
  or a full queue → 503 with ``Retry-After`` and ``X-Queue-Position``; amount > capacity → 413
  naming both numbers, and so is an amount larger than the room the workers' resident leases
  leave (at once, decided by the pool's acquire: not after a wait at the head of the queue);
  the work ran past
  ``inference_timeout`` → 504 (the lease stays held until the thread returns); CUDA OOM → traceback dropped, ``empty_cache()``, counted, 503 with
  ``Retry-After``; another CUDA error (device-side assert, illegal address) → 500, the worker
  marks itself not ready and exits (SIGTERM to itself) so gunicorn starts a fresh one.
* ``X-Request-ID`` makes retries idempotent: the header value is hashed into the
  lease request id, one worker owns it at a time (a claim key in Redis), a retry that arrives
  while the first attempt is queued or running joins it (same place in the queue, one
  execution), and a result is kept ``result_ttl`` seconds for retries that come later. A 503
  to a request that carries ``X-Request-ID`` does not give up its place: the request stays
  queued and runs when granted, each 503 (on any worker) keeping the place
  ``max(park_timeout, 2 * Retry-After + 2)`` seconds more (``gpulock.http.places``, the rule the
  broker shares), so the retry sent after ``Retry-After`` collects the result. An id over
  128 bytes is refused (400 ``invalid_request_id``), never cut.
* A client that closes its connection while its request waits (uvicorn does not cancel the
  handler) is noticed at once (:func:`watch_disconnect`, the ASGI ``http.disconnect``): the
  request leaves the thread-slot wait or the pool's queue and is never granted; work already
  running finishes under its lease and its result is dropped. Both answer 499 (never sent) and
  are counted in ``gpulock_client_disconnected_total``.
* A route that streams (``endpoint(..., stream="sse")`` on a generator, or ``await
  call.stream(fn, ...)``) keeps its lease until its last chunk is sent: each chunk of a sync
  body is made in the executor after ``ensure_valid()``, a client that hangs up closes the
  generator after the chunk in progress, a lease lost mid-stream ends it with an error event
  (:mod:`._stream`).
* Preemption (a pool setting): a request whose priority is at least the pool's gap above a
  holder's asks it to yield. A request's lease is never asked unless its route opts in
  (``preemptible=True`` on ``endpoint``/``guard``/``batcher``: work that can stop early and
  still answer; it reads ``current_lease().yield_requested``, and a stream ends at its next
  chunk boundary with an error event ``preempted``); work no request waits on
  (``calls.call(fn, ...)`` without a request: a background job) may be asked by default.
  docs/SERVICE.md, "Preemption".
* Kept bytes (``keep=`` seconds, off by default; docs/SEMANTICS.md, "Kept bytes"): a worker
  keeps a released lease while nobody waits in the pool and grants its next request that asks
  for exactly the same (bytes, ttl, priority, tenant, preemptible) from it, with no Redis round
  trip for the acquire or the release. A request with ``X-Request-ID`` and a resident lease
  never use kept bytes. A request of anyone that does not fit makes the worker give them back.
* :func:`install_http_guards` gives any app the service's HTTP guards: 400 for a body that is
  not UTF-8, 422 that always renders, 413 over a size bound, 408 for a slow body.

``Retry-After`` (whole seconds, 1..``max_retry_after``) is computed from the request's wait
estimate, never a constant, and the 503 carries that estimate (``estimated_wait_s``, seconds,
in the body the error handlers of :func:`install_http_guards` answer)::

    estimated_wait_s = pool_wait + local_position / local_grant_rate
    retry_after = ceil(estimated_wait_s)

where ``pool_wait`` is the server's estimate (docs/SEMANTICS.md, "Wait estimate"; for a request
that leaves the queue, at the queue's tail), or, while the server has no measured drain rate,
``position / grant_rate``, where ``position`` is the request's place in the pool's FIFO queue and ``grant_rate`` the
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

Traces (OpenTelemetry, when the application set a tracer provider; nothing recorded
otherwise): the thread-slot wait is span ``gpulock.admission``, the work under the lease span
``gpulock.call`` (current in the work's thread: :func:`current_call_span`), a batch span
``gpulock.batch`` linked to its requests' spans; docs/TRACING.md.

Metrics (``/metrics``, Prometheus text; multiprocess mode when ``PROMETHEUS_MULTIPROC_DIR`` is
set, as under gunicorn): pool gauges are read from Redis at scrape time; counters and
histograms are per process and summed by prometheus-client's multiprocess collector. See
``docs/SERVICE.md`` for the list.

The parts, one concept a module: ``_limiter`` (:class:`GpuLimiter`, the facade that composes
the rest), ``_settings``, ``_backend`` (the pool's clients and last status), ``_reaper`` (the
background status reads), ``_admission`` (thread slots, the lease wait, the ttl bound), ``_priority`` (a route's
priority and a request's),
``_jobs`` (the job runner, :func:`current_lease`), ``_call`` (a request answered from its
job), ``_idempotency`` (X-Request-ID claims, stored results, following another worker's
request), ``_resident`` (resident leases), ``_readiness``, ``_retry_after`` (the service's
estimator over the policy in :mod:`gpulock.retry_after`), ``_errors`` (HTTP error mapping),
``_metrics``, ``_kept`` (the kept bytes' metrics), ``_calibration``, ``_backoff`` (the OOM back-off's shared state, over the
rule in :mod:`gpulock.oom_backoff`), ``_signature`` (``guard``/``endpoint``), ``_stream`` (streamed bodies under a lease), ``_device``
(device truth: the device sampler), ``_history``, ``_batcher`` (dynamic batching:
:meth:`GpuLimiter.batcher`), ``_tracing`` (the OpenTelemetry spans). The limiter exposes each part as an attribute
(``limiter.backend``, ``limiter.ready``, ...; :class:`GpuLimiter` lists them).
"""

from __future__ import annotations

from gpulock.http.disconnect import watch_disconnect
from gpulock.http.sse import SSE_DONE, error_body, sse_event
from gpulock.http.guards import (
    RequestLimits,
    install_error_handlers,
    install_http_guards,
    utf8_error,
)
from gpulock.retry_after import BusyRate
from ._batcher import Batcher, BatchPolicy
from ._calibration import next_bucket
from ._errors import GpuLockHTTPException
from ._idempotency import request_ticket
from ._jobs import current_call_span, current_lease
from ._limiter import GpuLimiter
from ._metrics import metrics
from ._signature import GpuCall
from ._stream import LeasedStream, StreamLease

__all__ = [
    "BatchPolicy",
    "Batcher",
    "BusyRate",
    "GpuCall",
    "GpuLimiter",
    "GpuLockHTTPException",
    "LeasedStream",
    "RequestLimits",
    "SSE_DONE",
    "StreamLease",
    "current_call_span",
    "current_lease",
    "error_body",
    "install_error_handlers",
    "install_http_guards",
    "metrics",
    "next_bucket",
    "request_ticket",
    "sse_event",
    "utf8_error",
    "watch_disconnect",
]
