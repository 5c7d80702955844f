"""The integration's OpenTelemetry spans (names in :mod:`gpulock_common.tracing`; the trace
they make: docs/TRACING.md, "FastAPI integration"). Each helper costs one check and builds no
attribute when tracing is absent or unconfigured (:func:`gpulock_common.tracing.recording`).

* :func:`local_wait`: span ``gpulock.admission``, a guarded call's wait for one of its
  worker's thread slots (before the core's ``gpulock.acquire``);
* :func:`call_span`: span ``gpulock.call``, the work of one guarded call under its lease;
* :func:`batch_span`: span ``gpulock.batch``, one batch from its closing to its end, linked to
  each member request's span (:func:`request_span` captures it when the request joins), each
  of which gets an event ``gpulock.batched`` naming the batch span;
* :func:`note_oom`: event ``gpulock.oom`` on a call span.

Every OpenTelemetry call goes through :mod:`gpulock_common.tracing` (its cached tracer, its
links, contexts and ids): this module imports nothing of OpenTelemetry itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from gpulock_common import tracing as tr

from gpulock._async import AsyncLease
from gpulock.errors import AcquireTimeout


class LocalWait:
    """One thread-slot wait as its span sees it (``span`` None: nothing is recorded)."""

    __slots__ = ("span",)

    def __init__(self, span: Any = None):
        self.span = span

    def waiting(
        self,
        on_wait: Callable[[asyncio.Future[None]], None],
        position: Callable[[asyncio.Future[None]], int],
    ) -> Callable[[asyncio.Future[None]], None]:
        """``on_wait`` (a :meth:`Slots.acquire` callback) that first records the waiter's
        1-based place (``position(future)``) on the span as ``gpulock.local.position``."""
        sp = self.span
        if sp is None:
            return on_wait

        def recorded(fut: asyncio.Future[None]) -> None:
            sp.set_attribute(tr.LOCAL_POSITION, position(fut))
            on_wait(fut)

        return recorded


_NOT_RECORDED = LocalWait()


@contextlib.contextmanager
def local_wait(priority: int) -> Iterator[LocalWait]:
    """Span ``gpulock.admission`` around one wait for a thread slot: ``gpulock.priority``,
    ``gpulock.local.position`` (0 unless :meth:`LocalWait.waiting` recorded a place),
    ``gpulock.local.wait_s`` (seconds) and ``gpulock.outcome`` (``granted``, ``timeout`` for
    AcquireTimeout, else ``cancelled``), set when the block ends."""
    if not tr.recording():
        yield _NOT_RECORDED
        return
    t0 = time.monotonic()
    with tr.span(tr.ADMISSION, {tr.PRIORITY: priority, tr.LOCAL_POSITION: 0}) as sp:
        outcome = "cancelled"
        try:
            yield LocalWait(sp)
            outcome = "granted"
        except AcquireTimeout:
            outcome = "timeout"
            raise
        finally:
            if sp is not None:
                sp.set_attribute(tr.LOCAL_WAIT, time.monotonic() - t0)
                sp.set_attribute(tr.OUTCOME, outcome)


@contextlib.contextmanager
def call_span(lease: AsyncLease, route: str, *, stream: bool = False) -> Iterator[Any]:
    """Span ``gpulock.call`` (current for the block) around the work of one guarded call under
    ``lease``: ``gpulock.pool``, ``gpulock.route``, ``gpulock.amount_bytes`` (the lease's, after
    the OOM back-off), ``gpulock.lease.id``, ``gpulock.lease.fencing_token``,
    ``gpulock.device``. Yields the span, or None when nothing is recorded. An exception leaving
    the block is recorded on it (status error); a cancellation is not."""
    if not tr.recording():
        yield None
        return
    attrs = {
        tr.POOL: lease.pool,
        tr.ROUTE: route,
        tr.AMOUNT: lease.amount,
        tr.LEASE_ID: lease.id,
        tr.FENCING_TOKEN: lease.token,
        tr.DEVICE: lease.device,
    }
    with tr.span(tr.CALL, attrs) as sp:
        yield sp


def note_oom(span: Any, *, retried: bool, size: int | None = None) -> None:
    """Event ``gpulock.oom`` on ``span`` (a call span; None: nothing): ``gpulock.oom.retried``
    and, for a batch's part, ``gpulock.batch.size``."""
    if span is None:
        return
    tr.event(span, tr.EVENT_OOM, {tr.OOM_RETRIED: retried, tr.BATCH_SIZE: size})


def request_span() -> Any:
    """The current span (a request joining a batch: its request's span), or None when nothing
    is recorded or no span is current."""
    return tr.current_span()


class BatchSpan:
    """A started ``gpulock.batch`` span: :meth:`current` makes it the current span of the
    block (a job started in it runs as the batch's), :meth:`end` ends it."""

    __slots__ = ("span",)

    def __init__(self, span: Any):
        self.span = span

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        # a fresh context: the batch is a trace of its own, whatever ran before in this task
        with tr.use(self.span, tr.root_context() if self.span is not None else None):
            yield

    def end(self, error: BaseException | None = None) -> None:
        """End the span; ``error`` (not a cancellation) is recorded on it first."""
        if self.span is None:
            return
        if error is not None and isinstance(error, Exception):
            tr.record_error(self.span, error)
        self.span.end()


def batch_span(
    route: str,
    pool: str,
    members: list[Any],
    *,
    amount: int,
    reason: str,
    priority: int,
) -> BatchSpan:
    """Start span ``gpulock.batch`` for a batch of ``len(members)`` requests, the root of a
    trace of its own: ``gpulock.pool``, ``gpulock.route``, ``gpulock.batch.size``,
    ``gpulock.amount_bytes`` (its estimate), ``gpulock.batch.reason`` (why it closed),
    ``gpulock.priority``; a link to each member's span (``members``: the spans
    :func:`request_span` captured, None for one without), and on each of those an event
    ``gpulock.batched`` with the batch span's ``gpulock.batch.trace_id``,
    ``gpulock.batch.span_id`` and ``gpulock.batch.size``."""
    if not tr.recording():
        return BatchSpan(None)
    attrs: dict[str, Any] = {
        tr.POOL: pool,
        tr.ROUTE: route,
        tr.BATCH_SIZE: len(members),
        tr.AMOUNT: amount,
        tr.BATCH_REASON: reason,
        tr.PRIORITY: priority,
    }
    sp = tr.start_span(tr.BATCH, attrs, context=tr.root_context(), links=members)
    trace_id, span_id = tr.span_ids(sp)
    event = {tr.BATCH_TRACE_ID: trace_id, tr.BATCH_SPAN_ID: span_id, tr.BATCH_SIZE: len(members)}
    for m in members:
        tr.event(m, tr.EVENT_BATCHED, event)
    return BatchSpan(sp)
