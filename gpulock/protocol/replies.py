"""Reply decoding of the core, in one place: what each script of a pool answers, and the pool
channel's hand-off messages, as named records. No I/O; reply layouts are documented in
``lua/lib.lua`` and each script's header, and no reader outside this module indexes a reply.

* ``acquire.lua``: :func:`decode_acquire` -> :class:`Grant` or :class:`NotGranted`
* hand-off messages: :func:`decode_events` -> :class:`Grant` list; the yield requests of
  preemption: :func:`decode_yields` -> :class:`YieldAsk` list
* ``configure.lua``: :func:`decode_configure` -> :class:`ConfigureReply` (with its
  :class:`QueueConfig`)
* ``renew.lua``: :func:`decode_renew` -> :class:`RenewReply` (each waiter's answer a
  :class:`Grant`, :class:`Queued` or None)
* ``release.lua``: :func:`decode_release` -> :class:`ReleaseReply`
* ``cancel.lua``: :func:`decode_cancel` -> :class:`CancelReply`
* ``reap.lua``: :func:`decode_reap` -> :class:`ReapReply`
* ``reassert.lua``: :func:`decode_reassert` -> :class:`ReassertReply` (refusals:
  :data:`REASSERT_REFUSED`)
* ``status.lua``: :func:`decode_status` -> :class:`PoolStatus` (with :class:`LeaseInfo`,
  :class:`WaiterInfo`, :class:`TenantUse`, :class:`DeviceUse`), defined in
  :mod:`gpulock.protocol.status` and re-exported here
* ``external.lua``: :func:`decode_device` -> :class:`DeviceReply`

Records made on every call are named tuples (the cheapest immutable record to make); readers
use their field names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

from gpulock_common.options import DEFAULT_PLACEMENT
from gpulock_common.queue import QueuePlace

from gpulock.estimates.wait import DrainRate, wait_seconds, wait_seconds_at_tail
from gpulock.protocol.args import reply_text as _s
from gpulock.protocol.queue_config import QueueConfig as QueueConfig
from gpulock.protocol.status import DeviceUse as DeviceUse
from gpulock.protocol.status import LeaseInfo as LeaseInfo
from gpulock.protocol.status import PoolStatus as PoolStatus
from gpulock.protocol.status import TenantUse as TenantUse
from gpulock.protocol.status import WaiterInfo as WaiterInfo
from gpulock.protocol.status import YieldCounts as YieldCounts
from gpulock.protocol.status import decode_status as decode_status


@dataclass(frozen=True)
class Grant:
    """A lease granted by the server. Times are server milliseconds."""

    ticket: str
    lease_id: str
    token: int
    expires_ms: int
    amount: int
    now_ms: int
    epoch: int = 0
    capacity: int = 0
    device: int = 0  # the device the lease is on (0 on a pool of one device)


@dataclass(frozen=True)
class NotGranted:
    """An acquire that did not grant: queued (``queued`` true) or, for ``try``, refused; or,
    for a resident request, refused because it does not fit next to the resident leases held
    and queued (``resident`` their bytes; None otherwise)."""

    queued: bool
    position: int
    retry_after_ms: int  # to the end of a grace period, else to the nearest lease expiry; -1: none
    queue_length: int
    now_ms: int
    epoch: int
    capacity: int
    used: int
    held_back: int = 0  # bytes the device report holds back (capacity - effective capacity)
    grace_left_ms: int = 0  # ms left in the pool's grace period (0 outside one)
    resident: int | None = None  # reply code 3: bytes of the resident leases held and queued
    # The wait estimate (gpulock.estimates.wait; docs/SEMANTICS.md, "Wait estimate"): bytes
    # of the waiters ahead of it in queue order (not queued: of the whole queue), the pool's
    # drain rate (None: not measured yet, or a server without it), and the estimated seconds
    # until the grant (not queued: if it joined the queue's tail now); None without a rate.
    ahead_bytes: int = 0
    drain: DrainRate | None = None
    estimated_wait: float | None = None

    @property
    def place(self) -> QueuePlace:
        """What ``on_queued`` is called with: the position with its estimate and the queue's
        length."""
        return QueuePlace(
            self.position, estimated_wait=self.estimated_wait, queue_length=self.queue_length
        )


def decode_acquire(ticket: str, r: list[Any]) -> Grant | NotGranted:
    if int(r[0]) == 1:
        return Grant(
            ticket,
            _s(r[1]),
            int(r[2]),
            int(r[3]),
            int(r[4]),
            int(r[5]),
            int(r[6]),
            int(r[7]),
            int(r[9]) if len(r) > 9 else 0,
        )
    code, position, queue_length = int(r[0]), int(r[1]), int(r[3])
    capacity, used = int(r[6]), int(r[7])
    held_back = int(r[8]) if len(r) > 8 else 0
    ahead, drain, wait = 0, None, None
    if len(r) > 14:  # the estimate's inputs: ahead_bytes, amount, bytes_per_s, grants_per_ks,
        # then ahead_count, out_of_order_pm (lua/acquire.lua)
        ahead, amount = int(r[11]), int(r[12])
        count = int(r[15]) if len(r) > 15 else None
        drain = DrainRate.from_wire(int(r[13]), int(r[14]), int(r[16]) if len(r) > 16 else 0)
        free, grace = capacity - held_back - used, int(r[9]) / 1000
        if code == 0:
            wait = wait_seconds(
                ahead_bytes=ahead,
                amount=amount,
                free_bytes=free,
                position=position,
                rate=drain,
                grace_left=grace,
                ahead_count=count,
            )
        else:
            wait = wait_seconds_at_tail(
                queued_bytes=ahead,
                queue_length=queue_length,
                amount=amount,
                free_bytes=free,
                rate=drain,
                grace_left=grace,
                ahead_count=count,
            )
    return NotGranted(
        code == 0,
        position,
        int(r[2]),
        queue_length,
        int(r[4]),
        int(r[5]),
        capacity,
        used,
        held_back,
        int(r[9]) if len(r) > 9 else 0,
        int(r[10]) if code == 3 and len(r) > 10 else None,
        ahead,
        drain,
        wait,
    )


def decode_events(data: str | bytes) -> list[Grant]:
    """Parse a hand-off message from the pool's channel (format in ``lua/lib.lua``)."""
    text = _s(data)
    lines = text.split("\n")
    head = lines[0].split(" ")
    if head[0] != "g":
        return []
    now = int(head[1])
    out = []
    for line in lines[1:]:
        p = line.split(" ")
        if len(p) in (5, 6):
            dev = int(p[5]) if len(p) == 6 else 0
            out.append(Grant(p[0], p[1], int(p[2]), int(p[3]), int(p[4]), now, device=dev))
    return out


class YieldAsk(NamedTuple):
    """One lease a hand-off message asks its holder to yield (preemption): the server takes
    the bytes back at ``deadline_ms`` at the latest; ``now_ms``: when it asked (Unix ms, the
    server's clock)."""

    lease_id: str
    deadline_ms: int
    now_ms: int


def decode_yields(data: str | bytes) -> list[YieldAsk]:
    """Parse a yield request from the holder's channel, ``"y <now_ms>\n<lease_id>
    <deadline_ms>\n..."`` (``lua/lib.lua``); [] for any other message (a grant's)."""
    text = _s(data)
    if not text.startswith("y "):
        return []
    lines = text.split("\n")
    now = int(lines[0].split(" ")[1])
    out = []
    for line in lines[1:]:
        p = line.split(" ")
        if len(p) == 2:
            out.append(YieldAsk(p[0], int(p[1]), now))
    return out


class ConfigureReply(NamedTuple):
    """``configure.lua``'s reply (bytes, ms)."""

    created: int  # 1: this call created the pool; 0: it existed
    capacity: int
    epoch: int
    used: int
    max_waiters: int
    max_ttl_ms: int  # 0: not in the reply
    grace_left_ms: int | None  # ms left in the pool's grace period; None: not in the reply
    queue: QueueConfig | None  # the pool's scheduling settings now; None: not in the reply


def decode_configure(r: Sequence[Any]) -> ConfigureReply:
    """``configure.lua``'s reply: ``{created, capacity, epoch, used, max_waiters, max_ttl_ms,
    grace_left_ms, policy, backfill_ms, quotas, devices, placement, preempt}`` (a shorter reply
    leaves the fields it lacks at their "not in the reply" values; preempt: "<gap>
    <yield_grace_ms>", "" when off)."""
    queue = None
    if len(r) > 8:
        queue = QueueConfig(
            _s(r[7]),
            int(r[8]),
            _s(r[9]) if len(r) > 9 else "",
            _s(r[10]) if len(r) > 10 else "",
            _s(r[11]) if len(r) > 11 else DEFAULT_PLACEMENT,
            QueueConfig.preempt_shown(_s(r[12])) if len(r) > 12 else None,
        )
    return ConfigureReply(
        int(r[0]),
        int(r[1]),
        int(r[2]),
        int(r[3]),
        int(r[4]),
        int(r[5]) if len(r) > 5 else 0,
        int(r[6]) if len(r) > 6 else None,
        queue,
    )


class Queued(NamedTuple):
    """A waiter still queued (``renew.lua``'s answer for its ticket), at ``position`` (1: the
    head), with its estimated seconds until the grant (``estimated_wait``; None while the
    pool's drain rate is not measured, gpulock.estimates.wait) and the queue's length (None:
    a reply without it)."""

    position: int
    estimated_wait: float | None = None
    queue_length: int | None = None

    @property
    def place(self) -> QueuePlace:
        """What ``on_queued`` is called with (as :attr:`NotGranted.place`)."""
        return QueuePlace(
            self.position, estimated_wait=self.estimated_wait, queue_length=self.queue_length
        )


#: ``renew.lua``'s answer for one waiter's ticket: its grant (made meanwhile; its hand-off
#: message may have been missed), its place, or None: the queue does not know the ticket
#: (it expired from the queue, or was cancelled).
WaiterAnswer = Union[Grant, Queued, None]


class RenewReply(NamedTuple):
    """``renew.lua``'s reply (server-clock ms)."""

    now_ms: int
    epoch: int  # 0: the pool has no configuration (Redis lost it)
    expiries: list[int]  # per lease renewed, in order: its new expires_ms; 0: lost
    waiters: list[WaiterAnswer]  # per ticket refreshed, in order
    # per lease renewed, in order: the deadline (Unix ms) by which the server takes it back
    # when it asked its holder to yield it (preemption; its expiry is capped at it), else 0
    yields: list[int]
    queue_length: int = 0  # requests queued after it (kept bytes go back: protocol/keep.py)
    grace_left_ms: int = 0  # the pool's grace period left, ms (0: none)


class Renewal(NamedTuple):
    """One lease renewed on a remote holder's behalf (:func:`gpulock.protocol.flow.renew`):
    its new expiry and the server's time of the reply (Unix ms, the server's clock), and the
    deadline by which the server takes it back when it asked the holder to yield it
    (preemption; the expiry is capped at it), else 0."""

    expires_ms: int
    now_ms: int
    yield_deadline_ms: int = 0


def decode_renew(r: Sequence[Any], tickets: Sequence[str] = ()) -> RenewReply:
    """``renew.lua``'s reply ``{now_ms, epoch, lease_results, ticket_results, queue, yields}``
    for a call that refreshed ``tickets`` (in order; a grant's record carries its ticket). A
    reply without ``yields`` (a server before preemption) reads as none asked."""
    now, epoch = int(r[0]), int(r[1])
    # queue: {capacity, used, held_back, queue_len, bytes_per_s, grants_per_ks, grace_left_ms,
    # out_of_order_pm}
    q = [int(v) for v in r[4]] + [0, 0] if len(r) > 4 and len(r[4]) >= 6 else None
    drain = DrainRate.from_wire(q[4], q[5], q[7]) if q else None
    answers: list[WaiterAnswer] = []
    for ticket, a in zip(tickets, r[3]):
        kind = _s(a[0])
        if kind == "g":
            answers.append(
                Grant(
                    ticket,
                    _s(a[1]),
                    int(a[2]),
                    int(a[3]),
                    int(a[4]),
                    now,
                    epoch,
                    device=int(a[5]) if len(a) > 5 else 0,
                )
            )
        elif kind == "q":
            pos = int(a[1])
            if q is None or len(a) < 4:
                answers.append(Queued(pos))
                continue
            wait = wait_seconds(
                ahead_bytes=int(a[2]),
                amount=int(a[3]),
                free_bytes=q[0] - q[2] - q[1],
                position=pos,
                rate=drain,
                grace_left=q[6] / 1000,
                ahead_count=int(a[4]) if len(a) > 4 else None,
            )
            answers.append(Queued(pos, wait, q[3]))
        else:
            answers.append(None)
    expiries = [int(x) for x in r[2]]
    yields = [int(x) for x in r[5]] if len(r) > 5 else [0] * len(expiries)
    return RenewReply(now, epoch, expiries, answers, yields, q[3] if q else 0, q[6] if q else 0)


class ReleaseReply(NamedTuple):
    """``release.lua``'s reply."""

    released: bool  # False: no such live lease (lost); nothing of others was freed
    now_ms: int  # server clock
    used: int  # bytes the pool's leases hold after it
    granted: int  # waiters handed bytes by it
    kept: bool = False  # 'keep' mode and nobody waited: the lease is kept, not released


def decode_release(r: Sequence[Any]) -> ReleaseReply:
    """``release.lua``'s reply ``{ok, now_ms, used, granted}`` (ok 2: kept; ``released`` is
    then True too: the holder no longer holds it as a request's)."""
    code = int(r[0])
    return ReleaseReply(code in (1, 2), int(r[1]), int(r[2]), int(r[3]), code == 2)


def decode_give_back(data: str | bytes) -> list[str] | None:
    """Parse a request to give kept bytes back from the holder's channel, ``"k <now_ms>
    \n<lease_id>\n..."`` (``lua/lib.lua`` tell_kept): the lease ids named; None for any
    other message."""
    text = _s(data)
    if not text.startswith("k "):
        return None
    return [x for x in text.split("\n")[1:] if x]


class CancelReply(NamedTuple):
    """``cancel.lua``'s reply."""

    outcome: int  # 0: nothing to do, 1: left the queue, 2: its grant was released
    now_ms: int  # server clock


def decode_cancel(r: Sequence[Any]) -> CancelReply:
    """``cancel.lua``'s reply ``{what, now_ms}``."""
    return CancelReply(int(r[0]), int(r[1]))


class ReapReply(NamedTuple):
    """``reap.lua``'s reply."""

    reaped_leases: int
    reaped_waiters: int
    granted: int  # waiters granted after the reap
    next_expiry_in_ms: int  # to the nearest lease expiry; -1: no lease
    now_ms: int  # server clock


def decode_reap(r: Sequence[Any]) -> ReapReply:
    """``reap.lua``'s reply ``{reaped_leases, reaped_waiters, granted, next_expiry_in_ms,
    now_ms}``."""
    return ReapReply(int(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4]))


class ReassertReply(NamedTuple):
    """``reassert.lua``'s reply (server-clock ms)."""

    now_ms: int
    epoch: int
    grace_left_ms: int
    # per lease, in order: its new expires_ms (> 0: put back), or a refusal (< 0, a key of
    # REASSERT_REFUSED)
    results: list[int]


def decode_reassert(r: Sequence[Any]) -> ReassertReply:
    """``reassert.lua``'s reply ``{now_ms, epoch, grace_left_ms, results}``."""
    return ReassertReply(int(r[0]), int(r[1]), int(r[2]), [int(x) for x in r[3]])


class DeviceReply(NamedTuple):
    """``external.lua``'s reply: whether the caller holds the pool's device sampler claim,
    whether its report was written, and the pool after it (server ms, bytes, grants made)."""

    holder: int
    written: int
    now_ms: int
    capacity: int
    used: int
    external: int
    external_until_ms: int
    granted: int


def decode_device(r: Sequence[Any]) -> DeviceReply:
    """``external.lua``'s reply ``{holder, written, now_ms, capacity, used, external,
    external_until_ms, granted}``."""
    return DeviceReply(*(int(x) for x in r))


# Why reassert.lua refused to put a lease back (its negative result codes).
REASSERT_REFUSED = {
    -1: "Redis lost the pool more than one max_ttl ago; the lease cannot be put back",
    -2: "Redis lost the pool, and the lease does not fit next to the leases put back or granted since",
    -3: "Redis lost the pool, and the lease's token is not older than the pool made again",
    -4: "Redis lost the pool, and the lease's ttl is longer than the new pool's max_ttl",
    -5: "Redis lost the pool, and its lease id or request id is taken by another lease",
}
