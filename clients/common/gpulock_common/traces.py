"""The acquire and lease spans both sides make, one design for the core (over Redis) and the SDK
(over the broker): names and attributes in :mod:`gpulock_common.tracing`, docs/TRACING.md.

* :class:`AcquireSpan`: the ``gpulock.acquire`` span of one acquire, from the call to its grant
  or error. Attributes at the start: pool, amount (bytes), priority, tenant (when one), device
  (when pinned), position 0; on queueing the position on entry and a ``gpulock.queued`` event
  (position) at entry and at each change; at the end the wait (seconds from the call), the
  outcome and, on a grant, the lease id, fencing token and device; on an error the wire code
  (:func:`outcome_of`) and error status. The core's is internal and never current (a flow
  yields); the SDK's is a client span made current while its HTTP requests are sent.
* the ``gpulock.lease`` span of a held lease, kept on its
  :class:`~gpulock_common.lease.LocalLeaseState` (``span``; None when not traced), from the grant
  (:meth:`AcquireSpan.granted`) to :func:`released` or :func:`lost`, with events for its
  renewals (:func:`renewed`) and resizes (:func:`resized`). Its parent is the context current
  when the acquire began (the acquire span is its sibling); it is never current.
* :func:`traced`: a flow (the core's sans-I/O acquire) with its acquire span ended with it.

Cost while tracing is off: the caller makes an :class:`AcquireSpan` only while
:func:`~gpulock_common.tracing.recording` (:meth:`AcquireSpan.begin` returns None otherwise),
and each lease hook is a ``state.span is not None`` test. No I/O, no required dependency.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Optional, Protocol, Tuple, TypeVar

from . import tracing as t
from .errors import AcquireTimeout
from .wire import answer_for

__all__ = [
    "AcquireSpan",
    "TracedLease",
    "lost",
    "outcome_of",
    "released",
    "renewed",
    "resized",
    "traced",
]

_T = TypeVar("_T")


class TracedLease(Protocol):
    """What a lease's span reads of a :class:`~gpulock_common.lease.LocalLeaseState` subclass:
    identity, size (bytes), token, device, the server-clock expiry (``expires_at``, Unix
    seconds), its ``span``, whether it is active, and :meth:`take_span`."""

    pool: str
    lease_id: str
    amount: int
    token: int
    device: int
    span: Any

    @property
    def expires_at(self) -> float: ...
    @property
    def active(self) -> bool: ...
    def take_span(self) -> Any: ...


class _SpanHolder(Protocol):
    """What ending a lease's span needs: its span, once (:meth:`LocalLeaseState.take_span`)."""

    def take_span(self) -> Any: ...


def outcome_of(e: BaseException) -> Tuple[str, Optional[str]]:
    """``(outcome, error code)`` of a request ended by ``e``: ``timeout`` (AcquireTimeout),
    ``refused`` (any other exception), ``cancelled`` (a cancellation or interrupt: a
    BaseException that is not an Exception); the code is :mod:`gpulock_common.wire`'s (None
    where it has none, e.g. PoolClosed, or an error that is not gpulock's)."""
    if not isinstance(e, Exception):
        return "cancelled", None
    a = answer_for(e)
    return ("timeout" if isinstance(e, AcquireTimeout) else "refused"), (
        a.code if a is not None else None
    )


class AcquireSpan:
    """The ``gpulock.acquire`` span of one acquire (:meth:`begin`); ``span`` is the API's span,
    ``parent`` the context current at the call (the lease span's parent), ``start`` the local
    time of the call (seconds), ``position`` the last queue position seen (0: none)."""

    __slots__ = ("span", "parent", "start", "position", "priority", "tenant")

    def __init__(self, span: Any, parent: Any, start: float, priority: int, tenant: str):
        self.span = span
        self.parent = parent
        self.start = start
        self.position = 0
        self.priority = priority
        self.tenant = tenant

    @classmethod
    def begin(
        cls,
        pool: str,
        amount: Optional[int],
        priority: int,
        tenant: str,
        device: Optional[int],
        start: float,
        *,
        kind: str = "internal",
    ) -> Optional[AcquireSpan]:
        """Start the span of an acquire of ``amount`` bytes (None: not parsed) on ``pool`` as
        a child of the current span (``start``: the local time of the call; ``tenant``: ""
        for none; ``device``: None for any; ``kind``: ``internal`` or ``client``); None when
        tracing is off."""
        parent = t.current_context()
        span = t.start_span(
            t.ACQUIRE,
            {
                t.POOL: pool,
                t.AMOUNT: amount,
                t.PRIORITY: priority,
                t.TENANT: tenant or None,
                t.DEVICE: device,
                t.POSITION: 0,
            },
            kind=kind,
            context=parent,
        )
        return None if span is None else cls(span, parent, start, priority, tenant)

    def queued(self, position: int) -> None:
        """The request is at ``position`` (1-based) in the queue: the first sets the entry
        position (and the estimated wait, when ``position`` is a
        :class:`gpulock_common.queue.QueuePlace` that carries one); each change adds a
        ``gpulock.queued`` event with both. Safe from any thread."""
        if position == self.position:
            return
        wait = getattr(position, "estimated_wait", None)
        attrs: dict[str, Any] = {t.POSITION: int(position)}
        if wait is not None:
            attrs[t.ESTIMATED_WAIT] = float(wait)
        if self.position == 0:
            self.span.set_attributes(attrs)
        self.position = int(position)
        self.span.add_event(t.EVENT_QUEUED, attrs)

    def watching(self, on_queued: Optional[Callable[[int], Any]]) -> Callable[[int], Any]:
        """``on_queued`` (None: none) with :meth:`queued` called first."""

        def call(position: int) -> Any:
            self.queued(position)
            return None if on_queued is None else on_queued(position)

        return call

    def granted(self, state: TracedLease, now: float) -> None:
        """The request was granted ``state`` at local time ``now``: the grant's attributes,
        and the lease's span starts (unless this process traces that lease already: the same
        request id acquired again). The acquire span stays open (:meth:`end`)."""
        self.span.set_attributes(
            {
                t.WAIT: max(0.0, now - self.start),
                t.OUTCOME: "granted",
                t.LEASE_ID: state.lease_id,
                t.FENCING_TOKEN: state.token,
                t.DEVICE: state.device,
            }
        )
        if state.span is None and state.active:
            state.span = t.start_span(
                t.HOLD,
                {
                    t.POOL: state.pool,
                    t.AMOUNT: state.amount,
                    t.PRIORITY: self.priority,
                    t.TENANT: self.tenant or None,
                    t.DEVICE: state.device,
                    t.LEASE_ID: state.lease_id,
                    t.FENCING_TOKEN: state.token,
                    t.EXPIRES_AT: state.expires_at,
                },
                context=self.parent,
            )

    def failed(self, e: BaseException, now: float) -> None:
        """The request ended with ``e`` at local time ``now``: outcome, code, error status;
        ends the span."""
        outcome, code = outcome_of(e)
        t.end(
            self.span,
            {t.WAIT: max(0.0, now - self.start), t.OUTCOME: outcome, t.ERROR_CODE: code},
            error=f"{outcome}: {e}"[:200] if outcome != "cancelled" else outcome,
        )

    def end(self) -> None:
        """End the span (after :meth:`granted`)."""
        self.span.end()


def traced(
    tr: AcquireSpan, steps: Generator[Any, Any, _T], clock: Callable[[], float]
) -> Generator[Any, Any, _T]:
    """``steps`` (an acquire's sans-I/O flow, a generator; the core's) with ``tr``'s span ended
    when it returns or raises (``clock``: the local time, seconds)."""
    try:
        out = yield from steps
    except BaseException as e:
        tr.failed(e, clock())
        raise
    tr.end()
    return out


# ---- the lease's span ---------------------------------------------------------------------
def renewed(state: TracedLease) -> None:
    """A ``gpulock.renew`` event (the new expiry, Unix seconds) on ``state``'s span."""
    t.event(state.span, t.EVENT_RENEW, {t.EXPIRES_AT: state.expires_at})


def resized(
    state: TracedLease, before: int, asked: int, error: Optional[BaseException], waited: float
) -> None:
    """A ``gpulock.resize`` event on ``state``'s span: from ``before`` to ``asked`` bytes,
    its outcome (``granted``, or :func:`outcome_of` ``error``'s, with its code), and the
    seconds it took (``waited``)."""
    outcome, code = ("granted", None) if error is None else outcome_of(error)
    t.event(
        state.span,
        t.EVENT_RESIZE,
        {
            t.RESIZE_FROM: before,
            t.RESIZE_TO: asked,
            t.OUTCOME: outcome,
            t.WAIT: max(0.0, waited),
            t.ERROR_CODE: code,
        },
    )


def released(state: _SpanHolder) -> None:
    """End ``state``'s span: released (outcome ``released``)."""
    t.end(state.take_span(), {t.OUTCOME: "released"})


def lost(state: _SpanHolder, reason: str) -> None:
    """End ``state``'s span: lost for ``reason`` (a ``gpulock.lost`` event, outcome ``lost``,
    error status with the reason)."""
    sp = state.take_span()
    t.event(sp, t.EVENT_LOST)
    t.end(sp, {t.OUTCOME: "lost"}, error=reason[:200])
