"""A lease's local validity: the rule for its deadline, its local state, and the lease object's
read-only surface. The core (``gpulock``, renewing over Redis) and the SDK (``gpulock_client``,
renewing over the broker's HTTP API) each subclass :class:`LocalLeaseState` and
:class:`LeaseView` with what their grants carry; the deadline, the lost/released states, the
``on_lost`` callbacks and a yield request (preemption: ``yield_requested``, ``yield_deadline``,
the ``on_yield`` callbacks) are these.

The rule is Chubby's (Burrows 2006, §2.8): the holder's view of a lease must end before the
server's. The span the server granted is counted from when the successful request was *sent*
(so its flight time is on the holder's side), shrunk by an assumed bound on the clock-rate
difference between the two hosts (:data:`CLOCK_DRIFT`), less a fixed margin for scheduling
delays (:data:`SAFETY_MARGIN_S`). Invariant 5 in gpulock's docs/SEMANTICS.md.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, ClassVar, Iterable, List, Optional

from .errors import LeaseLost

__all__ = [
    "CLOCK_DRIFT",
    "SAFETY_MARGIN_S",
    "reply_made_after",
    "validity_deadline",
    "LocalLeaseState",
    "LeaseView",
    "default_clock",
]

#: Assumed bound on the rate difference between the holder's clock and the server's: 1%, far
#: above NTP-disciplined oscillators (tens of ppm).
CLOCK_DRIFT = 0.01
#: Seconds taken off every deadline for scheduling delays on the holder's side.
SAFETY_MARGIN_S = 0.05

Clock = Callable[[], float]

# Passed for no owner: on_lost callbacks then take no argument (None is a valid owner).
_NO_OWNER: Any = object()


def reply_made_after(sent: float, held_s: float = 0.0) -> float:
    """The earliest local instant (seconds, the holder's monotonic clock) at which the reply can
    have been made: ``sent`` plus the time the server says it held the request (``held_s``,
    seconds on its clock, e.g. a long poll's wait) shrunk by :data:`CLOCK_DRIFT`. A negative
    ``held_s`` counts as 0."""
    return sent + max(0.0, held_s) * (1.0 - CLOCK_DRIFT)


def validity_deadline(sent: float, span_s: float, held_s: float = 0.0) -> float:
    """The local validity deadline (seconds, the holder's monotonic clock) of a grant or
    renewal: the server's remaining span ``span_s`` (seconds on its clock, at its reply; a
    negative one counts as 0), counted from :func:`reply_made_after` ``(sent, held_s)``,
    shrunk by :data:`CLOCK_DRIFT`, less :data:`SAFETY_MARGIN_S`. It is always before the
    server's expiry as the holder's clock sees it, given the drift bound."""
    return reply_made_after(sent, held_s) + max(0.0, span_s) * (1.0 - CLOCK_DRIFT) - SAFETY_MARGIN_S


class LocalLeaseState:
    """What a holder knows of one lease locally: identity, size, fencing token, the validity
    deadline, and whether it is active, lost or released. Thread-safe: the heartbeat may run in
    another thread (or task) than the holder.

    Attributes: ``pool`` (name), ``lease_id`` (32 hex digits), ``amount`` (bytes), ``token``
    (fencing token), ``ttl_s`` (seconds), ``valid_until`` (the holder's monotonic clock,
    seconds; see :func:`validity_deadline`), ``lost_reason`` (None while not lost),
    ``released``, ``span`` (its ``gpulock.lease`` OpenTelemetry span while traced, else None:
    :mod:`gpulock_common.traces`; a loss ends it), ``yield_deadline`` (None until the server
    asked the holder to yield the lease to a higher-priority request; then the holder's
    monotonic clock, seconds, by which the server takes the bytes back at the latest:
    :meth:`mark_yield`). The subclass sets :attr:`unreachable` (what the holder renews through) and
    :attr:`log` (where a raising callback is logged), and may override :meth:`_report_lost`.
    """

    __slots__ = (
        "pool",
        "lease_id",
        "amount",
        "token",
        "ttl_s",
        "valid_until",
        "lost_reason",
        "released",
        "unrenewed",
        "span",
        "yield_deadline",
        "_clock",
        "_callbacks",
        "_yield_callbacks",
        "_lock",
        "__weakref__",
    )

    #: Named in the reason of a lease lost to its local deadline: "(X unreachable, or ...)".
    unreachable: ClassVar[str] = "the server"
    log: ClassVar[logging.Logger] = logging.getLogger("gpulock_common")

    def __init__(
        self,
        pool: str,
        lease_id: str,
        amount: int,
        token: int,
        ttl_s: float,
        valid_until: float,
        clock: Clock,
    ):
        self.pool = pool
        self.lease_id = lease_id
        self.amount = amount
        self.token = token
        self.ttl_s = ttl_s
        self.valid_until = valid_until
        self.lost_reason: Optional[str] = None
        self.released = False
        #: Why nothing renews it any more, when its pool object was closed (see stop_renewal).
        self.unrenewed: Optional[str] = None
        self.span: Any = None
        self.yield_deadline: Optional[float] = None
        self._clock = clock
        self._callbacks: List[Callable[[], Any]] = []  # each already bound to its owner
        self._yield_callbacks: List[Callable[[], Any]] = []  # likewise
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Neither lost (as far as known) nor released."""
        return self.lost_reason is None and not self.released

    def expired_locally(self) -> bool:
        """Active, and the clock has reached ``valid_until``."""
        return self.active and self._clock() >= self.valid_until

    @property
    def lost(self) -> bool:
        """Marked lost, or active past its deadline (not yet marked)."""
        return self.lost_reason is not None or self.expired_locally()

    def check(self) -> None:
        """Return if the lease is surely still held; else raise. Past the deadline it is marked
        lost first (which fires the callbacks). Cost: a clock read.

        Raises:
            LeaseLost: lost (its ``reason`` says why), past its deadline, or released.
        """
        if self.expired_locally():
            self.mark_lost(
                self.deadline_passed_reason(
                    self.unrenewed or f"{self.unreachable} unreachable, or this process was paused"
                )
            )
        if self.lost_reason is not None:
            raise LeaseLost(self.lease_id, self.lost_reason)
        if self.released:
            raise LeaseLost(self.lease_id, "it was released")

    def add_callback(self, cb: Callable[..., Any], owner: Any = _NO_OWNER) -> None:
        """Call ``cb(owner)`` (``cb()`` when no owner is given) once, when the lease is marked
        lost; at once, in this thread, if it is lost already. Never after a release. An
        exception from ``cb`` is logged, not raised."""
        bound: Callable[[], Any] = cb if owner is _NO_OWNER else (lambda: cb(owner))
        with self._lock:
            fire = self.lost_reason is not None
            if not fire:
                self._callbacks.append(bound)
        if fire:
            self._safe_call(bound)

    def mark_lost(self, reason: str) -> bool:
        """Mark the lease lost with ``reason`` and fire its callbacks, once: True if this call
        marked it, False if it was lost or released already."""
        with self._lock:
            if not self.active:
                return False
            self.lost_reason = reason
            cbs, self._callbacks = self._callbacks, []
        if self.span is not None:  # traced: OpenTelemetry is imported already
            from . import traces  # not at the top: importing this module imports no third party

            traces.lost(self, reason)
        self._report_lost(reason)
        for cb in cbs:
            self._safe_call(cb)
        return True

    @property
    def yield_requested(self) -> bool:
        """Whether the server asked the holder to yield this lease (:meth:`mark_yield`)."""
        return self.yield_deadline is not None

    def add_yield_callback(self, cb: Callable[..., Any], owner: Any = _NO_OWNER) -> None:
        """Call ``cb(owner)`` (``cb()`` when no owner is given) once, when the holder learns
        that the server asked it to yield the lease; at once, in this thread, if it learnt
        that already. An exception from ``cb`` is logged, not raised.

        Raises:
            TypeError: ``cb`` is not callable (checked now: it may run much later).
        """
        if not callable(cb):
            raise TypeError(f"on_yield takes a callable, got {cb!r:.80}")
        bound: Callable[[], Any] = cb if owner is _NO_OWNER else (lambda: cb(owner))
        with self._lock:
            fire = self.yield_deadline is not None
            if not fire:
                self._yield_callbacks.append(bound)
        if fire:
            self._safe_call(bound, "on_yield")

    def mark_yield(self, deadline: float) -> bool:
        """The server asked the holder to yield the lease (a higher-priority request waits
        for its bytes: preemption); ``deadline`` is the holder's monotonic clock (seconds) by
        which the server takes the bytes back at the latest, counted conservatively as
        :func:`validity_deadline` counts. The first call sets :attr:`yield_deadline` and fires
        the ``on_yield`` callbacks (True); later ones, and any call once the lease is lost or
        released, do nothing (False): the server asks a lease once."""
        with self._lock:
            if self.yield_deadline is not None or not self.active:
                return False
            self.yield_deadline = deadline
            cbs, self._yield_callbacks = self._yield_callbacks, []
        for cb in cbs:
            self._safe_call(cb, "on_yield")
        return True

    def deadline_passed_reason(self, cause: Optional[str] = None) -> str:
        """Why the lease counts as lost once its local validity deadline passed with no
        renewal extending it: taken back, when it was asked to yield (the server stops
        extending it at the yield deadline, so that is what happened); else no renewal in
        time, with ``cause`` (what may be away or slow) in parentheses when given."""
        if self.yield_deadline is not None:
            return "taken back: asked to yield (preemption) and not released by its deadline"
        tail = f" ({cause})" if cause else ""
        return "no successful renewal before the local validity deadline" + tail

    def take_span(self) -> Any:
        """The lease's span, once: later calls (from any thread) get None."""
        with self._lock:
            sp, self.span = self.span, None
        return sp

    def _report_lost(self, reason: str) -> None:
        """Called once when the lease is marked lost, before its callbacks (the core logs it)."""

    def _safe_call(self, fn: Callable[[], Any], what: str = "on_lost") -> None:
        try:
            fn()
        except Exception:  # a user callback must not kill the heartbeat
            self.log.exception("%s: %s callback raised", self.log.name, what)


class LeaseView:
    """The read-only surface of a lease object over its :class:`LocalLeaseState` (the sides'
    ``Lease``/``AsyncLease`` add release and renewal).

    Attributes: ``id`` (32 hex digits), ``pool``, ``amount`` (bytes), ``token`` (fencing token,
    strictly increasing per pool; pass it to storage you write so stale holders can be
    refused), ``ttl`` (seconds), ``valid_until`` (local ``time.monotonic()`` instant after which
    the lease counts as lost), ``lost``, ``released``.
    """

    __slots__ = ("_state", "_pool")

    def __init__(self, state: Any, pool: Any):
        self._state = state
        self._pool = pool

    id = property(lambda self: self._state.lease_id)
    pool = property(lambda self: self._state.pool)
    amount = property(lambda self: self._state.amount)
    token = property(lambda self: self._state.token)
    ttl = property(lambda self: self._state.ttl_s)

    @property
    def valid_until(self) -> float:
        """Local ``time.monotonic()`` instant after which this lease counts as lost."""
        state: LocalLeaseState = self._state  # a subclass's state (Any above)
        return state.valid_until

    @property
    def lost(self) -> bool:
        state: LocalLeaseState = self._state  # a subclass's state (Any above)
        return state.lost

    @property
    def released(self) -> bool:
        state: LocalLeaseState = self._state  # a subclass's state (Any above)
        return state.released

    @property
    def yield_requested(self) -> bool:
        """Whether the server asked the holder to yield this lease: a request of higher
        priority waits for its bytes (preemption, a pool setting). Release it by
        :attr:`yield_deadline`; after that the server takes the bytes back (the lease is lost)."""
        state: LocalLeaseState = self._state  # a subclass's state (Any above)
        return state.yield_requested

    @property
    def yield_deadline(self) -> Optional[float]:
        """None until the server asked the holder to yield this lease; then the local
        ``time.monotonic()`` instant by which the server takes the bytes back at the latest
        (renewals no longer extend the lease past it, so :attr:`valid_until`, as always,
        ends before it)."""
        state: LocalLeaseState = self._state  # a subclass's state (Any above)
        return state.yield_deadline

    def ensure_valid(self) -> None:
        """Raise :class:`LeaseLost` unless this lease is surely still held. Call it right
        before each GPU call made under the lease. Cost: a clock read, no I/O.

        Raises:
            LeaseLost: the local validity deadline passed (Chubby's rule: it passes before
                the server's expiry), the heartbeat learned the lease is gone, or it was
                released.
        """
        self._state.check()

    def on_lost(self, callback: Callable[[Any], Any]) -> None:
        """Call ``callback(lease)`` once when the lease is found lost (by the heartbeat, the
        deadline timer, or ``ensure_valid``). Runs at once if it is already lost. Runs in the
        heartbeat's thread or event loop: keep it short and non-blocking."""
        self._state.add_callback(callback, self)

    def on_yield(self, callback: Callable[[Any], Any]) -> None:
        """Call ``callback(lease)`` once when the holder learns that the server asked it to
        yield this lease (by the hand-off message or a renewal's reply, whichever comes
        first); at once if it learnt that already. Runs in the thread or event loop that
        learnt it: keep it short and non-blocking (e.g. set a flag the work loop checks,
        then release). An exception from it is logged, not raised."""
        self._state.add_yield_callback(callback, self)

    def __repr__(self) -> str:
        s = self._state
        st = "released" if s.released else ("lost" if s.lost_reason else "held")
        return (
            f"<{type(self).__name__} {s.lease_id[:8]}… pool={s.pool} amount={s.amount} "
            f"token={s.token} {st}>"
        )


def default_clock() -> float:
    """The clock ``valid_until`` is on: ``time.monotonic()`` (seconds)."""
    return time.monotonic()


def stop_renewal(states: Iterable[LocalLeaseState], pool: str) -> None:
    """Mark the leases of a pool object being closed as renewed by nobody any more, so that a
    lease past its deadline says why (the object was closed) rather than blame the server."""
    for s in states:
        s.unrenewed = (
            f"its pool object for {pool!r} was closed, so its heartbeat stopped renewing it"
        )
