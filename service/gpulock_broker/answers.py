"""Answer bodies of the HTTP lease API (``/v1``); the request bodies are in :mod:`.models`.
Units: amounts in bytes, durations in seconds, instants as Unix seconds on the Redis server's
clock."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, Field


class QueuedPlace(BaseModel):
    """Where a granted request waited in the queue (the place its 503 ``queued`` would have
    said), for a request granted after it queued within the same HTTP request."""

    position: int = Field(
        ...,
        description="1-based place it took in the queue when the broker enqueued this request "
        "(a retry with the same request_id: its place then)",
    )
    queue_length: int = Field(..., description="waiters queued then, itself included")
    estimated_wait_s: Optional[float] = Field(
        None,
        description="seconds until the grant, the server's estimate then (docs/SEMANTICS.md, "
        "'Wait estimate'); null while the pool's drain rate is not measured",
    )


class LeaseGrant(BaseModel):
    lease_id: str = Field(..., description="32 hex digits; the path of PUT/DELETE.")
    pool: str
    amount: int = Field(..., description="bytes")
    token: int = Field(..., description="Fencing token: strictly increasing per pool.")
    ttl: float = Field(..., description="seconds")
    expires_in: float = Field(
        ...,
        description="Seconds left on the server clock when this reply was made. "
        "Count them from when you *sent* the request plus ``held_ms`` × (1 − 1%) "
        "(Chubby's rule).",
    )
    expires_at: float = Field(..., description="Unix seconds, Redis server clock.")
    acquired_at: float = Field(..., description="Unix seconds, Redis server clock.")
    request_id: str
    device: int = Field(
        0,
        description="The index of the device the lease is on (0 on a pool of one device).",
    )
    held_ms: int = Field(
        0,
        description="Milliseconds the broker held this request (a long poll) before "
        "answering, on its own monotonic clock. Count ``expires_in`` from "
        "``sent + held_ms/1000 * (1 - 1%)`` instead of from ``sent``.",
    )
    queued: Optional[QueuedPlace] = Field(
        None,
        description="Where this request waited in the queue before its grant (a long poll "
        "granted after it queued): its place, the queue's length and the estimate when it "
        "queued, as a 503 queued says them. Null when this request was granted at once "
        "(it never queued).",
    )


class LeaseRenewed(BaseModel):
    lease_id: str
    pool: str
    token: int
    ttl: float
    expires_in: float = Field(..., description="seconds left, server clock, at the reply")
    expires_at: float
    device: int = Field(
        0, description="The index of the device the lease is on (0 on a pool of one device)."
    )
    yield_requested: bool = Field(
        False,
        description="True when the server asked the holder to yield this lease: a queued "
        "request of higher priority waits for its bytes (preemption, a pool setting). Release "
        "it by yield_deadline_s; renewals no longer extend it past that deadline, where the "
        "server takes the bytes back (the lease is lost).",
    )
    yield_deadline_s: Optional[float] = Field(
        None,
        description="When yield_requested: seconds left until the server takes the lease back, "
        "server clock, at the reply (count them as expires_in is counted); else null.",
    )


class LeaseResized(BaseModel):
    lease_id: str
    pool: str
    amount: int = Field(..., description="bytes: the lease's amount now")
    token: int = Field(..., description="Fencing token: unchanged by a resize.")
    ttl: float
    expires_in: float = Field(
        ...,
        description="Seconds left on the server clock when this reply was made. Count them "
        "from when you *sent* the request plus ``held_ms`` × (1 − 1%).",
    )
    expires_at: float = Field(..., description="Unix seconds, Redis server clock.")
    device: int = Field(
        0, description="The index of the device the lease is on (0 on a pool of one device)."
    )
    held_ms: int = Field(
        0,
        description="Milliseconds the broker held this request (a long poll) before it read "
        "the lease's expiry, on its own monotonic clock.",
    )


class LeaseReleased(BaseModel):
    lease_id: str
    pool: str
    released: bool = True
    released_at: Optional[float] = Field(
        None, description="Unix seconds, server clock (None on a repeat)."
    )


class RequestCancelled(BaseModel):
    request_id: str
    pool: str
    outcome: Literal["none", "left_queue", "released_grant"]


class LeaseInfoOut(BaseModel):
    lease_id: str
    amount: int
    token: int
    expires_in: float
    held_for: float
    ttl: float
    holder: dict[str, Any]
    tenant: str = Field("", description="the tenant its bytes count under; empty for none")
    device: int = Field(0, description="the device it is on (0 on a pool of one device)")
    yield_in: Optional[float] = Field(
        None,
        description="asked to yield (docs/SEMANTICS.md, 'Preemption'): seconds until the pool "
        "takes it back; null when not asked",
    )
    priority: Optional[int] = Field(
        None,
        description="the priority it was acquired at; null when it can never be asked to "
        "yield (resident, not preemptible)",
    )
    kept: bool = Field(
        False,
        description="its holder released it and keeps it for its own next requests, giving it "
        "back when a request does not fit (docs/SEMANTICS.md, 'Kept bytes')",
    )


class PreemptionOut(BaseModel):
    """A pool's preemption setting, on (docs/SEMANTICS.md, "Preemption")."""

    gap: int = Field(..., description="priority levels a head waiter must be above a holder")
    yield_grace_s: float = Field(..., description="seconds an asked lease has to release")


class YieldCountsOut(BaseModel):
    """A pool's preemption counters since it was made (docs/SEMANTICS.md, "Preemption")."""

    asked: int = Field(0, description="leases asked to yield")
    done: int = Field(0, description="asked leases released before being taken back")
    done_seconds: float = Field(0.0, description="seconds from ask to release, summed over done")
    taken: int = Field(0, description="asked leases the pool took back (they expired)")


class WaiterInfoOut(BaseModel):
    position: int
    amount: int
    waited: float
    holder: dict[str, Any]
    priority: int = Field(
        0,
        description="As requested (the queue ages it: one level per second waited); 0 for "
        "requests made without one.",
    )
    tenant: str = Field("", description="the tenant it asks for; empty for none")
    device: Optional[int] = Field(
        None, description="the device it asks for; null: any (the pool places it)"
    )
    growth_of: Optional[str] = Field(
        None,
        description="a queued growth of a held lease (docs/SEMANTICS.md, 'Resizing a lease'): "
        "the lease's id, amount being the bytes it grows by; null for a new request",
    )
    growth_token: Optional[int] = Field(
        None, description="a queued growth: the fencing token of the lease it grows; else null"
    )
    estimated_wait_s: Optional[float] = Field(
        None,
        description="seconds until its grant, estimated from the pool's drain rate and the "
        "bytes ahead of it (docs/SEMANTICS.md, 'Wait estimate'); null while the rate is not "
        "measured",
    )


class TenantUseOut(BaseModel):
    used: int = Field(..., description="bytes the tenant's live leases hold")
    quota: int = Field(..., description="bytes its leases may hold; 0 for no quota")


class DeviceUseOut(BaseModel):
    index: int = Field(..., description="the device's index, from 0")
    capacity: int = Field(..., description="bytes")
    used: int = Field(..., description="bytes its live leases hold")


class DrainOut(BaseModel):
    """How fast a pool's queue drains while it is busy (docs/SEMANTICS.md, "Wait estimate")."""

    bytes_per_s: float = Field(..., description="bytes granted to queued requests per second")
    grants_per_s: float = Field(..., description="grants to queued requests per second")
    out_of_order: float = Field(
        0.0,
        description="the share of those grants that passed an earlier waiter (0 to 1; the "
        "estimate stretches waits by 1 / (1 - min(share, 1/3)))",
    )


class PoolOut(BaseModel):
    pool: str
    capacity: int
    used: int
    free: int
    epoch: int
    fence: int
    max_waiters: int
    max_ttl: float = Field(
        ..., description="seconds: the longest ttl a lease may have (0: unbounded)"
    )
    lease_count: int
    waiter_count: int
    grants: int
    reaped_leases: int
    reaped_waiters: int
    leases: list[LeaseInfoOut] = []
    waiters: list[WaiterInfoOut] = []
    policy: str = Field(
        ..., description='queue policy: "fifo" or "backfill" (docs/SEMANTICS.md, "Backfill")'
    )
    backfill_window: float = Field(
        ..., description="seconds a head that does not fit may be passed under backfill"
    )
    tenants: dict[str, TenantUseOut] = Field(
        default_factory=dict,
        description="tenants with a quota or a live lease: use and quota, bytes",
    )
    devices: list[DeviceUseOut] = Field(
        ...,
        description="the pool's devices, device 0 first (one for a pool of one device): "
        "capacity and use, bytes",
    )
    placement: str = Field(
        ...,
        description='where a request that names no device goes: "bestfit" or "spread" '
        '(docs/SEMANTICS.md, "Devices and placement")',
    )
    drain: Optional[DrainOut] = Field(
        None,
        description="the queue's drain rate while busy, the waiters' estimates' input; null "
        'while not measured (a new pool, docs/SEMANTICS.md, "Wait estimate")',
    )
    preemption: Optional[PreemptionOut] = Field(None, description="the setting; null: off")
    yields: YieldCountsOut = Field(default_factory=YieldCountsOut)
    kept_bytes: int = Field(
        0,
        description="bytes of the leases their holders keep (part of used; docs/SEMANTICS.md, "
        "'Kept bytes')",
    )
    kept_leases: int = Field(0, description="the leases their holders keep, all of them")
    releases_kept: int = Field(0, description="releases the pool answered 'kept'")
    kept_asked_back: int = Field(
        0,
        description="kept leases whose holders were asked to give them back (a request did "
        "not fit)",
    )


class UnreachableShard(BaseModel):
    """A shard of a Redis Cluster the list could not read (its pools are not listed)."""

    node: Optional[str] = Field(
        ...,
        description='its master, "host:port" (null for slots that no master serves)',
        examples=["10.0.0.7:6379"],
    )
    slots: list[list[int]] = Field(
        ...,
        description="its slot ranges, each [first, last] (inclusive)",
        examples=[[[0, 5460]]],
    )
    error: str = Field(
        ...,
        description="why: the connection error, or that it did not answer within the "
        "listing's bound (2 s)",
    )


class PoolList(BaseModel):
    pools: list[PoolOut] = Field(
        ..., description="the pools this token may use, of every shard that answered"
    )
    unreachable: list[UnreachableShard] = Field(
        default_factory=list,
        description="the shards of a Redis Cluster that did not answer (empty when every "
        "shard answered, always on a lone Redis); the answer is then partial, still 200 "
        '(docs/CLUSTER.md, "Listing while a shard is down")',
    )


class PoolConfigured(BaseModel):
    pool: str
    created: bool
    capacity: int
    epoch: int
    used: int
    max_waiters: int
    max_ttl: float = Field(..., description="seconds")
    policy: str = Field(..., description='queue policy: "fifo" or "backfill"')
    backfill_window: float = Field(..., description="seconds (backfill's window)")
    quotas: dict[str, int] = Field(
        default_factory=dict, description="every tenant quota of the pool, bytes by tenant"
    )
    devices: list[int] = Field(
        ..., description="each device's capacity, bytes, device 0 first (one item: one device)"
    )
    placement: str = Field(..., description='"bestfit" or "spread"')
    preemption: Optional[PreemptionOut] = Field(
        None, description='the preemption setting now (docs/SEMANTICS.md, "Preemption"); null: off'
    )


class PoolDeleted(BaseModel):
    pool: str
    deleted: bool = True
    leases: int = Field(..., description="live leases dropped with the pool (only with force=true)")
    waiters: int = Field(
        ..., description="live waiting requests dropped with the pool (only with force=true)"
    )


class ErrorDetail(BaseModel):
    error: str = Field(
        ...,
        description="unauthorized, forbidden, queued, busy, queue_full, queue_timeout, "
        "backend_unavailable, capacity_exceeded, room_exceeded, quota_exceeded, "
        "pool_not_found, "
        "pool_in_use, resize_refused, lease_lost, not_found, invalid; from the HTTP "
        "guards: invalid_utf8, invalid_json, nested_too_deeply, "
        "request_too_large, request_timeout",
    )
    message: str
    request_id: Optional[str] = None
    position: Optional[int] = Field(None, description="1-based place in the queue")
    queue_length: Optional[int] = None
    retry_after: Optional[float] = Field(
        None, description="seconds; the Retry-After header, rounded up"
    )
    hold_place_for: Optional[float] = Field(
        None, description="seconds the place is kept for a retry with the same request_id"
    )
    estimated_wait_s: Optional[float] = Field(
        None,
        description="queued, busy, queue_full, queue_timeout: seconds until the grant, "
        "estimated from the pool's drain rate and the bytes ahead (busy, queue_full: had it "
        "joined the queue's tail); null while the rate is not measured (docs/SEMANTICS.md, "
        "'Wait estimate')",
    )
    max_waiters: Optional[int] = Field(
        None, description="queue_full: the pool's bound on its queue (waiters)"
    )
    grace_left: Optional[float] = Field(
        None,
        description="queued, busy: seconds left in the pool's restart grace period (Redis lost "
        "its data; nothing new is granted until it ends), 0 outside one",
    )
    lease_id: Optional[str] = None
    amount: Optional[int] = None
    current: Optional[int] = Field(None, description="resize_refused: the bytes the lease keeps")
    capacity: Optional[int] = None
    room: Optional[int] = Field(
        None, description="room_exceeded: the capacity less the resident leases (bytes)"
    )
    resident: Optional[int] = Field(
        None,
        description="room_exceeded, quota_exceeded: bytes of the resident leases held and "
        "queued (of the token's tenant for quota_exceeded)",
    )
    leases: Optional[int] = Field(None, description="pool_in_use: the live leases")
    waiters: Optional[int] = Field(None, description="pool_in_use: the live waiting requests")


class ErrorResponse(BaseModel):
    detail: ErrorDetail
