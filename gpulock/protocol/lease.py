"""The lease's local state and validity clock over :mod:`gpulock_common.lease`:
:class:`LeaseState` (what a Redis grant adds to the shared local state),
:func:`validity_deadline` (from server-clock times), and :class:`LeaseBase` (what sync and async
leases share). Re-exports the shared clock's ``CLOCK_DRIFT``, ``SAFETY_MARGIN_S`` and
``default_clock``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from gpulock_common.lease import CLOCK_DRIFT as CLOCK_DRIFT
from gpulock_common.lease import SAFETY_MARGIN_S as SAFETY_MARGIN_S
from gpulock_common.lease import LeaseView, LocalLeaseState
from gpulock_common.lease import default_clock as default_clock
from gpulock_common.lease import validity_deadline as lease_validity_deadline

from gpulock_common import traces

from gpulock.protocol.replies import Grant

log = logging.getLogger("gpulock")


class LeaseState(LocalLeaseState):
    """A lease's local state (:class:`gpulock_common.lease.LocalLeaseState`: identity, the
    validity deadline, lost/released, the ``on_lost`` callbacks) with what a Redis grant adds,
    shared by both shells and the heartbeat. Thread-safe: the heartbeat may run in another
    thread than the holder.

    Adds: ``ticket`` (the request id), ``expires_ms`` (server-clock expiry, Unix ms),
    ``epoch`` (the pool's epoch at the grant), ``meta`` (holder metadata as sent to acquire,
    kept to re-assert the lease), ``priority`` (the acquire's; a growth's place where none is stored),
    ``tenant`` (likewise; "" for none), ``preemptible`` (likewise: False, never asked to
    yield), ``resident`` (likewise:
    a resident lease, docs/SEMANTICS.md "Resident leases"), ``device`` (the
    device it is on; 0 on a pool of one device), ``next_renew`` (local monotonic seconds);
    ``expires_at`` reads ``expires_ms`` in Unix seconds. ``valid_until``
    comes from :func:`validity_deadline` of the last successful grant or renewal, so it always
    ends before the server's expiry (invariant 5 in docs/SEMANTICS.md).
    """

    __slots__ = (
        "ticket",
        "expires_ms",
        "epoch",
        "meta",
        "tenant",
        "resident",
        "device",
        "priority",
        "preemptible",
        "next_renew",
        "keeper",
        "kept",
    )
    unreachable = "Redis"
    log = logging.getLogger("gpulock")

    def __init__(
        self, pool: str, grant: Grant, ttl_s: float, valid_until: float, clock: Callable[[], float]
    ):
        super().__init__(pool, grant.lease_id, grant.amount, grant.token, ttl_s, valid_until, clock)
        self.ticket = grant.ticket
        self.expires_ms = grant.expires_ms
        self.epoch = grant.epoch
        self.meta = ""
        self.tenant = ""
        self.resident = False
        self.device = grant.device
        self.priority = 0  # the acquire's: a growth (resize) queues at it
        self.preemptible = True  # the acquire's: False, never asked to yield
        self.next_renew = clock() + ttl_s / 3
        self.keeper: Any = None  # the pool object's KeptLeases when it keeps released bytes
        self.kept = False  # the server lists the lease as kept (release.lua 'keep')

    def handed_on(self) -> "LeaseState":
        """A new local state of the same lease in Redis (identity, amount, validity, expiry,
        the request's settings, ``kept``, ``keeper``), for a grant from kept bytes
        (:mod:`gpulock.protocol.keep`): active, with no callbacks, no span and no ask to
        yield. This one is not changed (its holder marks it released)."""
        n = LeaseState.__new__(LeaseState)
        LocalLeaseState.__init__(
            n,
            self.pool,
            self.lease_id,
            self.amount,
            self.token,
            self.ttl_s,
            self.valid_until,
            self._clock,
        )
        n.ticket, n.expires_ms, n.epoch, n.meta = (
            self.ticket,
            self.expires_ms,
            self.epoch,
            self.meta,
        )
        n.tenant, n.resident, n.device = self.tenant, self.resident, self.device
        n.priority, n.preemptible, n.next_renew = self.priority, self.preemptible, self.next_renew
        n.keeper, n.kept = self.keeper, self.kept
        return n

    @property
    def expires_at(self) -> float:
        """Server-clock expiry of the last grant or renewal, Unix seconds."""
        return self.expires_ms / 1000.0

    def seconds_left(self) -> float:
        """Seconds until the local validity deadline (negative once past)."""
        return self.valid_until - self._clock()

    def renewed(self, sent: float, now_ms: int, expires_ms: int) -> None:
        self.expires_ms = expires_ms
        self.valid_until = validity_deadline(sent, now_ms, expires_ms)
        self.next_renew = sent + self.ttl_s / 3
        if self.span is not None:
            traces.renewed(self)

    def asked(self, deadline_ms: int) -> bool:
        """The server asked the holder to yield this lease by ``deadline_ms`` (Unix ms, its
        clock: a hand-off message's or a renewal reply's): :meth:`mark_yield` with that instant
        on the local clock, counted from the lease's last grant or renewal as its validity is
        (the pair ``valid_until``, ``expires_ms``), so it ends before the server's deadline.
        The server never lets the lease's expiry pass the deadline, so ``expires_ms`` is at
        most ``deadline_ms``. (A renewal landing while this reads the pair can only make it
        earlier: ``renewed`` sets ``expires_ms`` first.) True when this call marked it."""
        span_s = max(0, deadline_ms - self.expires_ms) / 1000.0
        return self.mark_yield(self.valid_until + span_s * (1.0 - CLOCK_DRIFT))

    def preemption_field(self, channel_id: str) -> str:
        """``reassert.lua``'s 10th field of this lease: ``"<priority>|<channel_id>"`` (the
        holder's hand-off channel), or "" for a lease never asked to yield (not preemptible,
        or resident)."""
        if self.resident or not self.preemptible:
            return ""
        return f"{self.priority}|{channel_id}"

    def _report_lost(self, reason: str) -> None:
        log.warning(
            "gpulock: lease %s… on pool %s (token %d, %d bytes) lost: %s",
            self.lease_id[:8],
            self.pool,
            self.token,
            self.amount,
            reason,
        )


def validity_deadline(sent: float, now_ms: int, expires_ms: int) -> float:
    """The local validity deadline (monotonic seconds) of a call sent at ``sent`` whose reply
    gave the Redis server's time ``now_ms`` and the lease's expiry ``expires_ms`` (both Unix ms
    on the server's clock): :func:`gpulock_common.lease.validity_deadline` of that span."""
    return lease_validity_deadline(sent, (expires_ms - now_ms) / 1000.0)


class LeaseBase(LeaseView):
    """What sync and async leases share (:class:`gpulock_common.lease.LeaseView`: ``id``,
    ``pool``, ``amount`` in bytes, ``token``, ``ttl`` in seconds, ``valid_until``, ``lost``,
    ``released``, ``ensure_valid``, ``on_lost``), plus ``request_id`` and ``expires_at``."""

    __slots__ = ()

    request_id = property(lambda self: self._state.ticket)
    # The device the lease is on (docs/SEMANTICS.md, "Devices and placement"); 0 on a pool of
    # one device.
    device = property(lambda self: self._state.device)

    @property
    def expires_at(self) -> float:
        """Server-clock expiry of the last grant/renewal, as a Unix timestamp (seconds)."""
        state: LeaseState = self._state
        return state.expires_at
