"""The job runner: one job per guarded call, run as a task of its own so the HTTP side can
answer 503/504 while the job stays queued (X-Request-ID) or its thread still runs.

A job goes ``slot`` (waiting for one of this worker's threads) → ``queued`` (in the pool's
queue) → ``running`` (granted; its function runs in the executor) → ``done``. The lease is
released only after the executor thread returned."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from gpulock._async import AsyncLease
from gpulock.http.places import KeptPlace, KeptPlaces
from gpulock.cuda import drop_traceback, empty_cache, is_fatal_cuda_error, is_oom
from gpulock.errors import AcquireTimeout, LeaseLost
from ._admission import Admission
from ._backend import Backend
from ._backoff import OomBackoff, take_bucket
from ._errors import CudaFatal, CudaOOM
from ._history import History
from ._idempotency import RequestStore
from ._job import Job
from ._metrics import metrics
from ._retry_after import RetryAfterEstimator
from ._settings import Settings
from ._stream import LeasedStream
from . import _tracing

log = logging.getLogger("gpulock.fastapi")

#: How often a place kept only by another worker's hold is looked at again, seconds.
HELD_RECHECK_S = 1.0

_current_lease: contextvars.ContextVar[AsyncLease | None] = contextvars.ContextVar(
    "gpulock_lease", default=None
)


_current_job: contextvars.ContextVar[Job | None] = contextvars.ContextVar(
    "gpulock_job", default=None
)


def note_oom(size: int | None = None, *, retried: bool = False) -> None:
    """Count a CUDA OOM that the work in this executor thread handled itself (a batch split
    after one, :func:`gpulock.fastapi._batcher.run_with_splits`): the OOM back-off reacts to
    it when the job ends as to one that ended the job. Traced as event ``gpulock.oom`` on the
    call's span (``size``: the requests of the part that ran out; ``retried``: its halves run
    again under the same lease)."""
    job = _current_job.get()
    if job is not None:
        job.ooms += 1
        _tracing.note_oom(job.span, retried=retried, size=size)


def current_call_span() -> Any:
    """The OpenTelemetry span ``gpulock.call`` of the guarded call this code runs in (its
    executor thread, or a streamed body), for attributes of the route's own
    (``gen_ai.usage.*``, ...); None outside a guarded call or when tracing is absent or
    unconfigured."""
    job = _current_job.get()
    return job.span if job is not None else None


def current_lease() -> AsyncLease | None:
    """The lease the current executor thread runs under (None outside a guarded call). Work
    that makes several CUDA calls should call ``current_lease().ensure_valid()`` before each."""
    return _current_lease.get()


def _settle(
    fut: asyncio.Future[Any] | None, *, result: Any = None, exc: BaseException | None = None
) -> None:
    if fut is None or fut.done():
        return
    if exc is None:
        fut.set_result(result)
    elif isinstance(exc, asyncio.CancelledError):
        fut.cancel()
    else:
        fut.set_exception(exc)


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: no "exception was never retrieved" log for abandoned jobs


class JobRunner:
    """Starts and runs this worker's jobs.

    Args:
        settings: ``acquire_timeout``.
        backend: the executor, and the grace period left.
        admission: the thread-slot and lease waits.
        store: publishes a job's phase in its claim and keeps its result (X-Request-ID).
        retry: told of grants and hold times.
        history: where grants, releases and CUDA calls are recorded.
        spawn: runs a background task the limiter's ``stop()`` cancels.
        on_fatal: called with the message of a sticky CUDA error.
        backoff: the OOM back-off: the lease amount under its factor; told of each job's OOM
            or clean end.

    Attributes:
        by_ticket: unfinished jobs by ticket (those with an ``X-Request-ID``).
        all: every unfinished job.
        places: the places of parked jobs not yet granted, by ticket; one whose hold runs out
            with no request attached leaves the queue (the job is cancelled).
    """

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        admission: Admission,
        store: RequestStore,
        retry: RetryAfterEstimator,
        history: History,
        spawn: Callable[[Coroutine[Any, Any, Any], str], Any],
        on_fatal: Callable[[str], None],
        backoff: OomBackoff | None = None,
    ):
        self._settings = settings
        self._backend = backend
        self._admission = admission
        self._store = store
        self._retry = retry
        self._history = history
        self._spawn = spawn
        self._on_fatal = on_fatal
        self._backoff = backoff
        self.by_ticket: dict[str, Job] = {}
        self.all: set[Job] = set()
        self.places: KeptPlaces[str, KeptPlace] = KeptPlaces(
            max(settings.park_timeout, 0.001), self._place_expired
        )

    def claimed(self) -> list[Job]:
        """Unfinished jobs with a ticket, whose claims must be kept alive."""
        return [j for j in self.by_ticket.values() if j.phase != "done"]

    def cancel_waiting(self) -> list[asyncio.Task[Any]]:
        """Cancel the jobs not yet granted (they leave the queue at once); returns the tasks
        of all unfinished jobs."""
        self.places.clear()
        for job in list(self.all):
            if job.phase in ("slot", "queued") and job.task is not None:
                job.task.cancel()
        return [j.task for j in self.all if j.task is not None and not j.task.done()]

    def start(
        self,
        fn: Callable[[], Any] | LeasedStream,
        route: str,
        amount: int,
        ticket: str | None,
        fp: str,
        arrival: float,
        *,
        park: float,
        priority: int = 0,
        preemptible: bool = False,
    ) -> Job:
        """Start a job running ``fn()`` under a lease of ``amount`` bytes. ``park`` > 0 (with
        a ``ticket``): it keeps its place in :attr:`places`, first until ``acquire_timeout +
        park`` seconds from ``arrival`` (plus the restart grace left), then as long as its
        retries keep it; else it waits a little longer than the HTTP answer's deadline.
        ``priority``: the job's, in this worker's thread-slot line and the pool's queue.
        ``preemptible``: the pool may ask its lease to yield (its work sees it through
        ``current_lease().yield_requested``; a stream ends at its next chunk boundary)."""
        job = Job(
            route,
            amount,
            ticket,
            fp,
            arrival,
            parked=bool(park) and ticket is not None,
            priority=priority,
            preemptible=preemptible,
        )
        job.bucket = take_bucket()
        job.outcome = asyncio.get_running_loop().create_future()
        job.outcome.add_done_callback(_consume)
        job.outcome.add_done_callback(lambda _: job.started.set())
        if ticket is not None:
            self.by_ticket[ticket] = job
        self.all.add(job)
        # Without parking the job's own deadline is a little later than the HTTP answer's, so
        # the 503 is decided in one place (the HTTP side) and the job is then cancelled.
        # A parked job has no deadline of its own: its place's hold does (KeptPlaces), which
        # each 503 extends; in a grace period (nothing is granted before it ends) the hold
        # lasts until the grace ends and park_timeout after.
        timeout_s: float | None = self._settings.acquire_timeout + 0.5
        if job.parked:
            assert ticket is not None
            timeout_s = None
            first = self._settings.acquire_timeout + park + self._backend.grace_left()
            self.places.keep(ticket, job.place, until=arrival + first)
        job.task = asyncio.get_running_loop().create_task(
            self._run(job, fn, timeout_s), name=f"gpulock-job-{route}"
        )
        job.task.add_done_callback(_consume)  # its outcome is read from job.outcome
        return job

    def _place_expired(self, ticket: str, place: KeptPlace) -> None:
        """A parked job's hold ran out with no request attached: unless a retry on another
        worker asked for more time (:meth:`RequestStore.held`; looked at again every
        :data:`HELD_RECHECK_S` while it lasts), it leaves the queue."""
        job = self.by_ticket.get(ticket)
        if job is not None and job.place is place and job.phase in ("slot", "queued"):
            self._spawn(self._withdraw(job, ticket), "gpulock-place")

    async def _withdraw(self, job: Job, ticket: str) -> None:
        try:
            held = await self._store.held(ticket)
        except Exception:  # noqa: BLE001 - Redis unreachable: nothing is granted now anyway
            held = False
        if job.phase not in ("slot", "queued") or self.by_ticket.get(ticket) is not job:
            return
        if held or job.place.busy():  # a retry (here or elsewhere) keeps it
            self.places.keep(ticket, job.place, until=time.monotonic() + HELD_RECHECK_S)
            return
        job.abandoned = True  # before any await: a grant arriving now must not run
        if job.task is not None:
            job.task.cancel()  # leaves the thread-slot wait or the pool's queue now

    async def _run(
        self, job: Job, fn: Callable[[], Any] | LeasedStream, timeout_s: float | None
    ) -> Any:
        try:
            return await self._run_inner(job, fn, timeout_s)
        finally:
            job.started.set()

    async def _run_inner(
        self, job: Job, fn: Callable[[], Any] | LeasedStream, timeout_s: float | None
    ) -> Any:
        m = metrics()
        deadline = None if timeout_s is None else job.arrival + timeout_s
        have_slot = False
        lease: AsyncLease | None = None
        granted_at = 0.0
        try:

            def waiting(fut: asyncio.Future[None]) -> None:
                job.slot_future = fut
                if job.ticket is not None:  # its place among this worker's waiters, for followers
                    self._spawn(self._store.publish_slot_place(job), "gpulock-claim")

            await self._admission.slot(deadline, timeout_s, waiting, priority=job.priority)
            have_slot = True
            job.slot_future = None
            if job.abandoned:  # a cancellation that raced the slot hand-off (3.11 wait_for)
                raise asyncio.CancelledError()
            await self._store.set_phase(job, "queued")

            def on_queued(pos: int) -> None:
                job.position = pos
                job.estimated_wait = getattr(pos, "estimated_wait", None)  # a QueuePlace's
                job.queued.set()  # the grace period, if any, is known now (GuardedCalls)

            try:
                lease = await self._admission.lease(
                    job.amount if self._backoff is None else self._backoff.lease_amount(job.amount),
                    deadline,
                    request_id=job.ticket,
                    route=job.route,
                    on_queued=on_queued,
                    priority=job.priority,
                    preemptible=job.preemptible,
                )
            except AcquireTimeout as e:
                job.server_retry_after = e.retry_after
                raise
            granted_at = time.monotonic()
            if job.preemptible:  # only such a lease is ever asked
                lease.on_yield(lambda _: metrics().yields.labels(job.route).inc())
            if job.ticket is not None:
                self.places.discard(job.ticket, job.place)  # granted: no place to keep
            self._history.record("grant", lease, route=job.route)
            if job.abandoned:
                # The answer (503) went out while the grant was on its way: Python 3.11's
                # wait_for can return a result that raced a cancellation. Run nothing.
                raise asyncio.CancelledError()
            job.wait_s = granted_at - job.arrival
            job.leased = lease.amount
            m.acquire_wait.labels(job.route).observe(job.wait_s)
            m.grants.labels(job.route).inc()
            self._retry.granted()
            await self._store.set_phase(job, "running")
            job.started.set()
            held = lease  # for the closures below (mypy: not None from here on)
            # span gpulock.call, current in the work's threads (each runs in a copy of this
            # task's context: its spans are the call's children, current_call_span() finds it)
            with _tracing.call_span(held, job.route) as job.span:
                _current_job.set(job)  # this task's own context (an async stream body's too)
                ctx = contextvars.copy_context()
                try:
                    if isinstance(fn, LeasedStream):  # its chunks, one step each, until it ends

                        def ready(stream: LeasedStream) -> bool:
                            _settle(job.outcome, result=stream)  # the handler returns it now
                            return job.place.attached > 0  # False: nobody will send it

                        await fn.run(
                            held,
                            lambda f, check: self._thread(held, f, job, check, ctx),
                            ready,
                            self._settings.inference_timeout,
                        )
                        result = fn
                    else:
                        result = await self._thread(held, fn, job, True, ctx)
                finally:
                    if job.run_s is not None:  # a stream's: all its chunks
                        m.run.labels(job.route).observe(job.run_s)
            self._backoff_after(job, oom=job.ooms > 0)
            if job.ticket is not None:
                await self._store.store(job, result)
            _settle(job.outcome, result=result)
            return result
        except CudaOOM as e:
            m.oom.labels(job.route).inc()
            self._backoff_after(job, oom=True)
            _settle(job.outcome, exc=e)
            raise
        except CudaFatal as e:
            m.fatal.labels(job.route).inc()
            self._on_fatal(str(e))
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
                await self._release(job, lease, granted_at)
            if have_slot:
                self._admission.slots.release()
            job.phase = "done"
            job.started.set()
            self.all.discard(job)
            if job.ticket is not None:
                self.places.discard(job.ticket, job.place)
                if self.by_ticket.get(job.ticket) is job:
                    del self.by_ticket[job.ticket]
                await self._store.release_claim(job.ticket)

    def _backoff_after(self, job: Job, *, oom: bool) -> None:
        """Tell the OOM back-off how the job's work ended (in the background: a failure to
        record it loses one step of the rule, never the answer)."""
        bo = self._backoff
        if bo is None or bo.rule is None:
            return
        if not oom and (job.bucket is None or bo.scale(job.bucket) <= 1.0):
            return  # nothing to count: spawn no task

        async def record() -> None:
            try:
                await (bo.oom(job.bucket) if oom else bo.success(job.bucket))
            except Exception as e:  # noqa: BLE001 - see the docstring
                log.warning("gpulock: OOM back-off not recorded: %s", e)

        self._spawn(record(), "gpulock-backoff")

    async def _release(self, job: Job, lease: AsyncLease, granted_at: float) -> None:
        self._history.record("release", lease, route=job.route)
        # A task of its own: it goes on when this one is cancelled meanwhile (a 503, a client
        # gone, a shutdown), which is not a failed release; its outcome is reported once it is
        # known.
        rel = asyncio.ensure_future(lease.release())
        try:
            await asyncio.shield(rel)
        except asyncio.CancelledError:
            rel.add_done_callback(functools.partial(_release_done, job.route))
        except Exception:  # noqa: BLE001 - reported by _release_done
            _release_done(job.route, rel)
        if job.wait_s is not None:
            hold = time.monotonic() - granted_at
            metrics().hold.labels(job.route).observe(hold)
            self._retry.held(hold)

    async def _thread(
        self,
        lease: AsyncLease,
        fn: Callable[[], Any],
        job: Job,
        check: bool,
        ctx: contextvars.Context,
    ) -> Any:
        """``fn()`` in the executor under ``lease`` (after ``ensure_valid()`` when ``check``),
        in a copy of ``ctx`` (the job's context: its call span current); returns when the
        thread did, also when this task is cancelled meanwhile (then re-raises CancelledError
        afterwards): the lease is released only after it."""
        executor = self._backend.executor
        assert executor is not None
        afut = asyncio.wrap_future(
            executor.submit(ctx.copy().run, self._in_thread, lease, fn, job, check)
        )
        cancelled = False
        while True:
            try:
                result = await asyncio.shield(afut)
                break
            except asyncio.CancelledError:
                if afut.done():
                    raise
                cancelled = True  # keep waiting for the thread; re-raise afterwards
        if cancelled:
            raise asyncio.CancelledError()
        return result

    def _in_thread(
        self, lease: AsyncLease, fn: Callable[[], Any], job: Job, check: bool = True
    ) -> Any:
        """Run ``fn()`` in this executor thread as ``job``'s work under ``lease``: the lease
        checked first (``check``), ``current_lease()`` set, its time added to ``job.run_s``
        (observed once, when the job ends), a CUDA OOM or sticky error replaced by
        :class:`CudaOOM` / :class:`CudaFatal`."""
        tok = _current_lease.set(lease)
        jtok = _current_job.set(job)
        try:
            if check:  # the last check before the CUDA call (invariant 5 in docs/SEMANTICS.md)
                lease.ensure_valid()
            t0 = time.monotonic()
            self._history.record(
                "cuda_start", None, lease_id=lease.id, amount=lease.amount, route=job.route
            )
            try:
                return fn()
            except BaseException as e:
                if is_oom(e):
                    _tracing.note_oom(job.span, retried=False)
                    msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
                    drop_traceback(e)
                    del e
                    empty_cache()
                    raise CudaOOM(msg) from None
                if is_fatal_cuda_error(e):
                    msg = str(e).splitlines()[0][:300]
                    drop_traceback(e)
                    raise CudaFatal(msg) from None
                raise
            finally:
                job.run_s = (job.run_s or 0.0) + time.monotonic() - t0
                self._history.record(
                    "cuda_end", None, lease_id=lease.id, amount=lease.amount, route=job.route
                )
        finally:
            _current_job.reset(jtok)
            _current_lease.reset(tok)


def _release_done(route: str, rel: asyncio.Future[None]) -> None:
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
