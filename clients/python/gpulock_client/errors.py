"""Exceptions raised by gpulock-client. They mirror gpulock's own tree (same names and
attributes), so code written against ``gpulock`` reads the same::

    GpuLockError
    ├── InvalidArgument (also ValueError)   422: a bad amount, ttl, pool name, request id...
    ├── AuthError                           401 (no or unknown token) / 403 (pool not allowed)
    ├── PoolNotFound                        404: the pool is not configured
    ├── CapacityExceeded                    413: amount > capacity, can never be granted
    ├── AcquireTimeout (also TimeoutError)  no grant before the timeout; the place was withdrawn
    ├── QueueFull                           503 queue_full: the pool's queue is at its bound
    ├── LeaseLost                           410, or no successful renewal before the local deadline
    └── BackendUnavailable                  the broker, or its Redis, did not answer in time
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "GpuLockError",
    "InvalidArgument",
    "AuthError",
    "PoolNotFound",
    "CapacityExceeded",
    "AcquireTimeout",
    "QueueFull",
    "LeaseLost",
    "BackendUnavailable",
]


class GpuLockError(Exception):
    """Root of every exception gpulock-client raises. ``status`` is the HTTP status, when
    one was received."""

    status: Optional[int] = None


class InvalidArgument(GpuLockError, ValueError):
    """The broker refused an argument (422); the message names the field."""


class AuthError(GpuLockError):
    """401: no valid bearer token (set GPULOCK_TOKEN); 403: the token may not use this pool
    or is not admin."""


class PoolNotFound(GpuLockError):
    """The pool is not configured on the broker's Redis (an admin creates it)."""


class CapacityExceeded(GpuLockError):
    """``amount`` (bytes) is larger than the pool's ``capacity`` (bytes): never grantable."""

    def __init__(self, message: str, amount: int = 0, capacity: int = 0):
        super().__init__(message)
        self.amount, self.capacity = amount, capacity


class AcquireTimeout(GpuLockError, TimeoutError):
    """No grant within the timeout; the place in the queue was withdrawn, nothing is held.
    ``position`` (last known, 0 if never queued), ``queue_length``, ``retry_after`` (seconds
    or None), ``waited`` (seconds)."""

    def __init__(
        self,
        message: str,
        *,
        position: int = 0,
        queue_length: int = 0,
        retry_after: Optional[float] = None,
        waited: float = 0.0,
    ):
        super().__init__(message)
        self.position, self.queue_length, self.retry_after, self.waited = (
            position,
            queue_length,
            retry_after,
            waited,
        )


class QueueFull(GpuLockError):
    """The pool's queue is at its bound; try again later."""

    def __init__(self, message: str, queue_length: int = 0):
        super().__init__(message)
        self.queue_length = queue_length


class LeaseLost(GpuLockError):
    """The lease is (or may be) no longer held: the broker answered 410, or no renewal
    succeeded before the local validity deadline. Stop using the memory it covered."""

    def __init__(self, lease_id: str, reason: str):
        super().__init__(f"lease {lease_id[:8]}… lost: {reason}")
        self.lease_id, self.reason = lease_id, reason


class BackendUnavailable(GpuLockError):
    """The broker could not be reached, or answered that its Redis is unavailable, for longer
    than the bound (``backend_timeout``, or the acquire's timeout)."""
