"""The retry policy of gpulock's idempotent Redis calls, without I/O: for how long
(:func:`retry_bound`) and on which schedule (:func:`retry_delay`). Which errors are retried and
the loop that applies the policy know redis-py's errors, so they live in the transport
(:mod:`gpulock.transport.retry`: ``RETRYABLE``, ``retrying``).
"""

from __future__ import annotations

import random


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


# The retry schedule (seconds): full jitter over 0.05 s doubling per attempt, capped at 0.5 s.
RETRY_BASE_S, RETRY_CAP_S = 0.05, 0.5


def retry_delay(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (1: the first retry) of a Redis call
    that failed with a retryable error (``gpulock.transport.retry.RETRYABLE``): uniform in [0, min(0.5 s, 0.05 s × 2^(attempt-1))].
    The one schedule of every retry gpulock makes, foreground calls and background loops alike."""
    return random.uniform(0.0, min(RETRY_CAP_S, RETRY_BASE_S * 2.0 ** min(max(attempt, 1) - 1, 30)))
