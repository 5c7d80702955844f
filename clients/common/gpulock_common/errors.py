"""The exceptions of gpulock and gpulock-client: one tree, one set of classes. Every error either
raises derives from :class:`GpuLockError`::

    GpuLockError
    ├── InvalidArgument (also ValueError)   bad amount, ttl, pool name, request id, ...
    ├── AuthError                           gpulock-client: the broker refused the token
    ├── PoolNotFound                        the pool is not configured
    ├── CapacityExceeded                    amount > capacity: can never be granted
    │   ├── QuotaExceeded                   amount > the tenant's quota
    │   └── RoomExceeded                    amount > what the resident leases leave
    ├── AcquireTimeout (also TimeoutError)  the wait for a grant ran out (or timeout=0 and busy)
    ├── QueueFull                           the pool's queue is at its bound
    ├── ResizeRefused                       a lease's growth could only deadlock: refused at once
    ├── LeaseLost                           the lease expired, was reaped or never existed,
    │                                       or no renewal succeeded before the local deadline
    ├── BackendUnavailable                  Redis (or the broker) could not be reached, did not answer,
    │                                       or refused the credentials
    └── PoolClosed (also RuntimeError)      gpulock: the pool object was closed during (or before) the call

The core (``gpulock``) wraps redis-py's errors (``raise BackendUnavailable(...) from exc``) and
the SDK (``gpulock_client``) reads the broker's HTTP replies back into these classes and sets
``status``, so callers of either need catch only these. ``gpulock.errors`` and
``gpulock_client`` re-export them: the classes are the same objects on both sides. How each is
answered over HTTP (status, code, body fields) and read back is the error table,
:mod:`gpulock_common.wire`.
"""

from __future__ import annotations

from typing import Optional

from .units import format_size

__all__ = [
    "GpuLockError",
    "InvalidArgument",
    "AuthError",
    "PoolNotFound",
    "CapacityExceeded",
    "QuotaExceeded",
    "RoomExceeded",
    "AcquireTimeout",
    "QueueFull",
    "ResizeRefused",
    "LeaseLost",
    "BackendUnavailable",
    "PoolClosed",
]


class GpuLockError(Exception):
    """Root of every exception gpulock and gpulock-client raise. ``status`` is the HTTP status
    of the broker's reply that caused it (gpulock-client), or None (no reply, or the core)."""

    status: Optional[int] = None


class InvalidArgument(GpuLockError, ValueError):
    """An argument is malformed or out of range; the message names the bad value.
    Nothing was changed in Redis."""


class AuthError(GpuLockError):
    """The broker refused the bearer token: 401, none or an unknown one (set GPULOCK_TOKEN);
    403, the token may not use this pool or is not admin."""


class PoolNotFound(GpuLockError):
    """The pool has no configuration in Redis: it was never configured, or Redis lost its data
    (a restart without persistence). Configure it with ``pool.configure(capacity)`` or
    ``gpulock pool set NAME --capacity SIZE``. ``pool`` is its name; ``message`` replaces the
    default text (the SDK passes the broker's)."""

    def __init__(self, pool: str, message: Optional[str] = None):
        if message is None:
            message = (
                f"pool {pool!r} is not configured in Redis (never set up, or Redis restarted "
                f"without its data); run: gpulock pool set {pool} --capacity SIZE"
            )
        super().__init__(message)
        self.pool = pool


class CapacityExceeded(GpuLockError):
    """The requested amount is larger than the pool's whole capacity, so no wait could end
    with a grant. Raised at once. ``amount`` and ``capacity`` are in bytes; ``message``
    replaces the default text (the SDK passes the broker's)."""

    def __init__(self, amount: int, capacity: int, message: Optional[str] = None):
        if message is None:
            message = (
                f"amount {amount} bytes ({format_size(amount)}) exceeds the pool's capacity "
                f"{capacity} bytes ({format_size(capacity)})"
            )
        super().__init__(message)
        self.amount = amount
        self.capacity = capacity


class QuotaExceeded(CapacityExceeded):
    """The requested amount is larger than its tenant's quota on the pool, or than what the
    tenant's resident leases leave of it, so no wait could end with a grant (docs/SEMANTICS.md,
    "Tenant quotas", "Resident leases"). Raised at once. ``amount``, ``quota`` and
    ``resident`` (the tenant's resident leases; 0 when the quota alone is too small) are in
    bytes (``capacity`` is the quota too, for handlers of the base class); ``tenant`` names
    the tenant."""

    def __init__(
        self,
        amount: int,
        quota: int,
        tenant: str,
        message: Optional[str] = None,
        resident: int = 0,
    ):
        if message is None:
            message = (
                f"amount {amount} bytes ({format_size(amount)}) exceeds the quota of tenant "
                f"{tenant!r}, {quota} bytes ({format_size(quota)})"
            )
            if resident:
                room = max(0, quota - resident)
                message = (
                    f"amount {amount} bytes ({format_size(amount)}) exceeds what the resident "
                    f"leases of tenant {tenant!r} ({resident} bytes, {format_size(resident)}) "
                    f"leave of its quota of {quota} bytes ({format_size(quota)}): "
                    f"{room} bytes ({format_size(room)})"
                )
        super().__init__(amount, quota, message)
        self.quota = quota
        self.tenant = tenant
        self.resident = resident


class RoomExceeded(CapacityExceeded):
    """The requested amount fits the capacity but not the room the pool's resident leases (what
    holders keep for their whole life, such as model weights: ``acquire(resident=True)``)
    leave, held or queued, so no wait could end with a grant while they are held
    (docs/SEMANTICS.md, "Resident leases"). Raised at once. ``amount``, ``room`` (capacity
    minus resident), ``capacity`` and ``resident`` are in bytes, of the pool, or of ``device``
    (its index; -1: the pool's device with the most room) on a pool of several devices (None:
    the pool)."""

    def __init__(
        self,
        amount: int,
        room: int,
        capacity: int,
        resident: int,
        device: Optional[int] = None,
        message: Optional[str] = None,
    ):
        if message is None:
            where = (
                "the pool's capacity"
                if device is None
                else "the capacity of the pool's device with the most room"
                if device < 0
                else f"the capacity of device {device}"
            )
            message = (
                f"amount {amount} bytes ({format_size(amount)}) exceeds the room the resident "
                f"leases leave: {max(0, room)} bytes ({format_size(max(0, room))}) of {where}, "
                f"{capacity} bytes ({format_size(capacity)}), less {resident} bytes "
                f"({format_size(resident)}) of resident leases"
            )
        super().__init__(amount, capacity, message)
        self.room = room
        self.resident = resident
        self.device = device


class AcquireTimeout(GpuLockError, TimeoutError):
    """No grant within the timeout. The request has left the queue; nothing is held.

    Attributes: ``position`` (1-based place in the queue when last known, 0 if never queued),
    ``queue_length``, ``retry_after`` (seconds; the server's estimate of when the queue can
    next move, or None when unknown), ``waited`` (seconds), ``grace_left`` (seconds left in the
    pool's restart grace period when the wait ended, during which nothing new is granted; 0
    outside one: then the pool was short of memory; the message says which,
    :func:`gpulock_common.grace.grace_note`), ``estimated_wait`` (seconds: the server's wait
    estimate when the wait ended, docs/SEMANTICS.md "Wait estimate": for a request never
    queued, had it joined the queue's tail; None while the pool's drain rate is not measured,
    or when not known)."""

    def __init__(
        self,
        message: str,
        *,
        position: int = 0,
        queue_length: int = 0,
        retry_after: Optional[float] = None,
        waited: float = 0.0,
        grace_left: float = 0.0,
        estimated_wait: Optional[float] = None,
    ):
        super().__init__(message)
        self.position = position
        self.queue_length = queue_length
        self.retry_after = retry_after
        self.waited = waited
        self.grace_left = grace_left
        self.estimated_wait = estimated_wait


class QueueFull(GpuLockError):
    """The pool's queue holds ``max_waiters`` requests already; try again later.

    Attributes: ``pool``, ``queue_length``, ``max_waiters`` (None when not known: a broker
    older than it does not send it), ``retry_after`` (seconds: when to try again, the
    broker's ``Retry-After``; None when not known: the core's own, raised from Redis),
    ``estimated_wait`` (seconds: the server's estimate of the wait of a request joining the
    queue's tail, docs/SEMANTICS.md "Wait estimate"; None while the pool's drain rate is not
    measured, or when not known, as for ``retry_after``). ``message`` replaces the default
    text (the SDK passes the broker's)."""

    def __init__(
        self,
        pool: str,
        queue_length: int,
        max_waiters: Optional[int] = None,
        message: Optional[str] = None,
        *,
        retry_after: Optional[float] = None,
        estimated_wait: Optional[float] = None,
    ):
        if message is None:
            message = (
                f"pool {pool!r}: queue is full ({queue_length} waiting, max_waiters={max_waiters})"
            )
        super().__init__(message)
        self.pool = pool
        self.queue_length = queue_length
        self.max_waiters = max_waiters
        self.retry_after = retry_after
        self.estimated_wait = estimated_wait


class ResizeRefused(GpuLockError):
    """A lease's growth (``lease.resize`` to a larger amount) could not be granted at once, and
    waiting for it could never end: every other lease holding bytes on its device is resident
    or waits to grow itself, so nothing would free bytes for it (docs/SEMANTICS.md, "Resizing a
    lease"). The lease keeps its amount; finish with it, shrink it or release it.

    Attributes: ``lease_id`` (32 hex digits, or "?" when not known), ``amount`` (bytes asked),
    ``current`` (bytes the lease keeps). ``message`` replaces the default text."""

    def __init__(self, lease_id: str, amount: int, current: int, message: Optional[str] = None):
        if message is None:
            message = (
                f"lease {lease_id[:8]}…: growing it to {amount} bytes ({format_size(amount)}) "
                f"is refused: it cannot be granted now, and every other lease holding bytes on "
                f"its device is resident or waits to grow, so waiting could never end (a "
                f"deadlock); it keeps {current} bytes ({format_size(current)})"
            )
        super().__init__(message)
        self.lease_id = lease_id
        self.amount = amount
        self.current = current


class LeaseLost(GpuLockError):
    """The lease is no longer (or may no longer be) held: its validity deadline passed without
    a successful renewal, the server expired or reaped it, Redis lost it, or it was never
    ours. Stop using the GPU memory it covered; never release bytes on its behalf.
    Attributes: ``lease_id`` (32 hex digits, or "?" when the broker's reply named none),
    ``reason``."""

    def __init__(self, lease_id: str, reason: str):
        super().__init__(f"lease {lease_id[:8]}… lost: {reason}")
        self.lease_id = lease_id
        self.reason = reason


class BackendUnavailable(GpuLockError):
    """Redis (or, for gpulock-client, the broker or its Redis) could not be reached, or did not
    answer within the bound, after the retries that are safe for the operation. The core sets
    the original redis-py error as the ``__cause__``."""


class PoolClosed(GpuLockError, RuntimeError):
    """The pool object was closed (``close()``/``aclose()``) while this call waited, or before
    it: the wait ends at once, its request leaves the queue, and nothing is held.
    Attributes: ``pool``, ``queued`` (False: closed before the call, which never reached the
    queue)."""

    def __init__(self, pool: str, *, queued: bool = True):
        super().__init__(
            f"pool object for {pool!r} was closed while this call waited; the request left the queue"
            if queued
            else f"pool object for {pool!r} was closed before this call; nothing was queued or held"
        )
        self.pool = pool
        self.queued = queued
