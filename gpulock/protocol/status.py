"""``status.lua``'s reply decoded: :func:`decode_status` -> :class:`PoolStatus` (with
:class:`LeaseInfo`, :class:`WaiterInfo`, :class:`TenantUse`, :class:`DeviceUse`), each listed
waiter with its wait estimate (gpulock.estimates.wait). No I/O; the reply's layout is in
``lua/status.lua``'s header. ``gpulock.protocol.replies`` re-exports these names, the one place
the core's readers take replies from."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from gpulock_common.options import (
    DEFAULT_BACKFILL_WINDOW_S,
    DEFAULT_PLACEMENT,
    DEFAULT_POLICY,
    Preemption,
)

from gpulock.errors import CapacityExceeded, QuotaExceeded, RoomExceeded
from gpulock.estimates.wait import DrainRate, wait_seconds, wait_seconds_at_tail
from gpulock.protocol.args import decode_meta
from gpulock.protocol.args import reply_text as _s
from gpulock.protocol.queue_config import QueueConfig

__all__ = [
    "DeviceUse",
    "LeaseInfo",
    "PoolStatus",
    "TenantUse",
    "WaiterInfo",
    "YieldCounts",
    "decode_status",
]


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
    # Preemption (docs/SEMANTICS.md, "Preemption"): seconds, on the server clock, until the
    # pool takes the lease back when it was asked to yield (None: not asked); and the priority
    # it was acquired at, None when it can never be asked (resident, not preemptible, or
    # granted by an earlier version).
    yield_in: float | None = None
    priority: int | None = None
    # Kept bytes (docs/SEMANTICS.md, "Kept bytes"): its holder released it and keeps it for its
    # own next requests, giving it back when a request does not fit (False: a lease held as
    # usual, or from an earlier version).
    kept: bool = False

    @property
    def yield_requested(self) -> bool:
        """Whether the lease was asked to yield."""
        return self.yield_in is not None


@dataclass(frozen=True)
class YieldCounts:
    """A pool's preemption counters (docs/SEMANTICS.md, "Preemption"), since the pool was
    made: leases asked to yield, asked leases released before being taken back (``done``) and
    the seconds from ask to release summed over them, asked leases taken back (expired)."""

    asked: int = 0
    done: int = 0
    done_seconds: float = 0.0
    taken: int = 0

    @property
    def outstanding(self) -> int:
        """Leases asked to yield and not gone yet (neither released nor taken back)."""
        return max(0, self.asked - self.done - self.taken)

    @property
    def mean_time_to_yield(self) -> float | None:
        """Mean seconds from ask to release of the leases that yielded; None when none did."""
        return self.done_seconds / self.done if self.done else None


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
    # Preemption (docs/SEMANTICS.md, "Preemption"): the pool's setting (None: off) and its
    # counters.
    preemption: Preemption | None = None
    yields: YieldCounts = field(default_factory=YieldCounts)
    # Kept bytes (docs/SEMANTICS.md, "Kept bytes"): the bytes (counted in ``used``) and the
    # count of the leases their holders keep, every one of them, not just the listed; and the
    # counters since the pool was made: releases answered "kept", and kept leases whose
    # holders were asked to give them back (a request did not fit). 0 from an older server.
    kept_bytes: int = 0
    kept_leases: int = 0
    releases_kept: int = 0
    kept_asked_back: int = 0

    @property
    def kept(self) -> list[LeaseInfo]:
        """The listed leases their holders keep."""
        return [x for x in self.leases if x.kept]

    @property
    def yielding(self) -> list[LeaseInfo]:
        """The listed leases asked to yield (and not gone yet)."""
        return [x for x in self.leases if x.yield_in is not None]

    def estimated_wait_for(self, amount: int) -> float | None:
        """Estimated seconds a request of ``amount`` bytes would wait if it joined the
        queue's tail now (gpulock.estimates.wait.wait_seconds_at_tail), every queued byte
        ahead of it: the listed waiters' amounts, their mean standing in for each waiter not
        listed. It does not leave out the waiters such a request would pass (lib.lua
        ahead_of: under backfill, past a tenant at its quota), so there it is an upper bound;
        acquire's own answer (``timeout=0``) counts them. None while the drain rate is not
        measured."""
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
            grace_left=self.grace_left,
        )

    def retry_hint(self) -> float | None:
        """The scripts' hint of when the queue can next move (``retry_after_ms`` of acquire.lua's
        answer, lib.lua ``next_expiry_in``), read off the snapshot: seconds left in the grace
        period, else until the nearest lease expiry (leases are listed nearest first); None
        when no lease is held."""
        if self.grace_left > 0:
            return self.grace_left
        return max(0.0, self.leases[0].expires_in) if self.leases else None

    def queue_config(self) -> QueueConfig:
        """The pool's scheduling settings as ``configure.lua`` takes them."""
        spec = " ".join(f"{t}={u.quota}" for t, u in self.tenants.items() if u.quota)
        devs = " ".join(str(d.capacity) for d in self.devices) if len(self.devices) > 1 else ""
        return QueueConfig(
            self.policy,
            round(self.backfill_window * 1000),
            spec,
            devs,
            self.placement,
            self.preemption.to_wire() if self.preemption else "off",
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
            (int(x[10]) - now) / 1000 if len(x) > 10 and int(x[10]) else None,
            int(_s(x[11])) if len(x) > 11 and _s(x[11]) else None,
            len(x) > 12 and int(x[12]) == 1,
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
            int(x[10]) if len(x) > 10 else 0,
        )
        for i, x in enumerate(r[13])
    ]
    counts = [int(x[11]) if len(x) > 11 else None for x in r[13]]
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
    drain = (
        DrainRate.from_wire(int(r[27]), int(r[28]), int(r[29]) if len(r) > 29 else 0)
        if len(r) > 28
        else None
    )
    waiters = _with_estimates(waiters, counts, capacity - extra[3] - used, drain, extra[0] / 1000)
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
        # after out_of_order_pm: preempt, y_asked, y_done, y_done_ms, y_taken
        preemption=Preemption.from_wire(_s(r[30])) if len(r) > 30 else None,
        yields=(
            YieldCounts(int(r[31]), int(r[32]), int(r[33]) / 1000, int(r[34]))
            if len(r) > 34
            else YieldCounts()
        ),
        # after y_taken: kept_bytes, kept_count, k_kept, k_told
        **_kept(r[35:39]),
    )


def _kept(r: list[Any]) -> dict[str, int]:
    """``status.lua``'s kept bytes fields (kept_bytes, kept_count, k_kept, k_told) as
    :class:`PoolStatus`'s keyword arguments; none from a server older than them."""
    if len(r) < 4:
        return {}
    return dict(zip(("kept_bytes", "kept_leases", "releases_kept", "kept_asked_back"), map(int, r)))


def _with_estimates(
    waiters: list[WaiterInfo],
    counts: list[int | None],
    free: int,
    drain: DrainRate | None,
    grace_left: float,
) -> list[WaiterInfo]:
    """The listed waiters (queue order, from the head; ``ahead_bytes`` as the script counted
    them, lib.lua ahead_of) with their ``estimated_wait``; ``counts``: each one's count of
    waiters ahead, the script's (None: every one before it); ``free``: capacity - external -
    used, bytes; ``grace_left``: seconds."""
    return [
        replace(
            w,
            estimated_wait=wait_seconds(
                ahead_bytes=w.ahead_bytes,
                amount=w.amount,
                free_bytes=free,
                position=w.position,
                rate=drain,
                grace_left=grace_left,
                ahead_count=n,
            ),
        )
        for w, n in zip(waiters, counts)
    ]


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
