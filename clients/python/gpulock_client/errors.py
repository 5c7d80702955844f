"""Exceptions raised by gpulock-client: the shared tree of :mod:`gpulock_common.errors`, the
same classes gpulock raises (``gpulock_client.LeaseLost is gpulock.errors.LeaseLost``). What
each means here, and the broker's reply it comes from (``status`` is set to its HTTP status;
the error table, :mod:`gpulock_common.wire`, reads each reply)::

    GpuLockError
    ├── InvalidArgument (also ValueError)   422 (400): a bad amount, ttl, pool name, request id...
    ├── AuthError                           401 (no or unknown token) / 403 (pool not allowed)
    ├── PoolNotFound                        404: the pool is not configured
    ├── CapacityExceeded                    413: amount > capacity, can never be granted
    │   ├── QuotaExceeded                   413 quota_exceeded: amount > the token's tenant's quota
    │   └── RoomExceeded                    413 room_exceeded: amount > what the resident leases leave
    ├── AcquireTimeout (also TimeoutError)  no grant before the timeout; the place was withdrawn
    ├── QueueFull                           503 queue_full: the pool's queue is at its bound
    ├── ResizeRefused                       409 resize_refused: a lease's growth could only deadlock
    ├── LeaseLost                           410 (404: another token's), or no successful renewal
    │                                       before the local deadline
    ├── BackendUnavailable                  502/503/504: the broker, or its Redis, did not answer in time
    └── PoolClosed (also RuntimeError)      the pool object was closed during (or before) the call
"""

from __future__ import annotations

from gpulock_common.errors import (
    AcquireTimeout,
    AuthError,
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
