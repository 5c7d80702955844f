"""The retry policy of gpulock's idempotent Redis calls: which errors are retried
(:data:`RETRYABLE`), for how long (:func:`retry_bound`), on which schedule
(:func:`retry_delay`), and the tenacity loop that applies them (:func:`retrying`).
"""

from __future__ import annotations

import random
from typing import Any

import redis.exceptions as rex


def retry_bound(backend_timeout: float, time_left: float | None) -> float:
    """Seconds a call made for a caller with a deadline retries :data:`RETRYABLE` errors:
    the ``time_left`` until that deadline, so that a failover or a migration shorter than the
    caller's own timeout is ridden out, and a caller that would wait 0.5 s for a grant does not
    wait 5 s for Redis; at least 1 s (or ``backend_timeout`` when shorter), so that a try-once
    acquire still rides out a dropped connection. ``backend_timeout`` for a caller without a
    deadline (``time_left`` None)."""
    if time_left is None:
        return backend_timeout
    return max(time_left, min(1.0, backend_timeout))


# Errors worth retrying for idempotent operations: the request may or may not have run.
RETRYABLE = (
    rex.ConnectionError,
    rex.TimeoutError,
    ConnectionError,
    OSError,
    rex.ClusterDownError,  # a cluster shard without a master: a failover in progress
    rex.TryAgainError,  # a slot being migrated
    rex.ClusterError,  # redis-py's redirect budget spent ("TTL exhausted"): a slot moving
    rex.RedisClusterException,  # no seed node of a cluster reachable (redis-py's wording)
)

# The retry schedule (seconds): full jitter over 0.05 s doubling per attempt, capped at 0.5 s.
RETRY_BASE_S, RETRY_CAP_S = 0.05, 0.5


def retry_delay(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (1: the first retry) of a Redis call
    that failed with a :data:`RETRYABLE` error: uniform in [0, min(0.5 s, 0.05 s × 2^(attempt-1))].
    The one schedule of every retry gpulock makes, foreground calls and background loops alike."""
    return random.uniform(0.0, min(RETRY_CAP_S, RETRY_BASE_S * 2.0 ** min(max(attempt, 1) - 1, 30)))


def retrying(bound: float, *, asynchronous: bool) -> Any:
    """The one retry policy of gpulock's idempotent Redis calls, for foreground and background
    calls alike: retry :data:`RETRYABLE` errors on the :func:`retry_delay` schedule for at most
    ``bound`` seconds, then re-raise the last error. Returns a tenacity ``AsyncRetrying``
    (``asynchronous``) or ``Retrying``; use it as ``for attempt in retrying(...): with attempt:``
    (``async for`` for the asynchronous one)."""
    from tenacity import AsyncRetrying, Retrying, retry_if_exception_type, stop_after_delay

    kw: dict[str, Any] = dict(
        retry=retry_if_exception_type(RETRYABLE),
        stop=stop_after_delay(bound),
        wait=lambda rs: retry_delay(rs.attempt_number),
        reraise=True,
    )
    return AsyncRetrying(**kw) if asynchronous else Retrying(**kw)
