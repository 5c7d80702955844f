"""The asyncio twin of :class:`gpulock.transport.shards.SyncShards`: gpulock's calls on a
``redis.asyncio.cluster.RedisCluster``, one shard at a time (see :mod:`gpulock.transport.shards`),
and :func:`aon_key`, the twin of :func:`gpulock.transport.shards.on_key`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.asyncio.retry import Retry

from gpulock_common.driver import adrive

from gpulock.transport.cluster import is_cluster_client
from gpulock.transport.cluster import ready as cluster_ready
from gpulock.transport.lane import AsyncLane, async_lane, encode
from gpulock.transport.route import (
    HUNG_CHECK_S,
    LOOKUP,
    Moved,
    Refresh,
    RouteStep,
    Send,
    owner_in,
    route,
)
from gpulock.transport.slot_map import (
    CLUSTER_SLOTS,
    DRIVER_ATTR,
    SlotMap,
    batch_replies,
    batch_words,
    moved_error,
    slot_of,
)

__all__ = ["AsyncShards", "aon_key", "async_shards_of"]


def async_shards_of(client: Any) -> AsyncShards:
    """The shard driver of an asyncio cluster client (made on first use, kept on the client)."""
    s = client.__dict__.get(DRIVER_ATTR)
    if s is None:
        s = client.__dict__[DRIVER_ATTR] = AsyncShards(client)
    return s  # type: ignore[no-any-return]


async def aon_key(client: Any, key: str, *commands: Sequence[Any]) -> list[Any]:
    """:func:`gpulock.transport.shards.on_key` on an asyncio client (a cluster's: routed by
    :meth:`AsyncShards.call`)."""
    if is_cluster_client(client):
        assert not isinstance(client, redis.cluster.RedisCluster), "a sync client: use on_key"
        return await async_shards_of(client).execute(slot_of(key), commands)
    lane = async_lane(client)
    assert lane is not None  # a client of one server has a connection pool
    return await lane.execute_many([encode(c) for c in commands])


class _NodeConnections:
    """An asyncio cluster node's own connections as the connection pool an
    :class:`~gpulock.transport.lane.AsyncLane` takes them from (a node at its ``max_connections``
    raises redis-py's MaxConnectionsError, as redis-py's own calls do)."""

    def __init__(self, node: Any):
        self.node = node
        self.max_connections = node.max_connections

    async def get_connection(self) -> Any:
        return self.node.acquire_connection()

    async def release(self, conn: Any) -> None:
        self.node.release(conn)


class AsyncShards(SlotMap):
    """The driver for a ``redis.asyncio.cluster.RedisCluster`` (one event loop)."""

    def __init__(self, client: Any):
        super().__init__(client)
        self._refresh_lock: asyncio.Lock | None = None
        self._lanes: dict[str, tuple[Any, AsyncLane]] = {}
        self._pubsub: dict[str, aioredis.Redis] = {}
        self._checking: dict[str, asyncio.Task[None]] = {}  # node -> its hung check

    def watch(self, slot: int, node: str | None) -> _Watch:
        """A context for one call on ``slot`` sent to ``node``: while the call waits longer
        than :data:`HUNG_CHECK_S` for its reply, other nodes are asked who serves the slot
        (every :data:`HUNG_CHECK_S`); once the answer names another master (``node`` hung
        and was replaced), ``node``'s connections are closed, so that every call waiting on
        them fails at once and is routed to the new master, instead of waiting for the socket
        timeout."""
        return _Watch(self, slot, node)

    def _suspect(self, slot: int, node: str) -> None:
        if node not in self._checking:
            t = asyncio.get_running_loop().create_task(self._check(slot, node))
            self._checking[node] = t

    async def _check(self, slot: int, node: str) -> None:
        self.suspects.add(node)
        try:
            owner = await self.refresh(slot, node)
            if owner is None or owner == node:
                return
            n = self.nm.get_node(node_name=node)
            held = self._lanes.get(node)
            if held is not None:
                await held[1].drop_idle()
            if n is not None:
                await n.disconnect()
            ps = self._pubsub.get(node)
            if ps is not None:
                await ps.connection_pool.disconnect()
        except Exception:  # noqa: BLE001 - best effort: the call's socket timeout remains
            pass
        finally:
            self._checking.pop(node, None)

    async def ready(self) -> None:
        """Read the slot map unless the client has one (:func:`gpulock.transport.cluster.ready`)."""
        if not self.nm.slots_cache:
            await cluster_ready(self.client)

    async def node(self, name: str) -> Any:
        """redis-py's node object of ``name``. Raises redis.ConnectionError when the map does
        not know it, even after re-reading the cluster."""
        node = self.nm.get_node(node_name=name)
        if node is None:
            await self.nm.initialize()  # a node the map never saw (an ASK to a new node): rare
            node = self.nm.get_node(node_name=name)
            if node is None:
                raise redis.ConnectionError(f"node {name} is not in the cluster's map")
        return node

    async def lane(self, name: str) -> AsyncLane:
        """The lane over node ``name``'s own connections (one per node object)."""
        node = await self.node(name)
        held = self._lanes.get(name)
        if held is None or held[0] is not node:
            held = self._lanes[name] = (node, AsyncLane(_NodeConnections(node)))
        return held[1]

    def pubsub_client(self, name: str) -> aioredis.Redis:
        """A ``redis.asyncio.Redis`` of node ``name`` alone, for its pub/sub connection (made
        once per node, with the node's connection settings)."""
        r = self._pubsub.get(name)
        if r is None:
            node = self.nm.get_node(node_name=name)
            if node is None:
                raise redis.ConnectionError(f"node {name} is not in the cluster's map")
            kw = {k: v for k, v in node.connection_kwargs.items() if k not in ("host", "port")}
            # no retry: a connection closed under the reader must fail it, so that the
            # hub subscribes again where the slot is served (redis-py would reconnect here)
            kw["retry"] = Retry(NoBackoff(), 0)
            r = self._pubsub[name] = aioredis.Redis(
                connection_pool=aioredis.ConnectionPool(
                    connection_class=node.connection_class,
                    host=node.host,
                    port=node.port,
                    max_connections=2,
                    **kw,
                )
            )
        return r

    async def call(
        self,
        slot: int,
        send: Callable[[AsyncLane, bool], Awaitable[Any]],
        first: tuple[str | None, BaseException] | None = None,
    ) -> Any:
        """As :meth:`SyncShards.call`, in the running event loop. ``first``: the node a
        first try made elsewhere went to (None: none known) and the error it raised; the
        route goes on from there."""
        self.tracked.add(slot)
        await self.ready()

        async def do_step(step: RouteStep) -> Any:
            nonlocal first
            if step is LOOKUP:
                return self.node_name(slot) if first is None else first[0]
            if isinstance(step, Send):
                if first is not None:  # that try was made: its error is this Send's
                    error, first = first[1], None
                    raise error
                with self.watch(slot, step.node):
                    reply = await send(await self.lane(step.node), step.asking)
                self.suspects.discard(step.node)
                return reply
            if isinstance(step, Moved):
                await self._move(slot, step.host, step.port)
                return None
            assert isinstance(step, Refresh)
            return await self.refresh(slot, step.failed)

        # the route decides on an Exception; a cancellation propagates
        return await adrive(route(slot), do_step, catch=Exception)

    async def execute(self, slot: int, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """As :meth:`SyncShards.execute <gpulock.transport.shards.SyncShards.execute>`."""

        async def send(lane: AsyncLane, asking: bool) -> list[Any]:
            return batch_replies(await lane.execute_many(batch_words(commands, asking)), asking)

        return await self.call(slot, send)  # type: ignore[no-any-return]

    async def _move(self, slot: int, host: str, port: int) -> None:
        if self.node_name(slot) == f"{host}:{port}":
            return
        self.nm.slots_cache.setdefault(slot, [])
        await self.nm.move_slot(moved_error(slot, host, port))

    async def refresh(self, slot: int, failed: str | None) -> str | None:
        """As :meth:`SyncShards.refresh`."""
        self.tracked.add(slot)
        await self.ready()
        asked = time.monotonic()
        if self._refresh_lock is None:
            self._refresh_lock = asyncio.Lock()
        async with self._refresh_lock:
            if self.refreshed_at > asked:
                return self.node_name(slot)
            try:
                for name in self.candidates(slot, failed):
                    try:
                        reply = await (await self.lane(name)).execute(CLUSTER_SLOTS)
                    except (RedisError, OSError):
                        continue
                    for s, host, port in self.changes(reply, name):
                        await self._move(s, host, port)
                    return self.node_name(slot) if owner_in(reply, slot) else None
                return None
            finally:
                self.refreshed_at = time.monotonic()


class _Watch:
    """:meth:`AsyncShards.watch`: a timer, re-armed while the call waits."""

    __slots__ = ("shards", "slot", "node", "handle")

    def __init__(self, shards: AsyncShards, slot: int, node: str | None):
        self.shards, self.slot, self.node = shards, slot, node
        self.handle: asyncio.TimerHandle | None = None

    def __enter__(self) -> _Watch:
        if self.node is not None:
            self.handle = asyncio.get_running_loop().call_later(HUNG_CHECK_S, self._fire)
        return self

    def _fire(self) -> None:
        assert self.node is not None
        self.shards._suspect(self.slot, self.node)
        self.handle = asyncio.get_running_loop().call_later(HUNG_CHECK_S, self._fire)

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.cancel()
