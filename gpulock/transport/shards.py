"""gpulock's calls on a Redis Cluster client, one shard at a time: the sync driver of
:func:`gpulock.transport.route.route` over the client's own slot map and connections (the asyncio one:
:mod:`gpulock.transport.shards_async`), and what both share.

redis-py's cluster clients route a call by asking the cluster, and share their failure
handling across all shards: an ``FCALL``'s keys are learnt by sending ``COMMAND GETKEYS`` to
one "default" node on every call (so every pool's calls fail or hang while that one master is
dead or stopped), and a connection error anywhere makes the asyncio client re-read the whole
cluster before its next call to any shard. gpulock's calls touch one slot each (a pool's keys
share its hash tag), so :class:`SyncShards` and :class:`AsyncShards` send each straight to the
node the client's slot map names for the slot, on that node's own connections (the client's
``max_connections`` per node still bounds them), through a :mod:`gpulock.transport.lane`; a call's
trouble is handled for its slot alone (:mod:`gpulock.transport.route`): a refresh asks another node
who serves that slot, corrects the client's map for the slots gpulock uses, and never blocks
a call to another shard.

One per cluster client (:func:`shards_of`), shared by every pool object on it.

:func:`on_key` (asyncio: :func:`gpulock.transport.shards_async.aon_key`) is the one way gpulock sends a
command that is not a script to a pool's keys (pool delete, samples, the FastAPI layer's
idempotency store, calibration, back-off): on a cluster through the pool's shard alone, like
the scripts; on any other client on its lane.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis.exceptions import RedisError

from gpulock_common.driver import drive

from gpulock.transport.cluster import is_cluster_client
from gpulock.transport.lane import SyncLane, encode, sync_lane
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

from gpulock.transport.shards_async import AsyncShards, async_shards_of
from gpulock.transport.slot_map import (
    ASKING,
    CLUSTER_SLOTS,
    DRIVER_ATTR,
    SlotMap,
    batch_replies,
    batch_words,
    checked,
    moved_error,
    slot_of,
)

__all__ = [
    "ASKING",
    "SyncShards",
    "batch_replies",
    "batch_words",
    "checked",
    "on_key",
    "shards_of",
    "slot_of",
]


def shards_of(client: Any) -> SyncShards | AsyncShards | None:
    """The shard driver of a cluster client (made on first use, kept on the client); None for
    any other client."""
    if not is_cluster_client(client):
        return None
    if not isinstance(client, redis.cluster.RedisCluster):
        return async_shards_of(client)
    s = client.__dict__.get(DRIVER_ATTR)
    if s is None:
        s = client.__dict__[DRIVER_ATTR] = SyncShards(client)
    return s


def on_key(client: Any, key: str, *commands: Sequence[Any]) -> list[Any]:
    """Send ``commands`` (each a sequence of words; every key they name in ``key``'s slot) in
    order on one connection to the server of ``key``: on a cluster client, the master that
    serves its slot, routed by :meth:`SyncShards.call` (a dead or hung master stalls only its
    own slots' calls); on any other sync client, its lane. One try (a cluster's redirects and
    failover followed as :mod:`gpulock.transport.route` says); no retry.

    Returns: the raw replies (bytes or str as the client decodes; an error reply as its
    ``ResponseError``, in its place: :func:`checked` raises it).
    Raises: a connection error or timeout; on a cluster
    :class:`~gpulock.transport.route.ShardUnavailable`."""
    shards = shards_of(client)
    if shards is not None:
        assert isinstance(shards, SyncShards), "an asyncio client: use aon_key"
        return shards.execute(slot_of(key), commands)
    lane = sync_lane(client)
    assert lane is not None  # a client of one server has a connection pool
    return lane.execute_many([encode(c) for c in commands])


class SyncShards(SlotMap):
    """The driver for a sync ``redis.cluster.RedisCluster`` (thread-safe)."""

    def __init__(self, client: Any):
        super().__init__(client)
        self._refresh_lock = threading.Lock()
        self._inflight: dict[int, tuple[int, str, float]] = {}  # call -> (slot, node, since)
        self._ids = itertools.count()
        self._watcher: threading.Thread | None = None
        self._watcher_lock = threading.Lock()
        self._checking: set[str] = set()
        #: The hand-off subscriptions' connection pools, by node: closed when it hung and
        #: was replaced (:meth:`_check`), so that their readers subscribe again elsewhere.
        self.subscriptions: dict[str, weakref.WeakSet[Any]] = {}
        _SYNC_SHARDS.add(self)

    @contextmanager
    def watch(self, slot: int, node: str) -> Iterator[None]:
        """Around one call on ``slot`` sent to ``node``: while it waits longer than
        :data:`~gpulock.transport.route.HUNG_CHECK_S` for its reply, a thread of this object asks
        other nodes who serves the slot (every as many seconds); once the answer names
        another master (``node`` hung and was replaced), ``node``'s connections are closed,
        so that every call blocked on them fails at once and is routed to the new master,
        instead of waiting for the socket timeout."""
        k = next(self._ids)
        self._inflight[k] = (slot, node, time.monotonic())
        if self._watcher is None:
            self._start_watcher()
        try:
            yield
        finally:
            self._inflight.pop(k, None)

    def _start_watcher(self) -> None:
        with self._watcher_lock:
            if self._watcher is None:
                t = threading.Thread(
                    target=_watch_loop,
                    args=(weakref.ref(self),),
                    name="gpulock-cluster-watch",
                    daemon=True,
                )
                self._watcher = t
                t.start()

    def _check(self, slot: int, node: str) -> None:
        """``node`` has kept a call waiting: if another master serves ``slot`` now, close
        the connections to ``node`` (see :meth:`watch`)."""
        if node in self._checking:
            return
        self._checking.add(node)
        self.suspects.add(node)
        try:
            owner = self.refresh(slot, node)
            if owner is None or owner == node:
                return
            n = self.nm.get_node(node_name=node)
            if n is not None and n.redis_connection is not None:
                n.redis_connection.connection_pool.disconnect()
            for pool in list(self.subscriptions.get(node, ())):
                pool.disconnect()
        except Exception:  # noqa: BLE001 - best effort: the call's socket timeout remains
            pass
        finally:
            self._checking.discard(node)

    def node_client(self, name: str) -> redis.Redis:
        """The client of node ``name`` (redis-py's own, with its connection pool). Raises
        redis.ConnectionError when the map does not know the node, even after re-reading the
        cluster."""
        node = self.nm.get_node(node_name=name)
        if node is None:
            self.nm.initialize()  # a node the map never saw (an ASK to a new node): rare
            node = self.nm.get_node(node_name=name)
            if node is None:
                raise redis.ConnectionError(f"node {name} is not in the cluster's map")
        r: redis.Redis = self.client.get_redis_connection(node)
        return r

    def lane(self, name: str) -> SyncLane:
        """The lane of node ``name`` (:meth:`node_client`'s pool); raises as it does."""
        lane = sync_lane(self.node_client(name))
        assert lane is not None  # a node's client has a connection pool
        return lane

    def call(
        self,
        slot: int,
        send: Callable[[SyncLane, bool], Any],
    ) -> Any:
        """``send(lane, asking)``'s reply, sent to the master of ``slot`` and routed by
        :func:`gpulock.transport.route.route`. Raises what the route raises."""
        self.tracked.add(slot)

        def do_step(step: RouteStep) -> Any:
            if step is LOOKUP:
                return self.node_name(slot)
            if isinstance(step, Send):
                with self.watch(slot, step.node):
                    reply = send(self.lane(step.node), step.asking)
                self.suspects.discard(step.node)
                return reply
            if isinstance(step, Moved):
                self._move(slot, step.host, step.port)
                return None
            assert isinstance(step, Refresh)
            return self.refresh(slot, step.failed)

        # the route decides on an Exception; an interrupt (KeyboardInterrupt) propagates
        return drive(route(slot), do_step, catch=Exception)

    def execute(self, slot: int, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """``commands`` on one connection to the master of ``slot``, routed by :meth:`call`
        (:func:`on_key`): their replies, an error reply as its ``ResponseError``."""
        return self.call(  # type: ignore[no-any-return]
            slot,
            lambda lane, asking: batch_replies(
                lane.execute_many(batch_words(commands, asking)), asking
            ),
        )

    def _move(self, slot: int, host: str, port: int) -> None:
        if self.node_name(slot) == f"{host}:{port}":
            return
        self.nm.slots_cache.setdefault(slot, [])
        self.nm.move_slot(moved_error(slot, host, port))

    def refresh(self, slot: int, failed: str | None) -> str | None:
        """Ask the nodes other than ``failed`` (:func:`gpulock.transport.route.refresh_order`), one at
        a time until one answers, which master serves each tracked slot; correct the map;
        return the master of ``slot`` now (None: no node answered). One refresh at a time;
        a caller that waited for another's uses its answer."""
        self.tracked.add(slot)
        asked = time.monotonic()
        with self._refresh_lock:
            if self.refreshed_at > asked:
                return self.node_name(slot)
            try:
                for name in self.candidates(slot, failed):
                    try:
                        reply = self.lane(name).execute(CLUSTER_SLOTS)
                    except (RedisError, OSError):
                        continue
                    for s, host, port in self.changes(reply, name):
                        self._move(s, host, port)
                    return self.node_name(slot) if owner_in(reply, slot) else None
                return None
            finally:
                self.refreshed_at = time.monotonic()


_SYNC_SHARDS: weakref.WeakSet[SyncShards] = weakref.WeakSet()


def _forget_watchers_in_child() -> None:
    """In a forked child the watch threads are gone: each client starts its own on its next
    call there."""
    for s in list(_SYNC_SHARDS):
        s._watcher = None
        s._inflight.clear()


os.register_at_fork(after_in_child=_forget_watchers_in_child)


def _watch_loop(ref: weakref.ref[SyncShards]) -> None:
    """The watch thread of a :class:`SyncShards` (:meth:`SyncShards.watch`): ends with it."""
    while True:
        time.sleep(HUNG_CHECK_S)
        shards = ref()
        if shards is None:
            return
        now = time.monotonic()
        late: dict[str, int] = {}
        for slot, node, since in list(shards._inflight.values()):
            if now - since >= HUNG_CHECK_S:
                late.setdefault(node, slot)
        for node, slot in late.items():
            shards._check(slot, node)
        del shards
