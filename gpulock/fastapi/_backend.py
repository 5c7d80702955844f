"""This worker's connection to its pool: the clients made by ``start()`` and the pool's status
as last read from Redis, which the limiter's parts share."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from gpulock_common.grace import grace_note

from gpulock._async import AsyncPool
from gpulock.admin.samples import count_event
from gpulock.errors import GpuLockError
from gpulock.protocol.keys import pool_key, pool_keys
from gpulock.transport.shards import checked
from gpulock.transport.shards_async import aon_key
from gpulock.protocol.replies import PoolStatus

if TYPE_CHECKING:
    from ._settings import Settings

log = logging.getLogger("gpulock.fastapi")


def process_owner() -> str:
    """``host:pid`` of this process: the owner written into request claims."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Backend:
    """The pool, its Redis client and the executor of one worker (None until ``start()``),
    and the last status read.

    Attributes:
        pool_name: the pool.
        pool, redis, executor: made by :meth:`connect` (``GpuLimiter.start()``), in the worker
            process.
        owner: ``host:pid`` of the worker (set again after fork, by :meth:`connect`).
        status: the pool's status as last read (None before one, or after the pool was not
            found); ``status_at`` when it was read (``time.monotonic()``).
        redis_error: why the last read failed, None when it succeeded.
    """

    def __init__(self, pool_name: str):
        self.pool_name = pool_name
        self.pool: AsyncPool | None = None
        self.redis: aioredis.Redis | None = None
        self.executor: ThreadPoolExecutor | None = None
        self.owner = process_owner()
        self.status: PoolStatus | None = None
        self.status_at = 0.0
        self.redis_error: str | None = "not connected yet"

    def connect(self, settings: Settings) -> None:
        """Make this process's clients (call it after fork): the Redis client, the pool object
        (its ``capacity``, ``default_ttl``, ``max_waiters`` and ``keep`` from ``settings``) and the
        executor of ``settings.executor_threads`` threads. No I/O yet."""
        from gpulock.transport.connect import async_client

        s = settings
        self.owner = process_owner()
        self.redis = async_client(
            s.redis_url,
            socket_timeout=5.0,
            socket_connect_timeout=2.0,
            health_check_interval=10,
            client_name=f"gpulock-service-{os.getpid()}",
        )
        kw: dict[str, Any] = {"capacity": s.capacity, "default_ttl": s.ttl}
        if s.max_waiters is not None:
            kw["max_waiters"] = s.max_waiters
        if s.keep:
            kw["keep"] = s.keep
        self.pool = AsyncPool(self.redis, s.pool_name, **kw)
        self.executor = ThreadPoolExecutor(s.executor_threads, thread_name_prefix="gpulock-work")

    async def configure(self, settings: Settings) -> None:
        """Create the pool with ``settings.capacity`` when it does not exist (``configure_mode``
        "create"), or set its capacity ("set"); nothing without a capacity. A failure (Redis
        down) is logged, not raised: the reaper keeps reading and readiness says so."""
        if settings.capacity is None or self.pool is None:
            return
        try:
            await self.pool.configure(
                settings.capacity, create_only=settings.configure_mode == "create"
            )
        except GpuLockError as e:
            log.warning("gpulock: could not configure pool %s yet: %s", self.pool_name, e)

    async def close(self) -> None:
        """Close the pool object and the Redis client, and stop the executor (running work
        finishes in its threads; queued work is cancelled)."""
        if self.pool is not None:
            await self.pool.aclose()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.aclose()
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)

    def count_event(self, event: str, spawn: Callable[..., Any]) -> None:
        """Add one to the pool's ``event`` counter in Redis, in the background (``spawn``: a
        task the limiter's ``stop()`` cancels); a failure, or no connection yet, only loses
        the count."""
        redis = self.redis
        if redis is None:
            return

        async def count() -> None:
            try:
                await count_event(redis, self.pool_name, event)
            except Exception as e:  # noqa: BLE001 - a count is not worth an error answer
                log.debug("gpulock: counting %s failed: %s", event, e)

        spawn(count(), name="gpulock-count-event")

    def key(self, suffix: str) -> str:
        """The pool's Redis key ``gpulock:{pool}:<suffix>`` (see ``gpulock.protocol.keys``)."""
        return pool_key(self.pool_name, suffix)

    async def commands(self, *commands: tuple[Any, ...]) -> list[Any]:
        """``commands`` (each a tuple of words, every key the pool's) in order on one
        connection to the pool's server: on a Redis Cluster its shard alone
        (:func:`gpulock.transport.shards_async.aon_key`), so that another shard's trouble never touches
        them. Returns the raw replies (bytes; ints; None for a nil).

        Raises: the first error reply; a connection error or timeout (a cluster's
        ``ShardUnavailable``)."""
        assert self.redis is not None, "GpuLimiter.start() was not called"
        return checked(await aon_key(self.redis, self.key("cfg"), *commands))

    async def command(self, *words: Any) -> Any:
        """The reply of one command of :meth:`commands`."""
        return (await self.commands(words))[0]

    @property
    def queue_key(self) -> str:
        """The key of the pool's FIFO queue (a sorted set of tickets)."""
        return pool_keys(self.pool_name).queue

    def record(self, st: PoolStatus, now: float | None = None) -> None:
        """Keep ``st``, read at ``now`` (monotonic seconds, default now)."""
        self.status, self.status_at = st, time.monotonic() if now is None else now

    def queued(self) -> int:
        """Requests in the pool's queue at the last read (0 when unknown)."""
        return self.status.waiter_count if self.status is not None else 0

    def grace_left(self) -> float:
        """Seconds left in the pool's grace period after Redis lost it (nothing is granted
        before it ends): the later end of what the last status read showed and what the pool
        object last saw (its acquires, its recovery); 0 outside one."""
        st = self.status
        left = 0.0
        if st is not None and st.grace_left > 0:
            left = max(0.0, st.grace_left - (time.monotonic() - self.status_at))
        if self.pool is not None:
            left = max(left, self.pool.grace_left())
        return left

    def grace(self) -> dict[str, Any]:
        """The grace period as ``/ready`` and ``/health`` show it: ``{"active": bool,
        "left": seconds, "until": ISO 8601 UTC or None, "message": the reason a request
        waiting in it is given, or ""}``."""
        left = self.grace_left()
        if left <= 0:
            return {"active": False, "left": 0.0, "until": None, "message": ""}
        now = time.time()
        until = datetime.datetime.fromtimestamp(now + left, datetime.timezone.utc)
        return {
            "active": True,
            "left": round(left, 3),
            "until": until.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "message": grace_note(self.pool_name, left, now=now),
        }
