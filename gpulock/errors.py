"""gpulock's exceptions. Every error gpulock raises derives from :class:`GpuLockError`::

    GpuLockError
    ├── InvalidArgument (also ValueError)   bad amount, ttl, pool name, request id, ...
    ├── PoolNotFound                        the pool has no configuration in Redis
    ├── CapacityExceeded                    amount > capacity: can never be granted
    ├── AcquireTimeout (also TimeoutError)  the wait for a grant ran out (or timeout=0 and busy)
    ├── QueueFull                           the pool's queue is at its bound
    ├── LeaseLost                           the lease expired, was reaped or never existed
    ├── BackendUnavailable                  Redis could not be reached, did not answer, or refused the credentials
    └── PoolClosed (also RuntimeError)      the pool object was closed during (or before) the call

Errors from redis-py are wrapped (``raise BackendUnavailable(...) from exc``), so callers need
catch only these.
"""

from __future__ import annotations

__all__ = [
    "GpuLockError",
    "InvalidArgument",
    "PoolNotFound",
    "CapacityExceeded",
    "AcquireTimeout",
    "QueueFull",
    "LeaseLost",
    "BackendUnavailable",
    "PoolClosed",
]


class GpuLockError(Exception):
    """Root of every exception gpulock raises."""


class InvalidArgument(GpuLockError, ValueError):
    """An argument is malformed or out of range; the message names the bad value.
    Nothing was changed in Redis."""


class PoolNotFound(GpuLockError):
    """The pool has no configuration in Redis: it was never configured, or Redis lost its data
    (a restart without persistence). Configure it with ``pool.configure(capacity)`` or
    ``gpulock pool set NAME --capacity SIZE``."""

    def __init__(self, pool: str):
        super().__init__(
            f"pool {pool!r} is not configured in Redis (never set up, or Redis restarted "
            f"without its data); run: gpulock pool set {pool} --capacity SIZE"
        )
        self.pool = pool


class CapacityExceeded(GpuLockError):
    """The requested amount is larger than the pool's whole capacity, so no wait could end
    with a grant. Raised at once. ``amount`` and ``capacity`` are in bytes."""

    def __init__(self, amount: int, capacity: int):
        from .units import format_size

        super().__init__(
            f"amount {amount} bytes ({format_size(amount)}) exceeds the pool's capacity "
            f"{capacity} bytes ({format_size(capacity)})"
        )
        self.amount = amount
        self.capacity = capacity


class AcquireTimeout(GpuLockError, TimeoutError):
    """No grant within the timeout. The request has left the queue; nothing is held.

    Attributes: ``position`` (1-based place in the queue when last known, 0 if never queued),
    ``queue_length``, ``retry_after`` (seconds; the server's estimate of when the queue can
    next move, or None when unknown), ``waited`` (seconds)."""

    def __init__(
        self,
        message: str,
        *,
        position: int = 0,
        queue_length: int = 0,
        retry_after: float | None = None,
        waited: float = 0.0,
    ):
        super().__init__(message)
        self.position = position
        self.queue_length = queue_length
        self.retry_after = retry_after
        self.waited = waited


class QueueFull(GpuLockError):
    """The pool's queue holds ``max_waiters`` requests already; try again later."""

    def __init__(self, pool: str, queue_length: int, max_waiters: int):
        super().__init__(
            f"pool {pool!r}: queue is full ({queue_length} waiting, max_waiters={max_waiters})"
        )
        self.pool = pool
        self.queue_length = queue_length
        self.max_waiters = max_waiters


class LeaseLost(GpuLockError):
    """The lease is no longer (or may no longer be) held: its validity deadline passed without
    a successful renewal, the server expired or reaped it, Redis lost it, or it was never
    ours. Stop using the GPU memory it covered; never release bytes on its behalf."""

    def __init__(self, lease_id: str, reason: str):
        super().__init__(f"lease {lease_id[:8]}… lost: {reason}")
        self.lease_id = lease_id
        self.reason = reason


class BackendUnavailable(GpuLockError):
    """Redis could not be reached, or did not answer within the bound, after the retries that
    are safe for the operation. The original redis-py error is the ``__cause__``."""


class PoolClosed(GpuLockError, RuntimeError):
    """The pool object was closed (``close()``/``aclose()``) while this call waited, or before
    it: the wait ends at once, its request leaves the queue, and nothing is held."""

    def __init__(self, pool: str, *, queued: bool = True):
        super().__init__(
            f"pool object for {pool!r} was closed while this call waited; the request left the queue"
            if queued
            else f"pool object for {pool!r} was closed before this call; nothing was queued or held"
        )
        self.pool = pool
        self.queued = queued  # False: closed before the call, which never reached the queue
