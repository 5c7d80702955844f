"""What a broker request ends in: the results of an acquire (:class:`Granted`, :class:`Queued`)
and the broker's own errors, which the router in ``api.py`` maps to HTTP status codes (the
code of each is in its docstring)."""

from __future__ import annotations

from dataclasses import dataclass

from gpulock.protocol.replies import Grant
from gpulock.errors import AcquireTimeout, BackendUnavailable, QueueFull

__all__ = [
    "ClientGone",
    "Granted",
    "LeaseGone",
    "NotYours",
    "PoolBeingDeleted",
    "Queued",
    "Refused",
    "Waited",
]


class LeaseGone(Exception):
    """The lease is not held any more (410). ``outcome``: "lost" or "released"."""

    def __init__(self, lease_id: str, outcome: str, message: str):
        super().__init__(message)
        self.lease_id, self.outcome = lease_id, outcome


class NotYours(Exception):
    """The lease exists but belongs to another token, or was not made through a broker (404)."""


class PoolBeingDeleted(BackendUnavailable):
    """A forced delete of the pool is under way (503 with
    :data:`gpulock.retry_after.UNAVAILABLE_RETRY_AFTER`; a retry finds it gone)."""


class Refused(Exception):
    """A refusal that knows the pool's state, with when to come back: ``error`` (QueueFull, or
    AcquireTimeout: a growth not granted within its timeout), answered 503 as the error table
    says, with ``retry_after_s`` (whole seconds: the Retry-After,
    :func:`gpulock_broker.acquire.retry_after_of`) and ``estimated_wait_s`` (the server's
    estimate it came from; None: the server's hint's, or none)."""

    def __init__(
        self, error: QueueFull | AcquireTimeout, retry_after_s: int, estimated_wait_s: float | None
    ):
        super().__init__(str(error))
        self.error, self.retry_after_s, self.estimated_wait_s = (
            error,
            retry_after_s,
            estimated_wait_s,
        )


class ClientGone(Exception):
    """The client closed its connection during the long poll: its request was withdrawn (it
    left the queue, or the grant that raced the hang-up was released)."""


@dataclass(frozen=True)
class Waited:
    """Where a granted request waited: the place it took in the queue when the broker enqueued
    it (this HTTP request's enqueue; a retry with the same request id: its place then) and the
    server's estimate of its wait then. The 201's ``queued``
    (:class:`gpulock_broker.answers.QueuedPlace`); how long it was held is the 201's
    ``held_ms``."""

    position: int  # 1-based
    queue_length: int  # waiters queued then, itself included
    estimated_wait_s: float | None  # None while the pool's drain rate is not measured


@dataclass(frozen=True)
class Granted:
    pool: str
    request_id: str
    grant: Grant
    ttl_s: float
    acquired_ms: int  # server clock, when the grant was made
    queued: Waited | None = None  # None: granted at once (this request never queued)


@dataclass(frozen=True)
class Queued:
    """Not granted within ``wait``: ``queued`` (the place is kept ``hold_s``) or not queued
    (``queue=False``)."""

    request_id: str
    queued: bool
    position: int
    queue_length: int
    retry_after_s: int
    hold_s: float
    grace_left_s: float = 0.0  # seconds left in the pool's restart grace period (0: none)
    # seconds until the grant, the server's estimate (not queued: at the queue's tail; None
    # while the pool's drain rate is not measured; docs/SEMANTICS.md, "Wait estimate")
    estimated_wait_s: float | None = None


def gone_message(lease_id: str, outcome: str) -> str:
    """The message of a :class:`LeaseGone` for ``lease_id`` (its first 8 characters are
    shown). ``outcome``: "released", "lost", or "unknown" (no record of the lease anywhere)."""
    short = lease_id[:8]
    if outcome == "released":
        return f"lease {short}… was released"
    if outcome == "unknown":
        return (
            f"lease {short}… is not held: it expired on the server (no renewal within its ttl), "
            f"was released, or never existed; nothing was freed"
        )
    return (
        f"lease {short}… is lost: it expired on the server (no renewal within its ttl) or the "
        f"pool was reset; nothing of other holders was freed"
    )
