"""gpulock-client: lease GPU memory from a gpulock pool through its HTTP lease API.

``Pool``/``AsyncPool`` and ``Lease``/``AsyncLease`` have the surface of gpulock's own classes
(acquire, lease, ensure_valid, on_lost, token, release); the errors are gpulock's own classes
(from gpulock-common, which holds the error tree and the lease validity clock both share).
Depends on httpx and gpulock-common only.
"""

from gpulock_common.options import Preemption

from ._async import AsyncLease, AsyncPool
from ._sync import Lease, Pool
from .errors import (
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

__version__ = "0.1.0"

__all__ = [
    "AcquireTimeout",
    "AsyncLease",
    "AsyncPool",
    "AuthError",
    "BackendUnavailable",
    "CapacityExceeded",
    "GpuLockError",
    "InvalidArgument",
    "Lease",
    "LeaseLost",
    "Pool",
    "PoolClosed",
    "PoolNotFound",
    "Preemption",
    "QueueFull",
    "ResizeRefused",
    "QuotaExceeded",
    "RoomExceeded",
]
