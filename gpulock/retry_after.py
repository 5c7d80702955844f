"""The ``Retry-After`` policy: how many whole seconds a refused client is told to wait.

I/O-free; the FastAPI integration (:mod:`gpulock.fastapi`) and the lease broker feed it what
they measured. One rule: **Retry-After is the request's wait estimate, in seconds, put through
the rules below**, and a 503 that carries an estimate (``estimated_wait_s``) carries that same
one. The rules, in the order they apply:

* **An estimate in seconds** (:func:`queue_seconds`). The pool's part is the server's wait
  estimate (``pool_wait``: docs/SEMANTICS.md, "Wait estimate", computed by the one rule of
  :mod:`gpulock.estimates.wait` from the pool's drain rate and the bytes ahead): a queued
  request's own (its last ``QueuePlace.estimated_wait``, or its waiter's in the pool's
  status), and for a request that leaves the queue the estimate at the queue's tail, behind
  everything queued now (``wait_seconds_at_tail``). While the server has no measured drain
  rate (a new pool, an older server) it is rate based instead: ``position / grant_rate``,
  ``grant_rate`` the pool's grants per second while busy (:class:`BusyRate`), or, before any
  busy interval was seen, Little's law (:func:`grant_rate`). A request still waiting for one
  of its worker's ``local`` threads adds ``local / local_rate`` (its worker's own busy grant
  rate, else the pool's). With no rate at all: ``UNMEASURED_SECONDS_PER_PLACE`` per place, or
  the server's hint (the time to the nearest lease expiry) when shorter; such a guess is no
  estimate (``estimated_wait_s`` null). The lease broker has no rates of its own: its estimate
  is the server's as it is (the 503's ``estimated_wait_s``: a queued request's own, for one not
  queued the tail's), and while the server has no drain rate the server's hint alone
  (:func:`estimate_or_hint`).
* **A grace period.** After Redis lost a pool nothing is granted until its grace period ends,
  so the answer is at least the time left in it (:func:`retry_after`).
* **A kept place.** A request that keeps its place for ``keep_place`` seconds is told at most
  ``keep_place / 2`` (but never less than the grace left), so its retry, also after the
  client's jitter, arrives while the place is kept. ``keep_place``: the service's
  ``park_timeout`` (the least a place is kept after an answer), the broker's ``park_max`` (the
  most: its hold, ``min(park_max, max(waiter_ttl, 2 * Retry-After + 2))``, is at least twice
  a Retry-After of at most ``park_max / 2``). In a grace period both keep the place for the
  grace left on top (:func:`gpulock.http.places.hold_for`'s ``extra``).
* **Whole seconds in [1, cap]** (:func:`clamp`): rounded up, at least 1, at most ``cap``.

A 503 that knows nothing of the pool's queue (Redis, or the pool's shard, not answering; a
forced delete of the pool under way; the lease broker not started yet) has no estimate to go
through these rules: it says :data:`UNAVAILABLE_RETRY_AFTER`.
"""

from __future__ import annotations

import math

__all__ = [
    "UNAVAILABLE_RETRY_AFTER",
    "UNMEASURED_SECONDS_PER_PLACE",
    "BusyRate",
    "clamp",
    "estimate_or_hint",
    "openapi_headers",
    "grant_rate",
    "queue_seconds",
    "retry_after",
]

UNMEASURED_SECONDS_PER_PLACE = 1.0
"""Seconds per queue place before any grant rate was measured: a retry that comes too early
costs one cheap lookup, one that comes too late costs latency."""

UNAVAILABLE_RETRY_AFTER = 1
"""Whole seconds a 503 tells when the pool's state is not known: Redis (or the pool's shard)
did not answer, a forced delete of the pool is under way, or the lease broker is not started.
There is no queue to estimate from, and these last as long as a reconnect, a failover, the
delete's one script or a start-up: the least whole Retry-After, so a client comes back as soon
as one may have passed (a retry that comes too early costs one cheap refusal; the SDK backs
off on its own after repeated ones). A client retrying it keeps no place in any queue."""

_MIN_RATE = 0.01  # grants/s; a measured rate at or below it counts as no rate


class BusyRate:
    """Events per second while a queue is busy: an exponentially weighted moving average
    (time constant ``tau`` seconds) of a monotonic counter, fed one sample per status read.

    Only intervals that began busy (waiters queued at their first sample) count: the rate a
    waiter cares about is how fast the queue drains when there is a queue, and an idle interval
    (no grants because nobody asked) would drag the average toward zero and make the first
    Retry-After of a burst many times too long; so would the interval in which a burst begins,
    since it is mostly idle. The first busy interval sets the rate outright instead of being
    blended with a made-up prior; before any, the interval in which a burst began does, when
    it saw grants (an underestimate, but better than no rate). A counter that went backwards
    (a Redis restart) restarts the sampling. ``rate`` is None until an interval counted.
    """

    def __init__(self, tau: float = 10.0):
        self.tau = float(tau)
        self.rate: float | None = None
        self._last: tuple[float, int, bool] | None = None  # (time, counter, busy)

    def sample(self, now: float, count: int, *, busy: bool) -> None:
        """One reading: ``now`` (seconds, monotonic), the counter, whether waiters are queued."""
        last, self._last = self._last, (now, count, busy)
        if last is None:
            return
        t0, c0, busy0 = last
        dt = now - t0
        if dt <= 0 or count < c0:
            return
        inst = (count - c0) / dt
        if self.rate is None:
            if busy0 or (busy and inst > 0):
                self.rate = inst
        elif busy0:
            self.rate += (1.0 - math.exp(-dt / self.tau)) * (inst - self.rate)


def grant_rate(
    busy_rate: float | None, *, leases: int, resident: int, mean_hold: float | None
) -> float | None:
    """Grants per second of a pool: ``busy_rate`` (a :class:`BusyRate`'s) when above 0.01/s,
    else Little's law ``max(1, leases - resident) / mean_hold`` (leases held at once, less the
    ``resident`` leases that are never given back, over the mean hold time in seconds) when
    leases are held and a hold time was measured; else None."""
    if busy_rate is not None and busy_rate > _MIN_RATE:
        return busy_rate
    if mean_hold and leases > 0:
        return max(1, leases - resident) / mean_hold
    return None


def queue_seconds(
    position: int,
    rate: float | None,
    *,
    local: int = 0,
    local_rate: float | None = None,
    server_hint: float | None = None,
    pool_wait: float | None = None,
) -> float:
    """Seconds until a request at ``position`` (1-based) in the pool's queue is granted.

    The pool's part: ``pool_wait`` (seconds, the server's wait estimate) when given, else
    ``position / rate`` when the queue drains at ``rate`` grants/s. Plus ``local /
    local_rate`` for a request still at place ``local`` among its worker's thread waiters
    (``rate`` when ``local_rate`` is None or at most 0.01/s). Without ``pool_wait`` and
    ``rate``: ``UNMEASURED_SECONDS_PER_PLACE`` per place (``position + local``, at least one),
    or ``server_hint`` (seconds) when positive and shorter. With ``pool_wait`` but no rate
    for the local part, each local place counts ``UNMEASURED_SECONDS_PER_PLACE``."""
    p = max(0, int(position))
    if pool_wait is not None:
        secs = max(0.0, float(pool_wait))
        if local:
            lr = local_rate if local_rate and local_rate > _MIN_RATE else rate
            secs += local / lr if lr else local * UNMEASURED_SECONDS_PER_PLACE
        return secs
    if rate:
        secs = p / rate
        if local:
            secs += local / (local_rate if local_rate and local_rate > _MIN_RATE else rate)
        return secs
    secs = float(max(1, p + local)) * UNMEASURED_SECONDS_PER_PLACE
    if server_hint is not None and server_hint > 0:
        secs = min(secs, server_hint)
    return secs


def clamp(seconds: float, cap: float) -> int:
    """``seconds`` rounded up to whole seconds, at most ``cap``, at least 1."""
    return int(max(1.0, min(cap, math.ceil(seconds))))


def retry_after(
    seconds: float, *, cap: float, grace_left: float = 0.0, keep_place: float | None = None
) -> int:
    """The Retry-After value for an estimate of ``seconds``: at least ``grace_left`` (seconds
    left in the pool's grace period); for a request that keeps its place ``keep_place``
    seconds (when positive), at most ``max(keep_place / 2, grace_left)``; then :func:`clamp`
    to [1, ``cap``]."""
    secs = max(seconds, grace_left)
    if keep_place is not None and keep_place > 0:
        cap = min(cap, max(keep_place / 2, grace_left))
    return clamp(secs, cap)


def estimate_or_hint(estimated_wait: float | None, hint: float | None) -> float:
    """The seconds a Retry-After comes from, for a surface that only has what the server
    answered (the lease broker): the server's wait estimate ``estimated_wait`` (seconds;
    docs/SEMANTICS.md, "Wait estimate") when it has one; else, while the pool's drain rate is
    not measured, ``hint`` (seconds: the script's time to the end of a grace period, else to
    the nearest lease expiry; None or negative, no lease held: 0, which :func:`clamp` makes
    1 s)."""
    if estimated_wait is not None:
        return max(0.0, float(estimated_wait))
    return max(0.0, float(hint)) if hint is not None else 0.0


def openapi_headers(position: str) -> dict[str, dict[str, object]]:
    """The OpenAPI ``headers`` of a 503 that carries this policy's answer: ``Retry-After``
    (required; whole seconds, :func:`clamp`) and ``X-Queue-Position`` (optional; the request's
    1-based place in the pool's queue, described by ``position``: when the answer has one)."""
    whole = {"type": "string", "pattern": "^[0-9]+$"}
    return {
        "Retry-After": {
            "description": "Seconds to wait before retrying (a whole number, at least 1).",
            "required": True,
            "schema": whole,
        },
        "X-Queue-Position": {"description": position, "required": False, "schema": dict(whole)},
    }
