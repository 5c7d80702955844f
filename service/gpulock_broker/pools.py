"""The broker's pool objects: its Redis connection, one :class:`gpulock.AsyncPool` per pool
name with its remote holders (:class:`gpulock.runtime.remote.RemoteHolders`: made on first use,
closed when the pool turns out not to exist or is deleted), and the pool-wide operations
(list, configure, status, delete)."""

from __future__ import annotations

import asyncio
import time
import weakref
from types import MappingProxyType
from typing import Any, Callable, Mapping

import redis.asyncio as aioredis

from gpulock_common.options import PoolSettings

from gpulock import AsyncPool
from gpulock.admin.pools import DeleteResult, adelete_pool
from gpulock.transport.connect import async_client
from gpulock.admin.listing import Listing, alist_pools
from gpulock.protocol.args import validate_pool_name
from gpulock.transport.retry import retrying
from gpulock.runtime.remote import RemoteHolders
from gpulock.transport.translate import translate
from gpulock.errors import BackendUnavailable, PoolNotFound

from .outcomes import PoolBeingDeleted
from .tasks import Tasks

__all__ = ["Holders", "Pools"]

#: One pool object of the broker, used on its remote holders' behalf (its ``pool``: the
#: :class:`gpulock.AsyncPool`).
Holders = RemoteHolders[AsyncPool]


class Pools:
    """One :class:`gpulock.AsyncPool` per pool name, on one bounded Redis connection pool, used
    on the remote holders' behalf through its :class:`~gpulock.runtime.remote.RemoteHolders`.

    Args:
        redis_url: the Redis holding the pools: any URL of :mod:`gpulock.transport.connect`.
        tasks: where Redis calls run, bounded by ``tasks.backend_timeout``.
        waiter_ttl, poll_interval, backend_timeout: passed to each :class:`gpulock.AsyncPool`
            (seconds).
        max_connections: the bound on the Redis connections (one per pool name goes to its
            pub/sub subscription).
        in_use: whether the broker keeps something for a pool name (a parked place or a lease
            record); such a pool object is not dropped when the pool turns out not to exist.
        on_retire: called with a pool name when its pool object is closed by a delete: drop
            what is kept for the pool's queued requests.
        on_deleted: called with a pool name when the pool was deleted in Redis: forget its
            lease records (they answer 410 "lost").
    """

    def __init__(
        self,
        redis_url: str,
        tasks: Tasks,
        *,
        waiter_ttl: float,
        poll_interval: float,
        backend_timeout: float,
        max_connections: int,
        in_use: Callable[[str], bool],
        on_retire: Callable[[str], None],
        on_deleted: Callable[[str], None],
    ):
        self.redis_url = redis_url
        self.waiter_ttl = waiter_ttl
        self.poll_interval = poll_interval
        self.backend_timeout = backend_timeout
        self.max_connections = max_connections
        self._tasks = tasks
        self._in_use, self._on_retire, self._on_deleted = in_use, on_retire, on_deleted
        self._redis: aioredis.Redis | None = None
        self._pools: dict[str, Holders] = {}
        self._deleting: dict[str, int] = {}  # pools being deleted by force (count of deletes)
        self._retired: weakref.WeakSet[Holders] = weakref.WeakSet()  # closed by a delete
        # recent_status: the last status read of each pool (monotonic time it began, status)
        # and the read in flight
        self._recent: dict[str, tuple[float, Any]] = {}
        self._reading: dict[str, asyncio.Future[Any]] = {}

    @property
    def objects(self) -> Mapping[str, Holders]:
        """The open pool objects' remote holders by pool name (read-only view)."""
        return MappingProxyType(self._pools)

    @property
    def deleting(self) -> Mapping[str, int]:
        """The pool names a forced delete is under way for, with the number of such deletes
        (read-only view)."""
        return MappingProxyType(self._deleting)

    # ---- connection --------------------------------------------------------------------------
    def connect(self) -> None:
        """Make the Redis client (idempotent); it connects on first use."""
        if self._redis is None:
            # A bounded pool: requests beyond it wait for a connection (waiting for a grant
            # holds none). Each pool name's pub/sub subscription takes one of them for good.
            # gpulock.transport.connect: the library's one URL parser and connector (redis://,
            # rediss://, unix://, redis+sentinel://).
            self._redis = async_client(
                self.redis_url,
                max_connections=self.max_connections,
                socket_timeout=min(2.0, self.backend_timeout),
                socket_connect_timeout=min(1.0, self.backend_timeout),
                health_check_interval=10,
            )

    def client(self) -> aioredis.Redis:
        """The Redis client. Raises: BackendUnavailable before :meth:`connect`."""
        if self._redis is None:
            raise BackendUnavailable("the lease broker is not started")
        return self._redis

    async def close_pools(self) -> None:
        """Close every pool object (their waits end with PoolClosed)."""
        for p in list(self._pools.values()):
            await p.pool.aclose()
        self._pools.clear()

    async def disconnect(self) -> None:
        """Close the Redis client (idempotent)."""
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    # ---- pool objects ------------------------------------------------------------------------
    def get(self, name: str) -> Holders:
        """The remote holders of the pool object for ``name`` (its :attr:`~RemoteHolders.pool`),
        made on first use.

        Raises: PoolBeingDeleted, InvalidArgument (a bad name), BackendUnavailable (not
        connected)."""
        if name in self._deleting:
            raise PoolBeingDeleted(f"pool {name!r} is being deleted; retry")
        p = self._pools.get(name)
        if p is None:
            p = RemoteHolders(
                AsyncPool(
                    self.client(),
                    validate_pool_name(name),
                    waiter_ttl=self.waiter_ttl,
                    poll_interval=self.poll_interval,
                    backend_timeout=self.backend_timeout,
                )
            )
            self._pools[name] = p
        return p

    def was_retired(self, p: Holders) -> bool:
        """Whether ``p`` was closed by a delete of its pool (not by the broker's shutdown)."""
        return p in self._retired

    async def drop_if_idle(self, name: str) -> None:
        """Forget a pool object that turned out not to exist, so requests for made-up pool
        names do not pile up subscriptions."""
        p = self._pools.get(name)
        if p is None or p.waiting or self._in_use(name):
            return
        del self._pools[name]
        await p.pool.aclose()

    async def retire(self, name: str) -> None:
        """Close this broker's pool object for ``name``: its waiters' waits end (PoolClosed,
        answered 404 in acquire), its parked places and their keepers are dropped. A closed
        runtime neither refreshes nor re-creates anything, so a request that raced this with
        the old object only finds the pool gone."""
        self._on_retire(name)
        p = self._pools.pop(name, None)
        if p is not None:
            self._retired.add(p)
            await p.pool.aclose()

    # ---- pool-wide operations ----------------------------------------------------------------
    async def listing(self) -> Listing:
        """Every pool configured in Redis (sorted), and the shards of a Redis Cluster that
        could not be read (gpulock.admin.listing: each master asked at once, for at most
        LIST_TIMEOUT_S; their pools are left out)."""
        redis = self.client()

        async def scan() -> Listing:
            # A read: retried on the core's policy (a connection that Redis dropped, as after
            # a restart, was a 500 on the first call), then the core's errors (503). On a
            # cluster only a cluster none of whose nodes answers is retried.
            try:
                async for attempt in retrying(self.backend_timeout, asynchronous=True):
                    with attempt:
                        listing = await alist_pools(redis)
            except Exception as e:  # noqa: BLE001 - translated to gpulock's tree
                raise translate(e, "*") from e
            return listing

        return await self._tasks.guard(scan())

    async def names(self) -> list[str]:
        """Every pool configured in Redis that could be read, sorted (see :meth:`listing`)."""
        return (await self.listing()).names

    async def status(self, pool: str, limit: int = 1000):
        """The pool's status (:meth:`gpulock.AsyncPool.status`), at most ``limit`` leases."""
        return await self._tasks.guard(self.get(pool).pool.status(limit=limit))

    async def recent_status(self, pool: str, limit: int, max_age: float):
        """The pool's status read at most ``max_age`` seconds ago (at most ``limit`` leases):
        one read serves every caller meanwhile, and callers that come while it runs share it,
        so a storm of refusals that each want the pool's state costs Redis one read per
        ``max_age``. Raises what :meth:`status` raises (a failed read is not kept)."""
        now = time.monotonic()
        kept = self._recent.get(pool)
        if kept is not None and now - kept[0] <= max_age:
            return kept[1]
        reading = self._reading.get(pool)
        if reading is None:
            reading = asyncio.ensure_future(self.status(pool, limit=limit))
            self._reading[pool] = reading
            reading.add_done_callback(lambda f: self._read_done(pool, f, now))
        return await asyncio.shield(reading)

    def _read_done(self, pool: str, f: asyncio.Future, started: float) -> None:
        if self._reading.get(pool) is f:
            del self._reading[pool]
        if not f.cancelled() and f.exception() is None:
            self._recent[pool] = (started, f.result())

    async def configure(self, pool: str, settings: PoolSettings) -> dict[str, Any]:
        """Create or change a pool: ``settings`` in bytes and seconds, each None to keep the
        pool's current value (the library's default for a new pool; ``max_waiters`` and
        ``max_ttl`` are read from the pool's status first, so this broker's pool object does
        not put its own in); ``quotas`` (tenant to bytes, 0 removes) changes the tenants
        named; ``devices`` is each device's capacity in bytes (``capacity``, None for their
        sum, must be their sum). Returns the configure reply (with ``policy``,
        ``backfill_window`` seconds, ``quotas``, ``devices`` and ``placement``) with
        ``max_ttl`` (seconds) added. Raises InvalidArgument for a bad policy, window, quota
        or device, or a change of the count of devices while the pool has leases or waiters."""
        p = self.get(pool).pool
        if settings.max_waiters is None or settings.max_ttl is None:
            try:
                st = await self._tasks.guard(p.status(limit=0))
                if settings.max_waiters is None:
                    settings = settings._replace(max_waiters=st.max_waiters)
                if settings.max_ttl is None and st.max_ttl:
                    settings = settings._replace(max_ttl=st.max_ttl)
            except PoolNotFound:
                pass
        r: dict[str, Any] = await self._tasks.guard(p.configure(**settings._asdict()))
        return {**r, "max_ttl": p.max_ttl}

    async def delete(self, pool: str, *, force: bool = False) -> DeleteResult:
        """Delete a pool in Redis (gpulock.admin.pools's script: refused while leases or waiters are
        live unless ``force``), then forget what this broker kept for it.

        With ``force``, this broker's own waiters on the pool are withdrawn first (their long
        polls answer 404, as for any pool that is gone): otherwise the pool's runtime, which
        keeps them queued, would see the pool gone and make it again. Requests for the pool
        that arrive meanwhile are answered 503 (:class:`PoolBeingDeleted`; a retry then sees
        the pool gone). Leases granted through the broker answer 410 at their next renewal.

        Raises: InvalidArgument, BackendUnavailable."""
        validate_pool_name(pool)
        redis = self.client()
        if force:
            self._deleting[pool] = self._deleting.get(pool, 0) + 1
        try:
            if force:
                await self.retire(pool)
            r: DeleteResult = await self._tasks.guard(adelete_pool(redis, pool, force=force))
        finally:
            if force:
                self._deleting[pool] -= 1
                if not self._deleting[pool]:
                    del self._deleting[pool]
        if r.state == "deleted":
            self._on_deleted(pool)
            await self.retire(pool)  # with force: a request that raced the delete
        return r
