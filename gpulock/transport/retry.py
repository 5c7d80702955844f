"""Which Redis errors gpulock retries (:data:`RETRYABLE`) and the tenacity loop that applies
the retry policy (:func:`retrying`): how long and on which schedule are the protocol's
(:mod:`gpulock.protocol.retry`), what is worth retrying is redis-py's vocabulary, so it lives
here, in the transport."""

from __future__ import annotations

from typing import Any

import redis.exceptions as rex

from gpulock.protocol.retry import retry_delay

__all__ = ["RETRYABLE", "retrying"]

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
