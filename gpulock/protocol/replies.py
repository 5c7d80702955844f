"""Reply decoding of the core, in one place: what each script of a pool answers, and the pool
channel's hand-off messages, as named records. No I/O; reply layouts are documented in
``lua/lib.lua`` and each script's header, and no reader outside this module indexes a reply.

* ``acquire.lua``: :func:`decode_acquire` -> :class:`Grant` or :class:`NotGranted`
* hand-off messages: :func:`decode_events` -> :class:`Grant` list
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
  :class:`WaiterInfo`, :class:`TenantUse`, :class:`DeviceUse`)
* ``external.lua``: :func:`decode_device` -> :class:`DeviceReply`

Records made on every call are named tuples (the cheapest immutable record to make); readers
use their field names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

from gpulock_common.options import DEFAULT_BACKFILL_WINDOW_S, DEFAULT_PLACEMENT, DEFAULT_POLICY
from gpulock_common.options import PoolSettings
from gpulock_common.queue import QueuePlace

from gpulock.errors import CapacityExceeded, QuotaExceeded, RoomExceeded
from gpulock.estimates.wait import DrainRate, wait_seconds, wait_seconds_at_tail
from gpulock.protocol.args import decode_quotas, encode_quotas

from gpulock.protocol.args import decode_meta


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


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


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
    if len(r) > 14:  # the estimate's inputs: ahead_bytes, amount, bytes_per_s, grants_per_ks
        ahead, amount = int(r[11]), int(r[12])
        drain = DrainRate.from_wire(int(r[13]), int(r[14]))
        free = capacity - held_back - used
        if code == 0:
            wait = wait_seconds(
                ahead_bytes=ahead, amount=amount, free_bytes=free, position=position, rate=drain
            )
        else:
            wait = wait_seconds_at_tail(
                queued_bytes=ahead,
                queue_length=queue_length,
                amount=amount,
                free_bytes=free,
                rate=drain,
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


class QueueConfig(NamedTuple):
    """A pool's scheduling settings as ``configure.lua`` takes them (its ARGV 6 to 10) and
    answers them, and as a client remembers them to make the pool again after a loss. Each
    None when not given (a configure then leaves it as it is)."""

    policy: str | None  # "fifo" or "backfill"
    backfill_ms: int | None  # the backfill window, ms
    quotas: str | None  # tenant quotas, "<tenant>=<bytes> ..." ("": none)
    devices: str | None  # each device's capacity, "<bytes> ..." ("": a pool of one device)
    placement: str | None  # "bestfit" or "spread"

    @classmethod
    def asked(cls, s: PoolSettings, devices: str | None) -> QueueConfig | None:
        """What a ``configure`` of the checked settings ``s`` asks of these (``devices``
        already encoded, ``protocol.args.encode_devices``: they set the capacity too); None
        when it asks none of them. Raises InvalidArgument naming a bad quota."""
        q = cls(
            s.policy,
            None if s.backfill_window is None else max(1, round(s.backfill_window * 1000)),
            None if s.quotas is None else encode_quotas(s.quotas),
            devices,
            s.placement,
        )
        return None if q == _ASKS_NOTHING else q

    def argv(self) -> list[str]:
        """``configure.lua``'s ARGV 6 to 10, in this record's order ("": unchanged)."""
        return ["" if v is None else str(v) for v in self]

    def shown(self, capacity: int) -> dict[str, Any]:
        """As ``configure``'s reply shows them: ``policy``, ``backfill_window`` (seconds),
        ``quotas`` (tenant: bytes), ``devices`` (each one's bytes; ``[capacity]`` for a pool
        of one device) and ``placement``."""
        return {
            "policy": self.policy,
            "backfill_window": (self.backfill_ms or 0) / 1000,
            "quotas": decode_quotas(self.quotas or ""),
            "devices": [int(c) for c in (self.devices or "").split()] or [capacity],
            "placement": self.placement,
        }


_ASKS_NOTHING = QueueConfig(None, None, None, None, None)


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
    grace_left_ms, policy, backfill_ms, quotas, devices, placement}`` (a shorter reply leaves
    the fields it lacks at their "not in the reply" values)."""
    queue = None
    if len(r) > 8:
        queue = QueueConfig(
            _s(r[7]),
            int(r[8]),
            _s(r[9]) if len(r) > 9 else "",
            _s(r[10]) if len(r) > 10 else "",
            _s(r[11]) if len(r) > 11 else DEFAULT_PLACEMENT,
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


def decode_renew(r: Sequence[Any], tickets: Sequence[str] = ()) -> RenewReply:
    """``renew.lua``'s reply ``{now_ms, epoch, lease_results, ticket_results, queue}`` for a
    call that refreshed ``tickets`` (in order; a grant's record carries its ticket)."""
    now, epoch = int(r[0]), int(r[1])
    # queue: {capacity, used, held_back, queue_len, bytes_per_s, grants_per_ks}
    q = [int(v) for v in r[4]] if len(r) > 4 and len(r[4]) >= 6 else None
    drain = DrainRate.from_wire(q[4], q[5]) if q else None
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
            )
            answers.append(Queued(pos, wait, q[3]))
        else:
            answers.append(None)
    return RenewReply(now, epoch, [int(x) for x in r[2]], answers)


class ReleaseReply(NamedTuple):
    """``release.lua``'s reply."""

    released: bool  # False: no such live lease (lost); nothing of others was freed
    now_ms: int  # server clock
    used: int  # bytes the pool's leases hold after it
    granted: int  # waiters handed bytes by it


def decode_release(r: Sequence[Any]) -> ReleaseReply:
    """``release.lua``'s reply ``{ok, now_ms, used, granted}``."""
    return ReleaseReply(int(r[0]) == 1, int(r[1]), int(r[2]), int(r[3]))


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


@dataclass(frozen=True)
class TenantUse:
    """What one tenant holds on a pool (docs/SEMANTICS.md, "Tenant quotas"): bytes its live
    leases hold, and its quota in bytes (0: none)."""

    used: int
    quota: int = 0


@dataclass(frozen=True)
class DeviceUse:
    """One device of a pool (docs/SEMANTICS.md, "Devices and placement"): its index, capacity
    and the bytes its live leases hold."""

    index: int
    capacity: int
    used: int

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.used)


@dataclass(frozen=True)
class LeaseInfo:
    lease_id: str
    amount: int
    token: int
    expires_in: float  # seconds, on the server clock
    held_for: float  # seconds since the grant
    ttl: float
    request_id: str
    holder: dict[str, Any]
    tenant: str = ""  # "" for none
    device: int = 0  # the device it is on (0 on a pool of one device)


@dataclass(frozen=True)
class WaiterInfo:
    position: int
    request_id: str
    amount: int
    waited: float  # seconds in the queue
    expires_in: float  # seconds until dropped if not refreshed
    holder: dict[str, Any]
    priority: int = 0  # as requested; the queue ages it (docs/SEMANTICS.md, "Priorities")
    tenant: str = ""  # "" for none
    device: int | None = None  # the device it pins; None: any
    # A queued growth of a held lease (``lease.resize``; docs/SEMANTICS.md, "Resizing a
    # lease"): the lease's id and fencing token, ``amount`` being the bytes it grows by and
    # ``holder`` the lease's holder; None for a new request.
    growth_of: str | None = None
    growth_token: int | None = None
    # The wait estimate (docs/SEMANTICS.md, "Wait estimate"): bytes of the waiters ahead of
    # it in queue order, and the estimated seconds until its grant (None: no drain rate yet).
    ahead_bytes: int = 0
    estimated_wait: float | None = None


@dataclass(frozen=True)
class PoolStatus:
    """A snapshot of a pool, read from Redis by one script (so self-consistent).
    Amounts are bytes; times are seconds."""

    pool: str
    capacity: int
    used: int
    epoch: int
    fence: int
    max_waiters: int
    lease_count: int
    waiter_count: int
    grants: int
    reaped_leases: int
    reaped_waiters: int
    leases: list[LeaseInfo] = field(default_factory=list)
    waiters: list[WaiterInfo] = field(default_factory=list)
    grace_left: float = 0.0  # seconds of grace period left (no new grants until then)
    max_ttl: float = 0.0  # seconds: the longest ttl a lease may have (0: unbounded)
    reasserted: int = 0  # leases put back by their holders after Redis lost the pool
    # The device sampler's live report (docs/SEMANTICS.md, "Device truth"): bytes in use on the
    # device outside the pool's leases (0 when no report counts), seconds it still counts, and
    # the over-users it found (list of dicts: holder, lease_id, pid, leased, actual, excess).
    external: int = 0
    external_left: float = 0.0
    overusers: list[dict[str, Any]] = field(default_factory=list)
    # The queue policy (docs/SEMANTICS.md, "Backfill"): "fifo" or "backfill", and the backfill
    # window in seconds (how long a head that does not fit may be passed by requests that do).
    policy: str = DEFAULT_POLICY
    backfill_window: float = DEFAULT_BACKFILL_WINDOW_S
    # Tenants with a quota or with live leases (docs/SEMANTICS.md, "Tenant quotas"), by name.
    tenants: dict[str, TenantUse] = field(default_factory=dict)
    # The pool's devices (docs/SEMANTICS.md, "Devices and placement"), device 0 first: one for
    # a pool of one device; and how a request without a device is placed.
    devices: list[DeviceUse] = field(default_factory=list)
    placement: str = DEFAULT_PLACEMENT
    # Resident leases (docs/SEMANTICS.md, "Resident leases"): bytes held by them, and bytes of
    # resident requests queued; a request that is not resident is refused when it is larger
    # than capacity - resident - resident_queued (RoomExceeded).
    resident: int = 0
    resident_queued: int = 0
    # How fast the queue drains while busy (docs/SEMANTICS.md, "Wait estimate"): None while
    # not measured (a fresh pool, one made again after Redis lost it, an older server). Each
    # listed waiter's ``estimated_wait`` is computed from it at parse.
    drain: DrainRate | None = None

    def estimated_wait_for(self, amount: int) -> float | None:
        """Estimated seconds a request of ``amount`` bytes would wait if it joined the
        queue's tail now (gpulock.estimates.wait.wait_seconds_at_tail), every queued byte
        ahead of it: the listed waiters' amounts, their mean standing in for each waiter not
        listed. None while the drain rate is not measured."""
        listed = sum(w.amount for w in self.waiters)
        queued = listed
        if self.waiters and self.waiter_count > len(self.waiters):
            queued = listed * self.waiter_count // len(self.waiters)
        return wait_seconds_at_tail(
            queued_bytes=queued,
            queue_length=self.waiter_count,
            amount=amount,
            free_bytes=self.capacity - self.external - self.used,
            rate=self.drain,
        )

    def queue_config(self) -> QueueConfig:
        """The pool's scheduling settings as ``configure.lua`` takes them."""
        spec = " ".join(f"{t}={u.quota}" for t, u in self.tenants.items() if u.quota)
        devs = " ".join(str(d.capacity) for d in self.devices) if len(self.devices) > 1 else ""
        return QueueConfig(
            self.policy, round(self.backfill_window * 1000), spec, devs, self.placement
        )

    @property
    def effective_capacity(self) -> int:
        """Bytes the pool may grant in all now: capacity minus the device's external use."""
        return max(0, self.capacity - self.external)

    @property
    def free(self) -> int:
        return max(0, self.effective_capacity - self.used)

    @property
    def room(self) -> int:
        """Bytes the pool can ever grant a request that is not resident: capacity minus the
        resident leases held and queued (docs/SEMANTICS.md, "Resident leases")."""
        return self.capacity - self.resident - self.resident_queued

    def refusal(self, amount: int, tenant: str | None = None) -> CapacityExceeded | None:
        """The error ``acquire`` answers at once for ``amount`` bytes that this snapshot says
        can never be granted (not resident, of ``tenant``), or None: over the capacity
        (CapacityExceeded), over :attr:`room` (RoomExceeded), over the tenant's quota
        (QuotaExceeded). The pool's own rule (``acquire.lua``) is the one that grants; this
        reads it off a snapshot for an amount not asked yet (a lease that may grow to it), at
        the pool's level: a device of a pool of several, and a tenant's resident leases, are
        left to the pool."""
        if amount > self.capacity:
            return CapacityExceeded(amount, self.capacity)
        if amount > self.room:
            rsv = self.resident + self.resident_queued
            return RoomExceeded(amount, self.room, self.capacity, rsv)
        use = self.tenants.get(tenant) if tenant else None
        if use is not None and use.quota and amount > use.quota:
            return QuotaExceeded(amount, use.quota, str(tenant))
        return None

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def decode_status(pool: str, r: list[Any]) -> PoolStatus | None:
    if int(r[0]) == 0:
        return None
    now = int(r[1])
    leases = [
        LeaseInfo(
            _s(x[0]),
            int(x[1]),
            int(x[2]),
            (int(x[3]) - now) / 1000,
            (now - int(x[4])) / 1000,
            int(x[5]) / 1000,
            _s(x[6]),
            decode_meta(x[7]),
            _s(x[8]) if len(x) > 8 else "",
            int(x[9]) if len(x) > 9 else 0,
        )
        for x in r[12]
    ]
    waiters = [
        WaiterInfo(
            i + 1,
            _s(x[0]),
            int(x[1]),
            (now - int(x[2])) / 1000,
            (int(x[3]) - now) / 1000,
            decode_meta(x[4]),
            int(x[5]) if len(x) > 5 else 0,
            _s(x[6]) if len(x) > 6 else "",
            int(x[7]) if len(x) > 7 and int(x[7]) >= 0 else None,
            _s(x[8]) or None if len(x) > 8 else None,
            int(x[9]) or None if len(x) > 9 and _s(x[8]) else None,
        )
        for i, x in enumerate(r[13])
    ]
    (
        capacity,
        used,
        epoch,
        fence,
        max_waiters,
        lease_count,
        waiter_count,
        grants,
        reaped_leases,
        reaped_waiters,
    ) = (int(v) for v in r[2:12])
    extra = [int(v) for v in r[14:19]] + [0, 0, 0, 0, 0]
    drain = DrainRate.from_wire(int(r[27]), int(r[28])) if len(r) > 28 else None
    waiters = _with_estimates(waiters, capacity - extra[3] - used, drain)
    return PoolStatus(
        pool,
        capacity,
        used,
        epoch,
        fence,
        max_waiters,
        lease_count,
        waiter_count,
        grants,
        reaped_leases,
        reaped_waiters,
        leases=leases,
        waiters=waiters,
        grace_left=extra[0] / 1000,
        max_ttl=extra[1] / 1000,
        reasserted=extra[2],
        external=extra[3],
        external_left=extra[4] / 1000,
        overusers=_overusers(r[19] if len(r) > 19 else ""),
        policy=_s(r[20]) if len(r) > 20 else DEFAULT_POLICY,
        backfill_window=int(r[21]) / 1000 if len(r) > 21 else DEFAULT_BACKFILL_WINDOW_S,
        tenants=_tenants(r[22] if len(r) > 22 else []),
        devices=_devices(r[23] if len(r) > 23 else [], capacity, used),
        placement=_s(r[24]) if len(r) > 24 else DEFAULT_PLACEMENT,
        resident=int(r[25]) if len(r) > 25 else 0,
        resident_queued=int(r[26]) if len(r) > 26 else 0,
        drain=drain,
    )


def _with_estimates(
    waiters: list[WaiterInfo], free: int, drain: DrainRate | None
) -> list[WaiterInfo]:
    """The listed waiters (queue order, from the head) with their ``ahead_bytes`` and
    ``estimated_wait``; ``free``: capacity - external - used, bytes."""
    from dataclasses import replace

    out, ahead = [], 0
    for w in waiters:
        wait = wait_seconds(
            ahead_bytes=ahead, amount=w.amount, free_bytes=free, position=w.position, rate=drain
        )
        out.append(replace(w, ahead_bytes=ahead, estimated_wait=wait))
        ahead += w.amount
    return out


def _devices(flat: list[Any], capacity: int, used: int) -> list[DeviceUse]:
    """``status.lua``'s devices: {capacity, used, ...} per device; a pool of one device
    (an empty list) is its device 0."""
    if not flat:
        return [DeviceUse(0, capacity, used)]
    return [DeviceUse(i // 2, int(flat[i]), int(flat[i + 1])) for i in range(0, len(flat) - 1, 2)]


def _tenants(flat: list[Any]) -> dict[str, TenantUse]:
    """``status.lua``'s tenants: {tenant, used, quota, ...} as a dict by tenant."""
    return {
        _s(flat[i]): TenantUse(int(flat[i + 1]), int(flat[i + 2]))
        for i in range(0, len(flat) - 2, 3)
    }


def _overusers(raw: Any) -> list[dict[str, Any]]:
    """The report's over-users (``external.lua`` keeps the sampler's JSON as given)."""
    import json

    try:
        v = json.loads(_s(raw)) if raw else []
    except ValueError:
        return []
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


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
