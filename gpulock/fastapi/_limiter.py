"""``GpuLimiter``: the facade that composes the integration's parts (admission, jobs, the
idempotency store, resident leases, readiness, Retry-After, errors, metrics, calibration and
the route shapes), exposes them as its attributes, and runs their lifecycle and background
reaper."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from collections.abc import Sequence
from typing import Any, AsyncIterator, TypeVar

from fastapi import Response
from gpulock_common.aio import stop_tasks
from gpulock_common.options import DEFAULT_TTL_S

from gpulock.protocol.replies import PoolStatus
from . import _signature
from ._admission import Admission, Slots, TtlBound
from ._backend import Backend
from ._batcher import Batcher, BatchPolicy
from gpulock.oom_backoff import BackoffRule
from ._backoff import OomBackoff
from ._calibration import Estimates
from ._call import GuardedCalls
from ._device import DeviceTruth
from ._errors import HttpErrors
from ._history import History
from ._idempotency import RequestStore
from ._jobs import JobRunner
from ._kept import KeptMetrics
from ._metrics import metrics, metrics_response
from ._priority import RoutePriority
from ._readiness import Readiness
from ._reaper import Reaper
from ._resident import ResidentLeases
from ._retry_after import RetryAfterEstimator
from ._settings import Settings
from ._signature import GpuCall

R = TypeVar("R")

#: The documented back-off rule (docs/SEMANTICS.md, "Back-off on OOM").
DEFAULT_RULE = BackoffRule()


class GpuLimiter:
    """Leases GPU memory from a gpulock pool around the CUDA work of FastAPI routes.

    Create it at import time (it does no I/O then); ``lifespan`` (or ``start()``/``stop()``)
    connects to Redis, creates the executor and starts the background reaper in each worker,
    after fork.

    Args:
        redis_url: ``redis://``/``rediss://``/``unix://``/``redis+sentinel://``/``redis+cluster://`` URL of the Redis holding the pool.
        pool: pool name (one GPU).
        capacity: bytes or a size ("20GiB"); when given the pool is created with it if it does
            not exist (``configure="create"``, the default) or set to it (``configure="set"``).
        acquire_timeout: seconds a request may wait for a thread slot and a grant → else 503.
        inference_timeout: seconds the guarded work may run → else 504 (the lease is released
            only when the thread really returned).
        ttl: lease time to live in seconds (the heartbeat renews it at ttl/3); bounded by the
            pool's ``max_ttl`` as last read (:attr:`ttl_bound`, one warning when it clamps).
        executor_threads: threads running guarded work in this worker.
        park_timeout: the fewest seconds a request that carries ``X-Request-ID`` stays queued
            after each 503 (at least twice its Retry-After plus 2 s), so that its retry joins
            its place (0 disables).
        result_ttl: seconds a finished result stays in Redis for retries of the same request.
        max_retry_after: cap of the Retry-After header, seconds.
        reaper_interval: seconds between the background status reads (reap, wake waiters,
            queue rate for Retry-After, readiness).
        history_file: prefix of a per-process JSON-lines file of grant/release events, for
            tests (default: env ``GPULOCK_HISTORY_FILE``).
        enabled: False runs the work without leases (for measuring the lease's overhead).
        exit_on_fatal: after a sticky CUDA error, SIGTERM this process once the 500 is sent.
        request_id_header: the idempotency header.
        priority_header: a request header (e.g. ``"X-GpuLock-Priority"``) whose integer value
            replaces the route's priority, clamped to at most the route's ``max_priority``
            (:mod:`gpulock.fastapi._priority`); a malformed value answers 400. None (the
            default): headers are ignored, since any client could send one.
        tenant: the tenant every lease of this limiter counts under (1-64 of
            [A-Za-z0-9._:-]): the pool's quota for it, if any, caps what this service holds
            (docs/SEMANTICS.md, "Tenant quotas"). None (the default): no tenant.
        keep: seconds (0.1-3600) this worker may keep a released lease's bytes, idle, to grant
            its next request that asks for exactly the same (bytes, ttl, priority, tenant,
            preemptible; no ``X-Request-ID``) from them with no Redis round trip, while nobody
            waits in the pool (docs/SEMANTICS.md, "Kept bytes"; the service's
            ``GPULOCK_KEEP``). The cost: released bytes stay leased up to ``keep`` seconds
            while nobody asks for them. 0 (the default): off.
        oom_backoff: the rule by which a CUDA OOM inside a lease raises its shape bucket's
            estimate and shrinks the share of the capacity granted (docs/SEMANTICS.md,
            "Back-off on OOM"); None turns it off.
        device: the index of the device the pool stands for; when given, each worker runs a
            :class:`~gpulock.devices.sampler.DeviceSampler` (one of them samples, the others
            stand by) that reconciles the pool with the device's real memory (docs/SEMANTICS.md,
            "Device truth"). None (the default): no sampler.
        device_reader: how to read the device: ``auto``, ``nvml``, ``torch`` or ``fake:PATH``
            (:func:`gpulock.devices.open_reader`).

    Raises: InvalidArgument for a bad ``configure``, ``executor_threads``, ``capacity``,
    ``priority_header``, ``tenant``, ``keep`` or ``device``.

    Attributes: the parts, one module each (:mod:`gpulock.fastapi` lists them), which call
    each other's public methods: ``settings``, ``backend`` (the pool, Redis client, executor,
    last status read, ``grace()``), ``slots``, ``admission``, ``ttl_bound``, ``jobs``, ``calls``,
    ``store`` (X-Request-ID), ``ready`` (readiness and conditions), ``resident`` (resident
    leases), ``retry`` (Retry-After), ``errors``, ``estimates``, ``backoff`` (OOM back-off),
    ``reaper``, ``device`` (device truth), ``history``, ``kept`` (the kept bytes' metrics).
    The shortcuts the README and docs/SERVICE.md show: ``readiness`` and ``set_condition``
    (``ready``'s), ``acquire_resident`` (``resident.acquire``), ``estimate`` and ``calibrate``
    (``estimates``').
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
        ttl: float = DEFAULT_TTL_S,
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
        priority_header: str | None = None,
        tenant: str | None = None,
        keep: float = 0.0,
        oom_backoff: BackoffRule | None = DEFAULT_RULE,
        device: int | None = None,
        device_reader: str = "auto",
    ):
        s = self.settings = Settings.of(
            redis_url,
            pool,
            capacity=capacity,
            configure=configure,
            acquire_timeout=acquire_timeout,
            inference_timeout=inference_timeout,
            ttl=ttl,
            executor_threads=executor_threads,
            park_timeout=park_timeout,
            result_ttl=result_ttl,
            max_retry_after=max_retry_after,
            max_waiters=max_waiters,
            reaper_interval=reaper_interval,
            history_file=history_file,
            enabled=enabled,
            exit_on_fatal=exit_on_fatal,
            request_id_header=request_id_header,
            priority_header=priority_header,
            tenant=tenant,
            keep=keep,
        )
        be = self.backend = Backend(s.pool_name)
        self.device = DeviceTruth(device, device_reader, be)
        slots = self.slots = Slots(s.executor_threads)
        history = self.history = History()
        bound = self.ttl_bound = TtlBound(be)
        retry = self.retry = RetryAfterEstimator(s, be, slots, lambda: self.resident.count())
        errors = self.errors = HttpErrors(
            s, retry.answer, lambda event: be.count_event(event, self.spawn)
        )
        self.resident = ResidentLeases(
            s, be, bound, history, self.spawn, lambda: ready.publish(), lambda: ready.stopping
        )
        ready = self.ready = Readiness(s, be, self.resident)
        backoff = self.backoff = OomBackoff(oom_backoff, be)
        reaper = self.reaper = Reaper(s, be, self._on_read, ready.publish)
        store = self.store = RequestStore(s, be, slots, retry, errors)
        self.admission = Admission(
            slots, be, lambda: bound(s.ttl), lambda: reaper.tick(full=False), tenant=s.tenant
        )
        self.jobs = JobRunner(
            s, be, self.admission, store, retry, history, self.spawn, ready.fatal, backoff
        )
        self.calls = GuardedCalls(s, be, ready.check_accepting, self.jobs, store, retry, errors)
        self.estimates = Estimates(s, be, backoff.scale)
        self.kept = KeptMetrics()
        self._tasks: set[asyncio.Task[Any]] = set()
        # the shortcuts (class docstring)
        self.readiness = self.ready.readiness
        self.set_condition = self.ready.set_condition
        self.acquire_resident = self.resident.acquire
        self.estimate = self.estimates.estimate
        self.calibrate = self.estimates.calibrate

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect (in this process: call it after fork), configure the pool when a capacity
        was given, start the executor, the background reaper and (``device``) the device
        sampler. No error if Redis is down: readiness says so and the reaper keeps trying."""
        if self.ready.started:
            return
        s, be = self.settings, self.backend
        be.connect(s)
        if s.history_file:
            await self.history.open(s.history_file)
        self.ready.started = True
        m = metrics()
        m.workers.set(1)
        m.ready.set(0)
        await be.configure(s)
        await self.reaper.tick()
        self.reaper.start()
        self.device.start(self.spawn)

    async def stop(self, *, grace_s: float = 10.0) -> None:
        """Cancel queued requests (they leave the queue at once), wait up to ``grace_s`` for
        running work, release the resident leases, close the connection."""
        if not self.ready.started:
            return
        self.ready.stopping = True
        metrics().ready.set(0)
        await self.reaper.stop()
        pending = self.jobs.cancel_waiting()
        await stop_tasks(list(self._tasks))  # the background ones (sampler, batch drivers...)
        if pending:
            await asyncio.wait(pending, timeout=grace_s)
        await self.resident.release_all()
        metrics().workers.set(0)
        await self.backend.close()  # gives this worker's idle kept leases back
        self.kept.sync(self.backend.pool)
        self.history.close()
        self.ready.started = False

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any = None) -> AsyncIterator[None]:
        """``FastAPI(lifespan=limiter.lifespan)``: start in each worker, stop at shutdown."""
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """Run a background coroutine that ``stop()`` cancels."""
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _on_read(self, now: float, st: PoolStatus, full: bool) -> None:
        """What each reaper read feeds: the grant rates, our requests' claims, and (``full``)
        the calibrated estimates."""
        self.retry.sample(now, st)
        self.kept.sync(self.backend.pool)
        await self.store.refresh(self.jobs.claimed())
        if full:
            with contextlib.suppress(Exception):
                await self.estimates.refresh()
            with contextlib.suppress(Exception):
                await self.backoff.refresh()

    # ---- routes ---------------------------------------------------------------------------------
    def guard(
        self,
        route: str,
        *,
        estimate: Callable[..., int] | None = None,
        priority: int = 0,
        max_priority: int | None = None,
        preemptible: bool = False,
    ) -> Callable[..., GpuCall]:
        """A FastAPI dependency: ``call: GpuCall = Depends(limiter.guard("embed", estimate=f))``
        then ``result = await call(fn, *args)``: ``f(*args, **kwargs)`` gives the bytes (or
        pass ``amount=`` to ``call``), ``fn(*args, **kwargs)`` runs in the executor under the
        lease. ``priority`` (an integer in [-100, 100], higher goes first, default 0) is the
        one the route's requests queue with; ``max_priority`` (default ``priority``) the most
        a request may ask in ``priority_header``. ``preemptible`` (default False): the pool
        may ask the route's leases to yield to a higher-priority request (docs/SERVICE.md,
        "Preemption": only for work that can stop early and still answer; it reads
        ``current_lease().yield_requested``).

        Raises: InvalidArgument naming the route and the value, for a bad priority."""
        return _signature.guard(
            self.calls,
            route,
            estimate,
            RoutePriority.of(route, priority, max_priority),
            bool(preemptible),
        )

    def endpoint(
        self,
        route: str,
        *,
        estimate: Callable[..., int],
        priority: int = 0,
        max_priority: int | None = None,
        stream: str | None = None,
        preemptible: bool = False,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorate a plain ``def`` route handler: FastAPI sees an ``async def`` with the same
        parameters; the handler's body runs in the bounded executor under a lease of
        ``estimate(**params)`` bytes (``estimate`` receives the handler's parameters by name,
        only those it declares). Put it *below* ``@app.post(...)``. ``priority``,
        ``max_priority`` and ``preemptible`` as for :meth:`guard` (a preemptible stream ends
        at its next chunk boundary after a yield request, with an error event ``preempted``).

        ``stream``: ``"sse"`` (server-sent events) or a media type (``"text/plain"``,
        ``"application/x-ndjson"``, ...): the handler is a generator function (sync, or
        ``async def`` with ``yield``) or returns an iterable, and the route answers a stream
        of its chunks, the lease held until the stream ends (:mod:`gpulock.fastapi._stream`:
        each chunk of a sync body made in the executor after ``ensure_valid()``; a client
        that hangs up stops it; a lost lease ends it with an error event). A parameter
        annotated :class:`StreamLease` receives the stream's lease.

        Raises: InvalidArgument naming the route and the value, for a bad priority; naming
        the value, for a bad ``stream``."""
        return _signature.endpoint(
            self.calls,
            route,
            estimate,
            RoutePriority.of(route, priority, max_priority),
            stream,
            bool(preemptible),
        )

    def batcher(
        self,
        route: str,
        fn: Callable[[list[R]], Sequence[Any]],
        *,
        estimate: Callable[[R], int | str],
        estimate_batch: Callable[[list[R]], int] | None = None,
        max_wait_ms: float = 5.0,
        max_size: int = 32,
        max_splits: int | None = None,
        param: str = "item",
        priority: int = 0,
        max_priority: int | None = None,
        preemptible: bool = False,
    ) -> Batcher[R]:
        """Dynamic batching for a route: ``result = await batcher.submit(item,
        request=request, response=response)`` in an async handler runs ``item`` with other
        requests of the route, ``fn(list_of_items)`` (a plain function, in the executor, under
        one lease of ``estimate_batch(items)`` bytes, default the sum of ``estimate(item)``)
        returning one result per item, in order. A batch closes when it holds ``max_size``
        requests, after ``max_wait_ms``, when the next request would not fit the room the pool
        would grant now, or when a thread is free and nothing else waits. See
        :mod:`gpulock.fastapi._batcher` for the per-request errors, the OOM split (at most
        ``max_splits`` levels of halving; default down to single requests) and X-Request-ID
        (``param``: the name the item is fingerprinted under; an ``endpoint`` handler's
        parameter name gives the same fingerprint as that handler). ``priority`` and
        ``max_priority`` as for :meth:`guard`; a batch queues with the highest priority among
        its requests. ``preemptible`` as for :meth:`guard`: a batch asked to yield finishes
        the batch in flight and releases its lease then, as every batch does (a lease is
        never kept across batches).

        Raises: InvalidArgument for a bad size, wait (more than ``acquire_timeout``), splits
        or priority."""
        return Batcher(
            route,
            fn,
            estimate,
            estimate_batch,
            BatchPolicy(max_size, max_wait_ms / 1000.0, max_splits),
            param=param,
            priority=RoutePriority.of(route, priority, max_priority),
            preemptible=bool(preemptible),
            settings=self.settings,
            backend=self.backend,
            slots=self.slots,
            runner=self.jobs,
            calls=self.calls,
            errors=self.errors,
            spawn=self.spawn,
        )

    async def metrics_response(self, accept: str | None = None) -> Response:
        """The ``/metrics`` response: this process's (or, in multiprocess mode, all workers')
        counters and histograms, plus the pool's gauges read from Redis now; OpenMetrics text
        when ``accept`` (the request's Accept header) asks for it, else Prometheus text."""
        self.kept.sync(self.backend.pool)
        return await metrics_response(
            self.backend.pool, self.settings.pool_name, accept, backoff=self.backoff.state()
        )
