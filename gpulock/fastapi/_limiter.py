"""``GpuLimiter``: the facade that composes the integration's parts (admission, jobs, the
idempotency store, resident leases, readiness, Retry-After, errors, metrics, calibration and
the route shapes) and runs their lifecycle and background reaper."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, AsyncIterator, TypeVar

from fastapi import Response
from gpulock_common.aio import stop_tasks
from gpulock_common.options import DEFAULT_TTL_S

from gpulock._async import AsyncPool
from gpulock.protocol.replies import PoolStatus
from gpulock.admin.samples import count_event
from gpulock.errors import GpuLockError, InvalidArgument
from . import _signature
from ._admission import Admission, Slots, TtlBound
from ._backend import Backend, process_owner
from ._batcher import Batcher, BatchPolicy
from gpulock.oom_backoff import BackoffRule
from ._backoff import OomBackoff
from ._calibration import Estimates
from ._call import GuardedCalls
from ._errors import HttpErrors
from ._history import History
from ._idempotency import RequestStore
from ._jobs import JobRunner
from ._metrics import metrics, metrics_response
from ._priority import RoutePriority
from ._readiness import Readiness
from ._reaper import Reaper
from ._resident import ResidentLeases
from ._retry_after import RetryAfterEstimator
from ._settings import Settings
from ._signature import GpuCall

if TYPE_CHECKING:
    from gpulock.devices.sampler import DeviceSampler

log = logging.getLogger("gpulock.fastapi")

R = TypeVar("R")

#: The documented back-off rule (docs/SEMANTICS.md, "Back-off on OOM").
DEFAULT_RULE = BackoffRule()


class _Forward:
    """An attribute (or method) of the limiter that is one of a part's, by the same name
    unless ``name`` is given; assignable when the part's is."""

    def __init__(self, part: str, name: str | None = None):
        self.part, self.name = part, name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else getattr(getattr(obj, self.part), str(self.name))

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(getattr(obj, self.part), str(self.name), value)


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
            pool's ``max_ttl`` as last read (:attr:`lease_ttl`, one warning when it clamps).
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
    ``priority_header`` or ``tenant``.
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
        oom_backoff: BackoffRule | None = DEFAULT_RULE,
        device: int | None = None,
        device_reader: str = "auto",
    ):
        if device is not None and (isinstance(device, bool) or not 0 <= int(device) <= 1023):
            raise InvalidArgument(f"device must be a device index 0..1023, got {device!r}")
        self.device = None if device is None else int(device)
        self.device_reader = device_reader
        self.device_sampler: DeviceSampler | None = None
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
        )
        be = self._backend = Backend(s.pool_name)
        self._slots = Slots(s.executor_threads)
        self._history = History()
        self._ttl_bound = TtlBound(be)
        self._retry = RetryAfterEstimator(s, be, self._slots, lambda: self._resident.count())
        errors = self._errors = HttpErrors(s, self._retry.retry_after, self._count_event)
        self._resident = ResidentLeases(
            s,
            be,
            self._ttl_bound,
            self._history,
            self.spawn,
            changed=lambda: self._ready.publish(),
            stopping=lambda: self._ready.stopping,
        )
        self._ready = Readiness(s, be, self._resident)
        self._backoff = OomBackoff(oom_backoff, be)
        self._reaper = Reaper(s, be, self._on_read, self._ready.publish)
        self._store = RequestStore(s, be, self._slots, self._retry, errors)
        admission = Admission(
            self._slots,
            be,
            lambda: self.lease_ttl,
            lambda: self._reaper.tick(full=False),
            tenant=s.tenant,
        )
        self._runner = JobRunner(
            s,
            be,
            admission,
            self._store,
            self._retry,
            self._history,
            self.spawn,
            self._ready.fatal,
            self._backoff,
        )
        self._calls = GuardedCalls(
            s,
            be,
            self._ready.check_accepting,
            self._runner,
            self._store,
            self._retry,
            errors,
        )
        self._estimates = Estimates(s, be, self._backoff.scale)
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- settings and state, kept by the parts ---------------------------------------------------
    redis_url = _Forward("settings")
    pool_name = _Forward("settings")
    capacity = _Forward("settings")
    configure_mode = _Forward("settings")
    acquire_timeout = _Forward("settings")
    inference_timeout = _Forward("settings")
    ttl = _Forward("settings")
    executor_threads = _Forward("settings")
    park_timeout = _Forward("settings")
    result_ttl = _Forward("settings")
    max_retry_after = _Forward("settings")
    max_waiters = _Forward("settings")
    reaper_interval = _Forward("settings")
    history_file = _Forward("settings")
    enabled = _Forward("settings")
    exit_on_fatal = _Forward("settings")
    request_id_header = _Forward("settings")
    priority_header = _Forward("settings")
    pool = _Forward("_backend")
    redis = _Forward("_backend")
    executor = _Forward("_backend")
    status = _Forward("_backend")  # the pool's status as last read
    status_at = _Forward("_backend")
    redis_error = _Forward("_backend")
    grace_left = _Forward("_backend")
    grace = _Forward("_backend")
    conditions = _Forward("_ready")
    fatal_error = _Forward("_ready")
    set_condition = _Forward("_ready")
    readiness = _Forward("_ready")
    check_accepting = _Forward("_ready")
    resident_leases = _Forward("_resident", "leases")
    resident_wanted = _Forward("_resident", "wanted")
    acquire_resident = _Forward("_resident", "acquire")
    grant_rate = _Forward("_retry")
    retry_after = _Forward("_retry")
    refresh_estimates = _Forward("_estimates", "refresh")
    estimate = _Forward("_estimates")
    calibrate = _Forward("_estimates")
    refresh_backoff = _Forward("_backoff", "refresh")
    backoff_factor = _Forward("_backoff", "factor")
    backoff_scale = _Forward("_backoff", "scale")
    backoff_state = _Forward("_backoff", "state")
    call = _Forward("_calls")
    admit = _Forward("_calls")

    @property
    def estimates_key(self) -> str:
        """``gpulock:{pool}:estimates``: hash of calibrated per-shape peaks, field
        ``<route>|b<batch bucket>|s<token bucket>`` → bytes."""
        return self._estimates.key

    @property
    def lease_ttl(self) -> float:
        """The ttl requests lease with: ``ttl`` bounded by the pool's ``max_ttl``."""
        return self._ttl_bound(self.settings.ttl)

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect (in this process: call it after fork), configure the pool when a capacity
        was given, start the executor and the background reaper. No error if Redis is down:
        readiness says so and the reaper keeps trying."""
        if self._ready.started:
            return
        from gpulock.transport.connect import async_client

        s, be = self.settings, self._backend
        be.owner = process_owner()
        be.redis = async_client(
            s.redis_url,
            socket_timeout=5.0,
            socket_connect_timeout=2.0,
            health_check_interval=10,
            client_name=f"gpulock-service-{os.getpid()}",
        )
        kw: dict[str, Any] = {"capacity": s.capacity, "default_ttl": s.ttl}
        if s.max_waiters is not None:
            kw["max_waiters"] = s.max_waiters
        be.pool = AsyncPool(be.redis, s.pool_name, **kw)
        be.executor = ThreadPoolExecutor(s.executor_threads, thread_name_prefix="gpulock-work")
        if s.history_file:
            await self._history.open(s.history_file)
        self._ready.started = True
        m = metrics()
        m.workers.set(1)
        m.ready.set(0)
        if s.capacity is not None:
            try:
                await be.pool.configure(s.capacity, create_only=s.configure_mode == "create")
            except GpuLockError as e:
                log.warning("gpulock: could not configure pool %s yet: %s", s.pool_name, e)
        await self._reaper.tick()
        self._reaper.start()
        if self.device is not None:
            self._start_device_sampler(be.pool)

    def _start_device_sampler(self, pool: AsyncPool) -> None:
        """Run the device sampler in the background (stopped with the other tasks); a reader
        that cannot be opened is logged and leaves the pool without device truth."""
        from gpulock.devices.sampler import DeviceSampler
        from gpulock.devices import DeviceError, open_reader

        try:
            reader = open_reader(self.device_reader)
        except (ValueError, DeviceError) as e:
            log.warning("gpulock: pool %s: no device sampler: %s", self.pool_name, e)
            return
        self.device_sampler = DeviceSampler(pool, reader, int(self.device or 0))
        self.spawn(self.device_sampler.run(), name="gpulock-device-sampler")

    def device_truth(self) -> dict[str, Any]:
        """The device's truth as last read (never waits on Redis): the pool's external use and
        effective capacity from the last status read (bytes; ``report_left`` seconds the report
        still counts), its over-users, and whether this worker samples."""
        st = self._backend.status
        ds = self.device_sampler
        return {
            "device": self.device,
            "sampling": bool(ds and ds.holding),
            "reader": ds.reader.name if ds else None,
            "external_bytes": st.external if st else 0,
            "effective_capacity": st.effective_capacity if st else None,
            "report_left": st.external_left if st else 0.0,
            "overusers": st.overusers if st else [],
        }

    async def stop(self, *, grace_s: float = 10.0) -> None:
        """Cancel queued requests (they leave the queue at once), wait up to ``grace_s`` for
        running work, release the resident leases, close the connection."""
        if not self._ready.started:
            return
        self._ready.stopping = True
        m = metrics()
        m.ready.set(0)
        await self._reaper.stop()
        pending = self._runner.cancel_waiting()
        await stop_tasks(list(self._tasks))  # the background ones (sampler, batch drivers...)
        if pending:
            await asyncio.wait(pending, timeout=grace_s)
        await self._resident.release_all()
        m.workers.set(0)
        be = self._backend
        if be.pool is not None:
            await be.pool.aclose()
        if be.redis is not None:
            with contextlib.suppress(Exception):
                await be.redis.aclose()
        if be.executor is not None:
            be.executor.shutdown(wait=False, cancel_futures=True)
        self._history.close()
        self._ready.started = False

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any = None) -> AsyncIterator[None]:
        """``FastAPI(lifespan=limiter.lifespan)``: start in each worker, stop at shutdown."""
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    def _count_event(self, event: str) -> None:
        """Add one to the pool's ``event`` counter in Redis (in the background; a failure only
        loses the count)."""
        redis = self._backend.redis
        if redis is None:
            return

        async def count() -> None:
            try:
                await count_event(redis, self.settings.pool_name, event)
            except Exception as e:  # noqa: BLE001 - a count is not worth an error answer
                log.debug("gpulock: counting %s failed: %s", event, e)

        self.spawn(count(), name="gpulock-count-event")

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        """Run a background coroutine that ``stop()`` cancels."""
        t = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _on_read(self, now: float, st: PoolStatus, full: bool) -> None:
        """What each reaper read feeds: the grant rates, our requests' claims, and (``full``)
        the calibrated estimates."""
        self._retry.sample(now, st)
        await self._store.refresh(self._runner.claimed())
        if full:
            with contextlib.suppress(Exception):
                await self._estimates.refresh()
            with contextlib.suppress(Exception):
                await self._backoff.refresh()

    # ---- routes ---------------------------------------------------------------------------------
    def guard(
        self,
        route: str,
        *,
        estimate: Callable[..., int] | None = None,
        priority: int = 0,
        max_priority: int | None = None,
    ) -> Callable[..., GpuCall]:
        """A FastAPI dependency: ``call: GpuCall = Depends(limiter.guard("embed", estimate=f))``
        then ``result = await call(fn, *args)``: ``f(*args, **kwargs)`` gives the bytes (or
        pass ``amount=`` to ``call``), ``fn(*args, **kwargs)`` runs in the executor under the
        lease. ``priority`` (an integer in [-100, 100], higher goes first, default 0) is the
        one the route's requests queue with; ``max_priority`` (default ``priority``) the most
        a request may ask in ``priority_header``.

        Raises: InvalidArgument naming the route and the value, for a bad priority."""
        return _signature.guard(
            self, route, estimate, RoutePriority.of(route, priority, max_priority)
        )

    def endpoint(
        self,
        route: str,
        *,
        estimate: Callable[..., int],
        priority: int = 0,
        max_priority: int | None = None,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorate a plain ``def`` route handler: FastAPI sees an ``async def`` with the same
        parameters; the handler's body runs in the bounded executor under a lease of
        ``estimate(**params)`` bytes (``estimate`` receives the handler's parameters by name,
        only those it declares). Put it *below* ``@app.post(...)``. ``priority`` and
        ``max_priority`` as for :meth:`guard`.

        Raises: InvalidArgument naming the route and the value, for a bad priority."""
        return _signature.endpoint(
            self, route, estimate, RoutePriority.of(route, priority, max_priority)
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
        its requests.

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
            settings=self.settings,
            backend=self._backend,
            slots=self._slots,
            runner=self._runner,
            calls=self._calls,
            errors=self._errors,
            spawn=self.spawn,
        )

    async def metrics_response(self, accept: str | None = None) -> Response:
        """The ``/metrics`` response: this process's (or, in multiprocess mode, all workers')
        counters and histograms, plus the pool's gauges read from Redis now; OpenMetrics text
        when ``accept`` (the request's Accept header) asks for it, else Prometheus text."""
        return await metrics_response(
            self._backend.pool, self.settings.pool_name, accept, backoff=self._backoff.state()
        )
