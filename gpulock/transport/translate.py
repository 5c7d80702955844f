"""Error translation: a redis-py error (or an ``OSError`` from the connection) as the error of
gpulock's own tree (:mod:`gpulock.errors`), naming the pool. No I/O.
"""

from __future__ import annotations

import re

import redis.exceptions as rex

from gpulock.units import format_size
from gpulock.errors import (
    BackendUnavailable,
    CapacityExceeded,
    QuotaExceeded,
    RoomExceeded,
    GpuLockError,
    InvalidArgument,
    LeaseLost,
    PoolNotFound,
    QueueFull,
    ResizeRefused,
)


# acquire.lua's refusal of a ttl over the pool's max (milliseconds, the scripts' unit), and
# the message it becomes here (seconds, the API's unit), which the CLI reads back
_TTL_OVER_MAX_MS = re.compile(r"ttl_ms (\d+) exceeds the pool's max_ttl_ms (\d+)")
TTL_OVER_MAX = re.compile(r"ttl ([0-9.]+) s is longer than the pool's max ttl of ([0-9.]+) s")


def _seconds(ms: str) -> str:
    return f"{int(ms) / 1000:.3f}".rstrip("0").rstrip(".")


def _bad_argument(rest: str) -> InvalidArgument:
    m = _TTL_OVER_MAX_MS.fullmatch(rest)
    if m:
        ttl, mx = _seconds(m.group(1)), _seconds(m.group(2))
        return InvalidArgument(
            f"ttl {ttl} s is longer than the pool's max ttl of {mx} s: give a ttl of {mx} s "
            "or less, or raise the pool's max ttl (configure(max_ttl=...), gpulock pool set "
            "NAME --max-ttl)"
        )
    return InvalidArgument(rest)


def translate(exc: BaseException, pool: str) -> BaseException:
    """Map a redis-py error to gpulock's tree (the caller raises it ``from exc``)."""
    if isinstance(exc, GpuLockError):
        return exc
    if isinstance(exc, (rex.MovedError, rex.AskError)):
        # Only a client of one server sees these: its server is a cluster node that does not
        # serve this pool's slot (the probe at connect could not tell, e.g. it was down then).
        return InvalidArgument(
            f"the Redis server is a Redis Cluster node, and pool {pool!r}'s slot is served by "
            f"another node ({exc}); connect with a cluster URL, redis+cluster://HOST:PORT[,...], "
            f"or a redis.cluster.RedisCluster client"
        )
    if isinstance(
        exc, (rex.ClusterDownError, rex.TryAgainError, rex.ClusterError, rex.RedisClusterException)
    ):
        return BackendUnavailable(f"Redis Cluster unavailable for pool {pool!r}: {exc}")
    if isinstance(exc, rex.ResponseError):
        msg = str(exc)
        code, _, rest = msg.partition(" ")
        if code == "GPULOCK_BADARG":
            return _bad_argument(rest)
        if code == "GPULOCK_CONFLICT":
            return InvalidArgument(rest)
        if code == "GPULOCK_NOPOOL":
            return PoolNotFound(pool)
        if code == "GPULOCK_CAPACITY":
            a, c, *dev = rest.split()
            if dev[:1] == ["device"] and len(dev) == 2:  # a pool of several devices
                which = "the pool's largest device" if dev[1] == "any" else f"device {dev[1]}"
                return CapacityExceeded(
                    int(a),
                    int(c),
                    f"amount {a} bytes ({format_size(int(a))}) exceeds the capacity of {which}, "
                    f"{c} bytes ({format_size(int(c))}): a lease is on one device",
                )
            return CapacityExceeded(int(a), int(c))
        if code == "GPULOCK_QUOTA":
            a, q, t, *held = rest.split()
            return QuotaExceeded(int(a), int(q), t, resident=int(held[0]) if held else 0)
        if code == "GPULOCK_ROOM":
            a, room, c, r, *dev = rest.split()
            device = None
            if dev[:1] == ["device"] and len(dev) == 2:  # a pool of several devices
                device = -1 if dev[1] == "any" else int(dev[1])
            return RoomExceeded(int(a), int(room), int(c), int(r), device)
        if code == "GPULOCK_QUEUEFULL":
            q, m = rest.split()
            return QueueFull(pool, int(q), int(m))
        if code == "GPULOCK_LOST":  # resize.lua: no such live lease
            lid = (rest.split() + ["?"])[0]
            return LeaseLost(
                lid, "the server no longer has it (it expired, was released, or another token)"
            )
        if code == "GPULOCK_RESIZE_REFUSED":
            a, c, _dev, lid = (rest.split() + ["0", "0", "0", "?"])[:4]
            return ResizeRefused(lid, int(a), int(c))
        if code == "GPULOCK_KEYTYPE":
            key, found, expected = (rest.split() + ["?", "?", "?"])[:3]
            return BackendUnavailable(
                f"pool {pool!r} is damaged: Redis key {key} is a {found}, not a {expected} (something "
                f"other than gpulock wrote under its prefix); nothing was changed. Delete that key, "
                f"or the pool's keys, to repair it"
            )
        if isinstance(exc, rex.OutOfMemoryError) or "maxmemory" in msg:
            return BackendUnavailable(
                f"Redis is out of memory (maxmemory reached with a no-eviction policy); pool {pool!r} "
                f"was not changed: {msg}"
            )
        if isinstance(exc, rex.NoPermissionError):
            return BackendUnavailable(
                f"Redis refused a gpulock script on pool {pool!r} for lack of permission (ACL; see "
                f"docs/RELIABILITY.md for the ACL gpulock needs): {msg}"
            )
        return BackendUnavailable(f"Redis refused a gpulock script on pool {pool!r}: {msg}")
    if isinstance(exc, rex.AuthenticationError):
        return BackendUnavailable(
            f"Redis refused gpulock's credentials for pool {pool!r} ({exc}); check the password or the "
            f"ACL user in the Redis URL (GPULOCK_REDIS_URL / --redis-url)"
        )
    if isinstance(exc, (rex.ConnectionError, rex.TimeoutError, OSError)):
        from gpulock.transport.connect import short_error

        return BackendUnavailable(f"Redis unavailable for pool {pool!r}: {short_error(exc)}")
    if isinstance(exc, rex.RedisError):
        return BackendUnavailable(f"Redis error on pool {pool!r}: {exc}")
    return exc


def translated(exc: BaseException, pool: str) -> BaseException:
    """``exc`` as a driver sends it into a flow (:mod:`gpulock.protocol.steps`): a redis-py
    error or an ``OSError`` as gpulock's (:func:`translate`), with ``exc`` as its
    ``__cause__``; anything else (gpulock's own errors, a cancellation, an interrupt) as it
    is."""
    err = translate(exc, pool)
    if err is not exc:
        err.__cause__ = exc
    return err
