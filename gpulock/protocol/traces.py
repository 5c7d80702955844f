"""OpenTelemetry spans of this process's acquires and leases (docs/TRACING.md, "Core library"),
named by :mod:`gpulock_common.tracing`. No I/O; both shells get them through the flows.

* :class:`AcquireTrace`: the ``gpulock.acquire`` span of one acquire, from the call to its
  grant or error (made by :func:`gpulock.protocol.flow.acquire` only while
  :func:`~gpulock_common.tracing.recording`; :func:`traced` ends it). Not the current span:
  nothing is attached to a context while a flow yields.
* the ``gpulock.lease`` span of a held lease (:func:`start_hold`), kept on its
  :class:`~gpulock.protocol.lease.LeaseState` (``span``; None when not traced), from the
  grant to :func:`released` or :func:`lost`, with events for its renewals (:func:`renewed`)
  and resizes (:func:`resized`). Its parent is the context that was current when the acquire
  began (the acquire span is its sibling); it is never current (it outlives the call).

Cost while tracing is off: one :func:`~gpulock_common.tracing.recording` check per acquire;
each lease hook is a ``state.span is not None`` test at its caller.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Protocol, TypeVar

from gpulock_common import tracing as t
from gpulock_common.wire import answer_for

from gpulock.errors import AcquireTimeout, GpuLockError

__all__ = [
    "AcquireTrace",
    "TracedLease",
    "lost",
    "outcome_of",
    "released",
    "renewed",
    "resized",
    "start_hold",
    "traced",
]

_T = TypeVar("_T")
# A flow (gpulock.protocol.steps.Flow; this module imports no other of the protocol's, which
# import it: the lease's state calls its hooks).
_Flow = Generator[Any, Any, _T]


class _Request(Protocol):
    """What a trace reads of an :class:`~gpulock.protocol.request.AcquireRequest`."""

    @property
    def amount(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def tenant(self) -> str: ...
    @property
    def device(self) -> int | None: ...


class TracedLease(Protocol):
    """What a trace reads of a :class:`~gpulock.protocol.lease.LeaseState`."""

    pool: str
    lease_id: str
    amount: int
    token: int
    priority: int
    tenant: str
    device: int
    expires_ms: int
    span: Any

    @property
    def active(self) -> bool: ...
    def take_span(self) -> Any: ...


def outcome_of(e: BaseException) -> tuple[str, str | None]:
    """``(outcome, error code)`` of a request ended by ``e``: ``timeout`` (AcquireTimeout),
    ``refused`` (any other exception), ``cancelled`` (a cancellation or interrupt: a
    BaseException that is not an Exception); the code is :mod:`gpulock_common.wire`'s
    (None where it has none, e.g. PoolClosed)."""
    if not isinstance(e, Exception):
        return "cancelled", None
    a = answer_for(e) if isinstance(e, GpuLockError) else None
    code = a.code if a is not None else None
    return ("timeout" if isinstance(e, AcquireTimeout) else "refused"), code


class AcquireTrace:
    """The ``gpulock.acquire`` span of one acquire (:meth:`begin`). Attributes set at the start:
    pool, amount (bytes), priority, tenant (when one), device (when pinned), position 0; on
    queueing the position on entry and a ``gpulock.queued`` event (position) at entry and at
    each change; at the end the wait (seconds from the call), the outcome and, on a grant,
    the lease id, fencing token and device; on an error the wire code and error status."""

    __slots__ = ("span", "parent", "start", "position")

    def __init__(self, span: Any, parent: Any, start: float):
        self.span = span
        self.parent = parent  # the context current at the call: the lease span's parent
        self.start = start
        self.position = 0

    @classmethod
    def begin(cls, pool: str, req: _Request, start: float) -> AcquireTrace | None:
        """Start the span of ``req`` on ``pool`` (``start``: the local time of the call), as a
        child of the current span; None when tracing is off."""
        parent = t.current_context()
        span = t.start_span(
            t.ACQUIRE,
            {
                t.POOL: pool,
                t.AMOUNT: req.amount,
                t.PRIORITY: req.priority,
                t.TENANT: req.tenant or None,
                t.DEVICE: req.device,
                t.POSITION: 0,
            },
            context=parent,
        )
        return None if span is None else cls(span, parent, start)

    def queued(self, position: int) -> None:
        """The request is at ``position`` (1-based) in the queue: the first sets the entry
        position; each change adds a ``gpulock.queued`` event. Safe from any thread."""
        if position == self.position:
            return
        if self.position == 0:
            self.span.set_attribute(t.POSITION, position)
        self.position = position
        self.span.add_event(t.EVENT_QUEUED, {t.POSITION: position})

    def watching(self, on_queued: Callable[[int], Any] | None) -> Callable[[int], Any]:
        """``on_queued`` (None: none) with :meth:`queued` called first."""

        def call(position: int) -> Any:
            self.queued(position)
            return None if on_queued is None else on_queued(position)

        return call

    def granted(self, state: TracedLease, now: float) -> None:
        """The request was granted ``state`` at local time ``now``: the grant's attributes,
        and the lease's span starts (unless this process traces that lease already: the same
        request id acquired again)."""
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
            start_hold(state, self.parent)

    def failed(self, e: BaseException, now: float) -> None:
        """The request ended with ``e`` at local time ``now``: outcome, code, error status;
        ends the span."""
        outcome, code = outcome_of(e)
        sp = self.span
        sp.set_attribute(t.WAIT, max(0.0, now - self.start))
        sp.set_attribute(t.OUTCOME, outcome)
        if code is not None:
            sp.set_attribute(t.ERROR_CODE, code)
        t.mark_error(sp, f"{outcome}: {e}"[:200] if outcome != "cancelled" else outcome)
        sp.end()


def traced(tr: AcquireTrace, steps: _Flow[_T], clock: Callable[[], float]) -> _Flow[_T]:
    """``steps`` (an acquire's flow) with ``tr``'s span ended when it returns or raises."""
    try:
        out = yield from steps
    except BaseException as e:
        tr.failed(e, clock())
        raise
    tr.span.end()
    return out


# ---- the lease's span ---------------------------------------------------------------------
def start_hold(state: TracedLease, parent: Any) -> None:
    """Start ``state``'s ``gpulock.lease`` span under ``parent`` (a context): pool, amount
    (bytes), priority, tenant (when one), device, lease id, fencing token, expiry (Unix
    seconds, server clock)."""
    state.span = t.start_span(
        t.HOLD,
        {
            t.POOL: state.pool,
            t.AMOUNT: state.amount,
            t.PRIORITY: state.priority,
            t.TENANT: state.tenant or None,
            t.DEVICE: state.device,
            t.LEASE_ID: state.lease_id,
            t.FENCING_TOKEN: state.token,
            t.EXPIRES_AT: state.expires_ms / 1000,
        },
        context=parent,
    )


def renewed(state: TracedLease) -> None:
    """A ``gpulock.renew`` event (the new expiry, Unix seconds) on ``state``'s span."""
    sp = state.span
    if sp is not None:
        sp.add_event(t.EVENT_RENEW, {t.EXPIRES_AT: state.expires_ms / 1000})


def resized(
    state: TracedLease, before: int, asked: int, error: BaseException | None, waited: float
) -> None:
    """A ``gpulock.resize`` event on ``state``'s span: from ``before`` to ``asked`` bytes,
    its outcome (``granted``, or :func:`outcome_of` ``error``'s, with its code), and the
    seconds it took (``waited``)."""
    sp = state.span
    if sp is None:
        return
    outcome, code = ("granted", None) if error is None else outcome_of(error)
    attrs: dict[str, Any] = {
        t.RESIZE_FROM: before,
        t.RESIZE_TO: asked,
        t.OUTCOME: outcome,
        t.WAIT: max(0.0, waited),
    }
    if code is not None:
        attrs[t.ERROR_CODE] = code
    sp.add_event(t.EVENT_RESIZE, attrs)


def released(state: TracedLease) -> None:
    """End ``state``'s span: released (outcome ``released``)."""
    sp = state.take_span()
    if sp is not None:
        sp.set_attribute(t.OUTCOME, "released")
        sp.end()


def lost(state: TracedLease, reason: str) -> None:
    """End ``state``'s span: lost for ``reason`` (a ``gpulock.lost`` event, outcome ``lost``,
    error status with the reason)."""
    sp = state.take_span()
    if sp is not None:
        sp.add_event(t.EVENT_LOST)
        sp.set_attribute(t.OUTCOME, "lost")
        t.mark_error(sp, reason[:200])
        sp.end()
