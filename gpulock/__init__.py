"""gpulock: a distributed GPU-memory semaphore kept in Redis.

Every process (and host) that shares a GPU takes a **lease** on bytes of a shared **pool**
before its CUDA work; leases expire unless their holder's heartbeat renews them, waiters queue
in FIFO order, and every lease carries a fencing token. See README.md and docs/.
"""

from gpulock._async import AsyncLease, AsyncPool
from gpulock.protocol.replies import LeaseInfo, PoolStatus, WaiterInfo
from gpulock._sync import Lease, Pool
from gpulock.errors import (
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
from gpulock.units import format_size, parse_size
from gpulock_common.options import Preemption

__version__ = "0.1.0"

__all__ = [
    "AcquireTimeout",
    "AsyncLease",
    "AsyncPool",
    "BackendUnavailable",
    "CapacityExceeded",
    "GpuLockError",
    "InvalidArgument",
    "Lease",
    "LeaseInfo",
    "LeaseLost",
    "Pool",
    "PoolClosed",
    "PoolNotFound",
    "PoolStatus",
    "Preemption",
    "QueueFull",
    "ResizeRefused",
    "QuotaExceeded",
    "RoomExceeded",
    "WaiterInfo",
    "format_size",
    "parse_size",
]
