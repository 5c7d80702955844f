"""The guarded call from the HTTP side: a request becomes a job (or joins one, or is answered
from a stored result), and is answered from it within the request's deadlines.

Deadlines: 503 if the job has not started running by ``arrival + acquire_timeout``, 504 if it
has not finished ``inference_timeout`` later; the job goes on after either answer (parked, or
until its thread returns). A client that hangs up gets 499."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

from fastapi import Request, Response
from gpulock_common.aio import wait_for
from gpulock_common.grace import grace_note, grace_outlasts

from gpulock.http import access_log as access
from gpulock.http.disconnect import _Gone, _wait_or_gone, watch_disconnect
from gpulock.errors import AcquireTimeout, InvalidArgument
from gpulock.units import parse_size
from ._backend import Backend
from ._errors import GpuLockHTTPException, HttpErrors, bytes_asked
from ._idempotency import MISSING, RequestStore, request_ticket
from ._job import Job
from ._jobs import JobRunner
from ._metrics import metrics
from ._priority import RoutePriority
from ._retry_after import RetryAfterEstimator
from ._settings import Settings
from ._stream import LeasedStream


class GuardedCalls:
    """Runs guarded calls and maps their outcomes to answers.

    Args:
        settings: the timeouts, ``park_timeout``, ``enabled`` and the header's name.
        backend: the executor (for unguarded calls).
        check_accepting: raises 503 unless this worker takes guarded calls now.
        runner: starts jobs.
        store: claims, results and following (X-Request-ID).
        retry: Retry-After and the job's place.
        errors: the answers of failed calls.
    """

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        check_accepting: Callable[[], None],
        runner: JobRunner,
        store: RequestStore,
        retry: RetryAfterEstimator,
        errors: HttpErrors,
    ):
        self._settings = settings
        self._backend = backend
        self._check_accepting = check_accepting
        self._runner = runner
        self._store = store
        self._retry = retry
        self._errors = errors

    def admit(self, route: str) -> None:
        """Raise 503 ``not_ready`` unless this worker takes guarded calls now, counted as every
        error answer of a guarded call is (:meth:`HttpErrors.count`): for route shapes that
        refuse before their estimate runs (``endpoint``, the batcher)."""
        try:
            self._check_accepting()
        except GpuLockHTTPException as e:
            self._errors.count(e, route)
            raise

    def refuse_never_fitting(self, route: str, amount: int) -> None:
        """Raise the 413 an acquire of ``amount`` bytes answers at once when the pool can
        never grant them (:meth:`~gpulock.protocol.replies.PoolStatus.refusal`: over its
        capacity, the room its resident leases leave, or this service's tenant's quota), as
        the pool's last status read says; nothing when it fits, before the first read, or
        without leases (``enabled=False``). For work leased less at first that may grow to
        ``amount`` (a generation in grow mode): refused before it queues, not mid-way.
        Counted as the guarded call's error answers are."""
        st = self._backend.status
        if st is None or not self._settings.enabled:
            return
        exc = st.refusal(amount, self._settings.tenant)
        if exc is None:
            return
        try:
            self._errors.too_large(exc)
        except GpuLockHTTPException as e:
            self._errors.count(e, route)
            raise

    async def call(
        self,
        fn: Callable[[], Any] | LeasedStream,
        *,
        route: str,
        amount: int | str,
        request: Request | None = None,
        response: Response | None = None,
        request_id: str | None = None,
        fingerprint_of: Callable[[], str] | None = None,
        run: Callable[[int, float, Response | None, asyncio.Task[bool] | None, int], Awaitable[Any]]
        | None = None,
        priority: int | RoutePriority = 0,
        preemptible: bool | None = None,
    ) -> Any:
        """Run ``fn()`` in the executor under a lease of ``amount`` bytes; see the package
        docstring for the sequence and the errors (raised as :class:`GpuLockHTTPException`).
        ``request_id`` defaults to the request's ``X-Request-ID`` header. ``priority``: the
        route's (an int: that priority, no header may raise it); the request's
        ``priority_header`` may replace it (:mod:`gpulock.fastapi._priority`: 400 for a
        malformed value). ``preemptible``: whether the pool may ask the lease to yield to a
        higher-priority request (docs/SERVICE.md, "Preemption"); None: yes for work no HTTP
        request waits on (``request`` None: a background job), no for a request's. ``run`` (a
        batcher's): a guarded request without a request id is answered by ``run(amount,
        arrival, response, gone, priority)`` instead of a job of its own."""
        m = metrics()
        yields = request is None if preemptible is None else preemptible
        header = self._settings.request_id_header
        if request_id is None and request is not None:
            request_id = request.headers.get(header)
        # the idempotency key: one past the bound is refused (400), never cut, nor echoed
        bad = access.request_id_error(request_id, header) if request_id else None
        if bad is not None:
            request_id = None
        if response is not None and request_id:
            response.headers[header] = request_id
        gone: asyncio.Task[bool] | None = None
        try:
            if bad is not None:
                raise GpuLockHTTPException(400, bad, "invalid_request_id")
            self._check_accepting()
            rp = (
                priority
                if isinstance(priority, RoutePriority)
                else RoutePriority.of(route, priority)
            )
            ph = self._settings.priority_header
            prio = rp.for_request(
                ph, request.headers.get(ph) if ph is not None and request is not None else None
            )
            try:
                amount = parse_size(amount, name="estimate")
            except InvalidArgument as e:  # the route's estimator: never a bare 500 (SERVICE.md)
                raise GpuLockHTTPException.of(e, f"route {route!r}: {e}") from None
            m.estimate.labels(route).observe(amount)
            access.note(lease_bytes=amount)
            arrival = time.monotonic()
            if not self._settings.enabled:
                result = await self._call_unguarded(fn)
            else:
                # Uvicorn does not cancel a handler whose client went away: watch for it, so a
                # request nobody waits for leaves the queue at once and is never granted.
                gone = watch_disconnect(request) if request is not None else None
                if request_id and not isinstance(fn, LeasedStream):  # a stream is not replayed
                    fp = fingerprint_of() if fingerprint_of else ""
                    result = await self._call_idempotent(
                        fn, route, amount, request_id, arrival, fp, response, gone, prio, yields
                    )
                elif run is not None:
                    result = await run(amount, arrival, response, gone, prio)
                else:
                    job = self._runner.start(
                        fn,
                        route,
                        amount,
                        None,
                        "",
                        arrival,
                        park=0.0,
                        priority=prio,
                        preemptible=yields,
                    )
                    result = await self.await_job(job, arrival, response, gone)
        except GpuLockHTTPException as e:
            self._errors.count(e, route)
            if request_id:
                e.headers = {**(e.headers or {}), header: request_id}
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
            # FastAPI ignores the sub-response when a Response is returned
            for k, v in response.headers.items():
                if k.lower() not in ("content-length", "content-type"):
                    result.headers[k] = v
        return result

    async def _call_unguarded(self, fn: Callable[[], Any] | LeasedStream) -> Any:
        executor = self._backend.executor
        assert executor is not None
        timeout = self._settings.inference_timeout
        if isinstance(fn, LeasedStream):
            return await _stream_unguarded(fn, executor, timeout)
        # in a copy of this context, as a guarded call's work runs (its spans the request's)
        fut = asyncio.get_running_loop().run_in_executor(
            executor, contextvars.copy_context().run, fn
        )
        try:
            return await wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            raise GpuLockHTTPException(
                504, f"inference ran past {timeout}s", "inference_timeout"
            ) from None

    async def _call_idempotent(
        self,
        fn: Callable[[], Any] | LeasedStream,
        route: str,
        amount: int,
        request_id: str,
        arrival: float,
        fp: str,
        response: Response | None,
        gone: asyncio.Task[bool] | None = None,
        priority: int = 0,
        preemptible: bool = False,
    ) -> Any:
        ticket = request_ticket(route, request_id)
        m = metrics()
        while True:
            local = self._runner.by_ticket.get(ticket)
            if local is not None and local.abandoned and local.task is not None:
                # its place just ran out (withdrawn as this retry came): let it end, start anew
                await asyncio.wait((local.task,))
                continue
            if local is not None and local.phase != "done":
                if local.fingerprint != fp:
                    raise self._errors.conflict(request_id)
                m.replays.labels(route, "joined").inc()
                return await self.await_job(local, arrival, response, gone)
            stored = await self._store.get(ticket, fp, request_id)
            if stored is not MISSING:
                m.replays.labels(route, "stored").inc()
                if response is not None:
                    response.headers["X-Idempotent-Replay"] = "true"
                return stored
            if await self._store.claim(ticket, fp):
                # stored just before we claimed?
                stored = await self._store.get(ticket, fp, request_id)
                if stored is not MISSING:
                    await self._store.unclaim(ticket)
                    m.replays.labels(route, "stored").inc()
                    return stored
                job = self._runner.start(
                    fn,
                    route,
                    amount,
                    ticket,
                    fp,
                    arrival,
                    park=self._settings.park_timeout,
                    priority=priority,
                    preemptible=preemptible,
                )
                return await self.await_job(job, arrival, response, gone)
            outcome = await self._store.follow(ticket, fp, request_id, route, arrival, gone)
            if outcome is not MISSING:
                m.replays.labels(route, "joined").inc()
                return outcome
            # The owner finished without a result (an error) or died: take over.

    async def await_job(
        self,
        job: Job,
        arrival: float,
        response: Response | None,
        gone: asyncio.Task[bool] | None = None,
        own: int | None = None,
    ) -> Any:
        """Wait for a job with this request's deadlines: 503 if it has not started running by
        ``arrival + acquire_timeout``, 504 if it has not finished ``inference_timeout`` later.
        ``own``: the request's own bytes when the job is its batch's (its 503 names them, and
        the batch's apart).
        The job goes on after either answer (parked, or until its thread returns). ``gone``
        (see :func:`watch_disconnect`) ends when the client hung up: 499, and a job nobody
        else waits for leaves the queue at once (it is never granted); running work goes on
        until its thread returns, its result dropped."""
        places = self._runner.places
        if job.parked:
            assert job.ticket is not None
            places.attach(job.ticket, lambda: job.place)
        else:
            job.place.attached += 1
        try:
            return await self._await_attached(job, arrival, response, gone, own)
        finally:
            if job.parked:
                assert job.ticket is not None
                still_queued = not job.abandoned and job.phase in ("slot", "queued")
                places.detach(job.ticket, job.place, keep=still_queued)
            else:
                job.place.attached -= 1

    async def _await_attached(
        self,
        job: Job,
        arrival: float,
        response: Response | None,
        gone: asyncio.Task[bool] | None,
        own: int | None,
    ) -> Any:
        s = self._settings
        amount, batch = (job.amount, None) if own is None else (own, job.amount)
        remaining = arrival + s.acquire_timeout - time.monotonic()
        try:
            if not job.started.is_set():
                await _wait_or_gone(self._started(job, arrival), max(0.0, remaining), gone)
        except _Gone:
            if job.place.attached == 1 and job.phase in ("slot", "queued") and job.task is not None:
                job.abandoned = True  # before any await: a grant arriving now must not run
                job.task.cancel()  # leaves the thread-slot wait or the pool's queue now
            raise self._errors.client_gone(
                job.route, "waiting" if not job.started.is_set() else "running"
            ) from None
        except asyncio.TimeoutError:
            timed_out = not job.started.is_set()  # granted just as the deadline passed: go on
        except asyncio.CancelledError:
            if (
                job.ticket is None
                and job.place.attached == 1
                and job.phase in ("slot", "queued")
                and job.task is not None
            ):
                job.abandoned = True
                job.task.cancel()  # the client went away before a grant: leave the queue
            raise
        else:
            timed_out = not job.started.is_set()  # the grace period outlasts its deadline
        if timed_out:
            raise await self._queue_timeout(job, bytes_asked(amount, batch))
        assert job.outcome is not None
        if not job.outcome.done():
            try:
                await _wait_or_gone(asyncio.shield(job.outcome), s.inference_timeout, gone)
            except _Gone:
                raise self._errors.client_gone(job.route, "running") from None
            except asyncio.TimeoutError:
                metrics().inference_timeouts.labels(job.route).inc()
                extra = (
                    f" Retry with the same {s.request_id_header} to collect the result."
                    if job.ticket is not None
                    else ""
                )
                raise GpuLockHTTPException(
                    504,
                    f"inference ran past {s.inference_timeout}s; its GPU lease stays held until the "
                    f"work really finishes.{extra}",
                    "inference_timeout",
                ) from None
            except asyncio.CancelledError:
                raise
            except BaseException:
                pass  # mapped below
        if job.wait_s is not None:
            access.note(queue_wait_s=job.wait_s)
        if job.leased is not None:
            access.note(lease_bytes=job.leased)  # what was granted, after the OOM back-off
        if response is not None and job.wait_s is not None:
            response.headers["Server-Timing"] = (
                f"gpulock-wait;dur={job.wait_s * 1000:.3f}, "
                f"gpulock-run;dur={(job.run_s or 0) * 1000:.3f}"
            )
        return self._errors.outcome(
            job.outcome, job.route, amount, lambda: self._retry.job_position(job), batch
        )

    async def _started(self, job: Job, arrival: float) -> None:
        """Wait until ``job`` runs (or ends); for a parked job, only until it is queued in a
        restart grace period that outlasts this request's deadline (``arrival +
        acquire_timeout``). A parked job has no deadline of its own, so the core's rule
        (:func:`grace_outlasts`) never ends it: this request is answered at once, as one
        without a request id is, and the job keeps its place."""
        if job.parked:
            waits = (
                asyncio.ensure_future(job.queued.wait()),
                asyncio.ensure_future(job.started.wait()),
            )
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            deadline_in = arrival + self._settings.acquire_timeout - time.monotonic()
            if job.started.is_set() or grace_outlasts(self._backend.grace_left(), deadline_in):
                return
        await job.started.wait()

    async def _queue_timeout(self, job: Job, asked: str) -> GpuLockHTTPException:
        """The 503 for a job not granted by its request's deadline (``asked``: the request's
        bytes, :func:`bytes_asked`); a job that is not parked leaves the queue now."""
        s = self._settings
        parked = job.parked
        # a job other requests still wait on (a batch's) goes on; the batcher drops this one
        last = job.place.attached <= 1
        if not parked and last:
            job.abandoned = True  # before any await: a grant arriving now must not run
        position, queued = await self._retry.position_now(job)
        ra, estimate = self._retry.for_job(job, position, queued)
        metrics().timeouts.labels(job.route).inc()
        keep = ""
        if not parked and last and job.task is not None:
            job.task.cancel()  # leaves the queue now (the core cancels the ticket)
        elif parked and job.ticket is not None:
            places = self._runner.places
            hold = places.hold_for(ra, extra=self._backend.grace_left())
            places.keep(job.ticket, job.place, until=time.monotonic() + hold)
            keep = (
                f" It keeps its place for {hold:.0f}s more (and again after each retry): "
                f"retry after Retry-After with the same {s.request_id_header}."
            )
        if job.phase == "slot":  # never reached the pool's queue: this worker's threads were busy
            what = (
                f"no free inference thread in this worker within {s.acquire_timeout}s "
                f"(all {s.executor_threads} busy; queue position {position}, counting the "
                f"pool's queue and this worker's own)"
            )
        elif self._backend.grace_left() > 0:  # not short of memory: nothing is granted yet
            what = (
                f"no GPU memory granted within {s.acquire_timeout}s (queue position "
                f"{position}): {grace_note(s.pool_name, self._backend.grace_left())}"
            )
        else:
            what = (
                f"no GPU memory for {asked} within {s.acquire_timeout}s (queue position {position})"
            )
        return GpuLockHTTPException.of(
            AcquireTimeout,
            f"{what}.{keep}",
            {"Retry-After": str(ra), "X-Queue-Position": str(position)},
            estimated_wait_s=estimate,
        )


_unguarded_streams: set[asyncio.Task[Any]] = set()  # their tasks, referenced while they run


async def _stream_unguarded(stream: LeasedStream, executor: Executor, start_timeout: float) -> Any:
    """Run ``stream`` without a lease (``enabled=False``); returns it once its first chunk is
    made (or raises what making it raised)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[LeasedStream] = loop.create_future()

    def on_ready(s: LeasedStream) -> bool:
        ready.set_result(s)
        return True

    ctx = contextvars.copy_context()  # the request's, also for the chunks made while sending

    async def step(fn: Callable[[], Any], check: bool) -> Any:
        return await loop.run_in_executor(executor, ctx.copy().run, fn)

    task = asyncio.ensure_future(stream.run(None, step, on_ready, start_timeout))
    _unguarded_streams.add(task)
    task.add_done_callback(_unguarded_streams.discard)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    await asyncio.wait((ready, task), return_when=asyncio.FIRST_COMPLETED)
    if ready.done():
        return ready.result()
    return task.result()
