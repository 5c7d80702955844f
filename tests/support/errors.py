"""One instance of each shared error that has an HTTP answer (gpulock_common.wire), every
field the answer carries set to a value other than its default, so that a round trip that
drops or mixes up a field shows."""

from __future__ import annotations

from gpulock_common.errors import (
    AcquireTimeout,
    AuthError,
    BackendUnavailable,
    CapacityExceeded,
    GpuLockError,
    InvalidArgument,
    LeaseLost,
    PoolNotFound,
    QueueFull,
    QuotaExceeded,
    ResizeRefused,
    RoomExceeded,
)

from .pools import GiB

#: The pool the samples name.
POOL = "gpu-e"


def sample(cls: type[GpuLockError]) -> GpuLockError:
    """A fresh instance of ``cls`` (a class with a row in the error table)."""
    made = {
        InvalidArgument: lambda: InvalidArgument("ttl 600 is above the pool's max_ttl 60"),
        AuthError: lambda: AuthError("the token may not use this pool"),
        PoolNotFound: lambda: PoolNotFound(POOL),
        QuotaExceeded: lambda: QuotaExceeded(5 * GiB, 4 * GiB, "team-a", resident=GiB),
        RoomExceeded: lambda: RoomExceeded(3 * GiB, 2 * GiB, 10 * GiB, 8 * GiB, device=1),
        CapacityExceeded: lambda: CapacityExceeded(11 * GiB, 10 * GiB),
        AcquireTimeout: lambda: AcquireTimeout(
            "no grant in time", position=3, queue_length=5, retry_after=2.0, grace_left=4.5
        ),
        QueueFull: lambda: QueueFull(POOL, 7, 7),
        LeaseLost: lambda: LeaseLost("ab" * 16, "it expired on the server"),
        ResizeRefused: lambda: ResizeRefused("cd" * 16, 6 * GiB, 5 * GiB),
        BackendUnavailable: lambda: BackendUnavailable("Connection refused"),
    }
    return made[cls]()  # type: ignore[index]
