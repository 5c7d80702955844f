"""Dynamic batching of one route: requests queue in this worker and run together, as one job
under one lease (the job runner's), through a batch function ``list[request] -> list[result]``.

A batch opens with the first request waiting and closes when it holds ``max_size`` requests,
when it has been open ``max_wait`` seconds (counted while no earlier batch of the route still
waits for a thread or its lease: behind one, it could not start sooner, so it grows), when the next request would make its estimate
larger than the room the pool would grant now (capacity - used - the bytes queued ahead,
from the limiter's last status read and, before closing for room, one status read now), or
when this worker could run it now (a free executor thread and none of this route's batches
waiting): a batch only waits for company while it would wait anyway, so a lone request costs
no wait. The closed batch leases its estimate (``estimate_batch`` of its requests) and runs in
the executor; each request gets its own result or error.

Per request: validation (the route's ``estimate``) runs before a request joins; its own
deadlines count from its own arrival (503 / 504 / 499 as for any guarded call); one that
leaves before its batch runs is dropped from it (the batch is cancelled when all did); a CUDA
OOM of a batch splits it in halves, retried under the same lease, at most ``max_splits``
levels deep, and a request that still runs out alone gets its own 503. A request carrying
``X-Request-ID`` runs alone (its claim, parking and stored result are per request). A batch
queues (for a thread, then in the pool) with the highest priority among its requests; the
route's waiting line itself is first come first served.

The closing decision (:func:`decide`), the room (:func:`room_now`) and the split plan
(:func:`split_plan`) do no I/O; :class:`Batcher` drives them."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fastapi import Request, Response
from gpulock_common.aio import wait_for

from gpulock.http.disconnect import _Gone, _wait_or_gone
from gpulock.protocol.replies import PoolStatus
from gpulock.cuda import drop_traceback, empty_cache, is_oom
from gpulock.errors import AcquireTimeout, InvalidArgument
from ._admission import Slots
from ._backend import Backend
from ._call import GuardedCalls
from ._errors import CudaOOM, GpuLockHTTPException, HttpErrors
from ._job import Job
from ._jobs import JobRunner, current_lease, note_oom
from ._metrics import metrics
from ._priority import RoutePriority
from ._settings import Settings
from ._signature import _fingerprint
from . import _tracing

R = TypeVar("R")

# ---- the decisions (no I/O) ----------------------------------------------------------------------

#: what :func:`decide` answers: take the next request, wait for one, or close for a reason
JOIN, WAIT = "join", "wait"
FULL, ROOM, TIMEOUT, IDLE = "full", "room", "timeout", "idle"


@dataclass(frozen=True)
class BatchPolicy:
    """How a route batches.

    Attributes:
        max_size: most requests in one batch (≥ 1).
        max_wait_s: most seconds a batch stays open for more requests (≥ 0).
        max_splits: levels of halving after a CUDA OOM (0: none); None: enough to reach
            single requests (``ceil(log2(max_size))``).

    Raises: InvalidArgument for a size < 1, a negative or non-finite wait, negative splits.
    """

    max_size: int
    max_wait_s: float
    max_splits: int | None = None

    def __post_init__(self) -> None:
        if int(self.max_size) != self.max_size or self.max_size < 1:
            raise InvalidArgument(f"max_size must be an integer >= 1, got {self.max_size!r}")
        if not math.isfinite(self.max_wait_s) or self.max_wait_s < 0:
            raise InvalidArgument(f"max_wait must be >= 0 and finite, got {self.max_wait_s!r}")
        if self.max_splits is not None and self.max_splits < 0:
            raise InvalidArgument(f"max_splits must be >= 0, got {self.max_splits!r}")

    @property
    def split_levels(self) -> int:
        """Levels of halving after an OOM."""
        if self.max_splits is not None:
            return self.max_splits
        return max(0, math.ceil(math.log2(self.max_size)))


def room_now(st: PoolStatus | None) -> int | None:
    """Bytes the pool would grant a request that arrived at the read ``st``: its free bytes
    less the bytes of the requests queued ahead (grants are FIFO); 0 when the queue is longer
    than the waiters ``st`` lists; None without a read."""
    if st is None:
        return None
    if st.waiter_count and len(st.waiters) < st.waiter_count:
        return 0
    return max(0, st.free - sum(w.amount for w in st.waiters))


def decide(
    policy: BatchPolicy,
    *,
    size: int,
    waited_s: float,
    next_bytes: int | None,
    room: int | None,
    idle: bool,
    ahead: bool = False,
) -> str:
    """What an open batch of ``size`` requests, open ``waited_s`` seconds, does next.

    ``next_bytes``: the batch's estimate with the next waiting request added (None: none
    waits); ``room``: :func:`room_now` (None: unknown, no bound); ``idle``: the worker could
    run the batch now; ``ahead``: a batch of the route closed before it still waits for a
    thread or its lease (this one could not start sooner: it stays open, growing, and its wait
    counts from when none is ahead). Answers :data:`JOIN` (take the next request),
    :data:`WAIT` (for one, or for the time to pass), or the reason to close: :data:`FULL`,
    :data:`ROOM` (the next request would need more than the room; never for an empty batch: a
    first request always joins and waits in the pool's queue like any other),
    :data:`TIMEOUT`, :data:`IDLE`."""
    if size >= policy.max_size:
        return FULL
    if next_bytes is not None:
        if size > 0 and room is not None and next_bytes > room:
            return ROOM
        return JOIN
    if size == 0 or ahead:
        return WAIT
    if waited_s >= policy.max_wait_s:
        return TIMEOUT
    if idle:
        return IDLE
    return WAIT


def split_plan(n: int, depth: int, levels: int) -> list[tuple[int, int]] | None:
    """After a CUDA OOM of ``n`` requests at split ``depth`` (0: the whole batch): the halves
    to retry, as ``[(start, stop), (start, stop)]`` slices, or None when ``n`` is 1 or
    ``levels`` splits were made already (each request of it then fails alone)."""
    if n <= 1 or depth >= levels:
        return None
    half = n // 2
    return [(0, half), (half, n)]


# ---- the driving (asyncio) -----------------------------------------------------------------------

_DROPPED = object()  # the result slot of a request dropped from its batch before it ran


@dataclass(eq=False)
class _Entry:
    """One request waiting in, or run by, a batch (times: ``time.monotonic()``)."""

    item: Any
    amount: int
    arrival: float
    joined: float
    dispatched: asyncio.Future[tuple[Job, int]]  # its batch's job and its index in it
    dropped: bool = False
    batch: _Batch | None = None
    priority: int = 0  # its request's (the route's, or its header's)
    span: Any = None  # its request's OpenTelemetry span when it joined (None: not traced)


@dataclass(eq=False)
class _Batch:
    entries: list[_Entry]
    job: Job
    open: int = 0  # entries still waiting for their answer
    results: list[Any] = field(default_factory=list)


class Batcher(Generic[R]):
    """The batching of one route in one worker: ``await batcher.submit(item, request=...,
    response=...)`` from any async route handler (``GpuLimiter.batcher`` makes one).

    Args:
        route: the route's name (metrics, history, the lease's holder).
        fn: the batch function, run in the executor under the batch's lease: a list of
            requests → a sequence of as many results, in order; an exception instance in
            place of a result is that request's error (an ``HTTPException`` is answered as
            such, a :class:`CudaOOM` as 503, anything else as 500).
        estimate: one request → bytes (int or a size string); runs on the event loop before
            the request joins: raise an ``HTTPException`` to refuse it.
        estimate_batch: requests → the batch's bytes (default: the sum of their estimates);
            a padded model needs its own (``batch × the longest``).
        policy: sizes, wait, splits.
        param: the name the item's ``X-Request-ID`` fingerprint is taken under (the name of
            the parameter an ``endpoint`` handler would take it as gives the same one).
        priority: the route's priority and the most a request's header may ask; a batch
            queues with the highest priority among its requests.
        preemptible: the pool may ask a batch's lease to yield (``GpuLimiter.batcher``).
        settings, backend, slots, runner, calls, errors, spawn: the limiter's parts.
    """

    def __init__(
        self,
        route: str,
        fn: Callable[[list[R]], Sequence[Any]],
        estimate: Callable[[R], int | str],
        estimate_batch: Callable[[list[R]], int] | None,
        policy: BatchPolicy,
        *,
        param: str = "item",
        priority: RoutePriority | None = None,
        preemptible: bool = False,
        settings: Settings,
        backend: Backend,
        slots: Slots,
        runner: JobRunner,
        calls: GuardedCalls,
        errors: HttpErrors,
        spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
    ):
        if policy.max_wait_s > settings.acquire_timeout:
            raise InvalidArgument(
                f"max_wait ({policy.max_wait_s}s) must not exceed acquire_timeout "
                f"({settings.acquire_timeout}s)"
            )
        self.route, self.policy, self._param = route, policy, param
        self.priority = priority or RoutePriority()
        self.preemptible = preemptible
        self._fn, self._estimate, self._estimate_batch = fn, estimate, estimate_batch
        self._settings, self._backend, self._slots = settings, backend, slots
        self._runner, self._calls, self._errors, self._spawn = runner, calls, errors, spawn
        self._pending: deque[_Entry] = deque()
        self._inflight: set[_Batch] = set()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[Any] | None = None
        self.splits = 0  # batches split after an OOM (tests)
        self.joined = 0  # requests that joined the waiting line (tests)

    # ---- the HTTP side -----------------------------------------------------------------------

    async def submit(
        self,
        item: R,
        *,
        request: Request | None = None,
        response: Response | None = None,
        amount: int | str | None = None,
        request_id: str | None = None,
    ) -> Any:
        """Run ``item`` in a batch and return its own result; the errors are those of
        ``GpuLimiter.calls.call`` (as :class:`GpuLockHTTPException`), plus what ``estimate``
        raises (before the request joins) and the request's own error from the batch function.
        ``amount`` (default ``estimate(item)``) is the request's bytes; a request with
        ``request_id`` (default: its ``X-Request-ID``) runs alone."""
        self._calls.admit(self.route)
        amt = self._estimate(item) if amount is None else amount
        return await self._calls.call(
            functools.partial(self._run_alone, item),
            route=self.route,
            amount=amt,
            request=request,
            response=response,
            request_id=request_id,
            fingerprint_of=lambda: _fingerprint(self.route, {self._param: item}),
            run=functools.partial(self._join, item),
            priority=self.priority,
            preemptible=self.preemptible,
        )

    async def _join(
        self,
        item: R,
        amount: int,
        arrival: float,
        response: Response | None,
        gone: asyncio.Task[bool] | None,
        priority: int = 0,
    ) -> Any:
        loop = asyncio.get_running_loop()
        entry = _Entry(
            item, amount, arrival, time.monotonic(), loop.create_future(), priority=priority
        )
        entry.span = _tracing.request_span()  # for its batch's link (None: not traced)
        self._pending.append(entry)
        self.joined += 1
        self._ensure_driver().set()
        remaining = arrival + self._settings.acquire_timeout - time.monotonic()
        try:
            await _wait_or_gone(asyncio.shield(entry.dispatched), max(0.0, remaining), gone)
        except _Gone:
            self._leave(entry)
            raise self._errors.client_gone(self.route, "waiting") from None
        except asyncio.TimeoutError:
            if not entry.dispatched.done():
                # its batch never closed in time (it grew behind one of the route still
                # waiting for a thread or its lease): answered as a queue timeout, with the
                # Retry-After of a place behind the pool's queue and that batch
                self._leave(entry)
                # (a batch ahead already in the pool's queue is counted in queued(); one still
                # waiting for a thread is not)
                slot = any(b.job.phase == "slot" for b in self._inflight)
                place = self._backend.queued() + 1 + (1 if slot else 0)
                fut: asyncio.Future[Any] = loop.create_future()
                fut.set_exception(AcquireTimeout("no batch closed in time", position=place))
                return self._errors.outcome(fut, self.route, amount, lambda: place)  # raises
        except BaseException:
            self._leave(entry)
            raise
        if entry.dispatched.cancelled():
            raise GpuLockHTTPException(
                503, "the request was cancelled (worker shutting down)", "not_ready"
            )
        job, index = entry.dispatched.result()
        batch = entry.batch
        assert batch is not None
        results: Sequence[Any] | None = None
        try:
            results = await self._calls.await_job(job, arrival, response, gone, own=amount)
        except BaseException as e:
            refused = isinstance(e, GpuLockHTTPException) and e.status_code == 413
            if not refused or len(batch.entries) < 2:  # else: the batch's bytes, see below
                if job.phase in ("slot", "queued"):
                    self._leave(entry)
                raise
        finally:
            batch.open -= 1
            if batch.open == 0:
                job.place.attached -= 1  # the batch's own hold (see _dispatch)
        if results is None:
            # The batch closed on a room read before the pool's resident leases took theirs
            # (413: the batch can never fit next to them); each of its requests may still fit
            # alone, and runs alone, within its own deadline (one that cannot gets its own 413).
            alone = self._runner.start(
                functools.partial(self._run_alone, entry.item),
                self.route,
                amount,
                None,
                "",
                arrival,
                park=0.0,
                priority=entry.priority,
                preemptible=self.preemptible,
            )
            return await self._calls.await_job(alone, arrival, response, gone)
        out = results[index]
        if isinstance(out, BaseException):
            if isinstance(out, CudaOOM):
                metrics().oom.labels(self.route).inc()
            fut = loop.create_future()
            fut.set_exception(out)
            return self._errors.outcome(fut, self.route, amount, lambda: 0)
        return out

    def _leave(self, entry: _Entry) -> None:
        """``entry``'s request left before its batch ran: drop it (from the waiting line, or
        from its batch; a batch that all its requests left is cancelled)."""
        entry.dropped = True
        with contextlib.suppress(ValueError):
            self._pending.remove(entry)
        b = entry.batch
        if b is None or not all(e.dropped for e in b.entries):
            return
        job = b.job
        if job.phase in ("slot", "queued") and job.task is not None:
            job.abandoned = True  # before any await: a grant arriving now must not run
            job.task.cancel()

    # ---- the driver --------------------------------------------------------------------------

    def _ensure_driver(self) -> asyncio.Event:
        if self._wake is None or self._task is None or self._task.done():
            self._wake = asyncio.Event()
            # in an empty context: the driver serves every request, not the one that woke it
            self._task = contextvars.Context().run(
                self._spawn, self._drive(self._wake), f"gpulock-batcher-{self.route}"
            )
        return self._wake

    def _head(self) -> _Entry | None:
        while self._pending and self._pending[0].dropped:
            self._pending.popleft()
        return self._pending[0] if self._pending else None

    def _ahead(self) -> bool:
        """A batch of this route waits for a thread or its lease."""
        return any(b.job.phase in ("slot", "queued") for b in self._inflight)

    def _idle(self) -> bool:
        s = self._slots
        return s.free > 0 and not s.waiters and not self._ahead()

    def _bytes(self, items: list[R]) -> int:
        from gpulock.units import parse_size

        if self._estimate_batch is not None:
            return int(self._estimate_batch(items))
        return sum(parse_size(self._estimate(i), name="estimate") for i in items)

    async def _drive(self, wake: asyncio.Event) -> None:
        forming: list[_Entry] = []  # the batch being formed (popped from the waiting line)
        try:
            while True:
                while self._head() is None:
                    wake.clear()
                    await wake.wait()
                forming.clear()
                reason = await self._form(wake, forming)
                self._dispatch([e for e in forming if not e.dropped], reason)
                forming.clear()
        finally:  # stopped (GpuLimiter.stop): who still waits gets 503 not_ready
            for e in [*forming, *self._pending]:
                e.dispatched.cancel()
            self._pending.clear()

    async def _form(self, wake: asyncio.Event, batch: list[_Entry]) -> str:
        """Fill ``batch`` from the waiting line until :func:`decide` closes it; the reason."""
        opened = time.monotonic()
        room, fresh = room_now(self._backend.status), False
        while True:
            batch[:] = [e for e in batch if not e.dropped]
            nxt = self._head()
            try:
                next_bytes = self._bytes([e.item for e in [*batch, nxt]]) if nxt else None
            except Exception:  # noqa: BLE001 - the user's estimate: close; the batch alone says
                next_bytes, room = 1, 0
            ahead = self._ahead()
            if ahead or not batch:
                opened = time.monotonic()  # the wait counts while nothing of ours is ahead
            waited = time.monotonic() - opened
            reason = decide(
                self.policy,
                size=len(batch),
                waited_s=waited,
                next_bytes=next_bytes,
                room=room,
                idle=self._idle(),
                ahead=ahead,
            )
            if reason == ROOM and not fresh and self._backend.pool is not None:
                fresh = True  # ask the pool before closing for room
                with contextlib.suppress(Exception):
                    room = room_now(await self._backend.pool.status(limit=64))
                continue
            if reason == JOIN:
                batch.append(self._pending.popleft())
                continue
            if reason != WAIT:
                return reason
            wake.clear()
            timeout = None if not batch or ahead else max(0.0, self.policy.max_wait_s - waited)
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(wake.wait(), timeout)

    def _dispatch(self, entries: list[_Entry], reason: str) -> None:
        if not entries:
            return
        m = metrics()
        items = [e.item for e in entries]
        try:
            amount = self._bytes(items)
        except Exception as e:  # noqa: BLE001 - the user's estimate: each request gets the error
            for en in entries:
                en.dispatched.set_exception(e)
            return
        now = time.monotonic()
        m.batches.labels(self.route, reason).inc()
        m.batch_size.labels(self.route).observe(len(entries))
        m.batch_bytes.labels(self.route).observe(amount)
        for en in entries:
            m.batch_wait.labels(self.route).observe(now - en.joined)
        arrival = max(en.arrival for en in entries)  # the job's deadline: its latest request's
        priority = max(en.priority for en in entries)
        traced = _tracing.batch_span(
            self.route,
            self._settings.pool_name,
            [en.span for en in entries],
            amount=amount,
            reason=reason,
            priority=priority,
        )
        with traced.current():  # the job's spans (wait, lease, call) are the batch's children
            job = self._runner.start(
                functools.partial(self._run_entries, entries),
                self.route,
                amount,
                None,
                "",
                arrival,
                park=0.0,
                priority=priority,
                preemptible=self.preemptible,
            )
        b = _Batch(entries, job, open=len(entries))
        # The batch holds an attachment of its own while any request waits on it, so that no
        # single request leaving cancels it for the others (_leave cancels it when all left).
        job.place.attached += 1
        self._inflight.add(b)
        wake = self._wake

        def done(_: object) -> None:
            self._inflight.discard(b)
            if wake is not None:
                wake.set()

        assert job.task is not None
        job.task.add_done_callback(done)
        job.task.add_done_callback(lambda t: traced.end(None if t.cancelled() else t.exception()))
        # and when it starts running: the batch forming behind it may close now
        started = asyncio.ensure_future(job.started.wait())
        started.add_done_callback(lambda _: wake.set() if wake is not None else None)
        job.task.add_done_callback(lambda _: started.cancel())
        for i, en in enumerate(entries):
            en.batch = b
            en.dispatched.set_result((job, i))

    # ---- in the executor thread --------------------------------------------------------------

    def _run_entries(self, entries: list[_Entry]) -> list[Any]:
        """The batch's work: its requests still waiting, split after an OOM; one result (or
        error) per entry, :data:`_DROPPED` for those that left."""
        out: list[Any] = [_DROPPED] * len(entries)
        live = [i for i, e in enumerate(entries) if not e.dropped]
        if live:
            res = run_with_splits(self._fn, [entries[i].item for i in live], **self._split_kw())
            for i, r in zip(live, res):
                out[i] = r
        return out

    def _run_alone(self, item: R) -> Any:
        (out,) = run_with_splits(self._fn, [item], **self._split_kw())
        if isinstance(out, BaseException):
            raise out
        return out

    def _split_kw(self) -> dict[str, Any]:
        def split() -> None:
            self.splits += 1
            metrics().batch_splits.labels(self.route).inc()
            lease = current_lease()
            if lease is not None:
                lease.ensure_valid()  # the halves run under the same lease: still ours?

        return {"levels": self.policy.split_levels, "on_split": split, "route": self.route}


def run_with_splits(
    fn: Callable[[list[R]], Sequence[Any]],
    items: list[R],
    *,
    levels: int,
    on_split: Callable[[], None] = lambda: None,
    route: str = "",
) -> list[Any]:
    """``fn(items)`` as a list of one result per item; after a CUDA OOM (``is_oom``) the
    traceback is dropped, the cache emptied and the halves (:func:`split_plan`) run in turn,
    at most ``levels`` deep; each item of a part that still runs out of memory gets a
    :class:`CudaOOM` as its result. ``on_split()`` runs before each split's halves (it may
    raise, e.g. LeaseLost). Runs in the executor thread.

    Raises: what ``fn`` raises other than an OOM; TypeError when ``fn`` returns a sequence of
    another length."""
    out: list[Any] = [None] * len(items)

    def part(idx: list[int], depth: int) -> None:
        try:
            res = list(fn([items[i] for i in idx]))
            if len(res) != len(idx):
                raise TypeError(
                    f"the batch function of route {route!r} returned {len(res)} results for "
                    f"{len(idx)} requests"
                )
        except BaseException as e:
            if not is_oom(e):
                raise  # the job runner's handling: a sticky CUDA error, or the batch's 500
            plan = split_plan(len(idx), depth, levels)
            # the batch's estimate was too low: the OOM back-off reacts at its end
            note_oom(len(idx), retried=plan is not None)
            msg = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            drop_traceback(e)
            del e
            empty_cache()
            if plan is None:
                for i in idx:
                    out[i] = CudaOOM(msg)
                return
            on_split()
            for lo, hi in plan:
                part(idx[lo:hi], depth + 1)
            return
        for i, r in zip(idx, res):
            out[i] = r

    part(list(range(len(items))), 0)
    return out
