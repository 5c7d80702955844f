"""gpulock's exceptions: the shared tree of :mod:`gpulock_common.errors` (the same classes
gpulock-client raises). Every error gpulock raises derives from :class:`GpuLockError`::

    GpuLockError
    ├── InvalidArgument (also ValueError)   bad amount, ttl, pool name, request id, ...
    ├── PoolNotFound                        the pool has no configuration in Redis
    ├── CapacityExceeded                    amount > capacity: can never be granted
    │   ├── QuotaExceeded                   amount > the tenant's quota on the pool (or what
    │   │                                   the tenant's resident leases leave of it)
    │   └── RoomExceeded                    amount > what the pool's resident leases leave
    ├── AcquireTimeout (also TimeoutError)  the wait for a grant ran out (or timeout=0 and busy)
    ├── QueueFull                           the pool's queue is at its bound
    ├── ResizeRefused                       a lease's growth could only deadlock: refused at once
    ├── LeaseLost                           the lease expired, was reaped or never existed
    ├── BackendUnavailable                  Redis could not be reached, did not answer, or refused the credentials
    └── PoolClosed (also RuntimeError)      the pool object was closed during (or before) the call

Errors from redis-py are wrapped (``raise BackendUnavailable(...) from exc``), so callers need
catch only these. (``AuthError``, the broker refusing a token, is raised only through a broker:
by gpulock-client and ``gpulock --broker-url``.)
"""

from __future__ import annotations

from gpulock_common.errors import (
    AcquireTimeout,
    BackendUnavailable,
    CapacityExceeded,
    GpuLockError,
    InvalidArgument,
    LeaseLost,
    PoolClosed,
    PoolNotFound,
    QueueFull,
    ResizeRefused,
    QuotaExceeded,
    RoomExceeded,
)

__all__ = [
    "GpuLockError",
    "InvalidArgument",
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
