"""One hand-off subscription connection per shard, shared by every pool object on one client.

A process with many pool objects on one Redis client (the broker keeps one per pool) would
otherwise hold one pub/sub connection per pool. The :class:`Hub` of a client keeps one
connection per server that holds their channels — the one server of a standalone client,
each master a cluster client's pools live on — subscribes every pool object's channel on it,
and hands each message to its channel's ``deliver``.

Sharded or classic: the scripts publish with ``SPUBLISH`` where the server has sharded pub/sub
(Redis ≥ 7, Valkey ≥ 7.2) and ``PUBLISH`` on Redis 6.2 (``lua/lib.lua``); a shard's connection
follows the same rule, decided once per connection: it sends ``SSUBSCRIBE`` first and, on a
server that does not know it, ``SUBSCRIBE``.

A connection that fails (or whose server drops a sharded channel because its slot moved)
marks its channels unsubscribed (their waiters fall back to the
heartbeat's polling), waits :func:`gpulock._retry.retry_delay`, and subscribes them again — on
a cluster after re-reading the slot map, each on the master that serves its slot now.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, Callable

from redis.exceptions import ResponseError

from ._cluster import is_cluster_client, primary_client
from ._cluster import ready as cluster_ready
from ._failure_log import FailureLog
from ._retry import retry_delay

__all__ = ["Channel", "Hub"]

log = logging.getLogger("gpulock")


class Channel:
    """One pool object's channel on a hub: ``deliver(data)`` gets each message's payload;
    ``subscribed`` is set while the server confirms the subscription; ``news`` is set at each
    confirmation and each failure (``error``: the last one, None once subscribed)."""

    def __init__(self, name: str, deliver: Callable[[bytes], None]):
        self.name = name
        self.deliver = deliver
        self.subscribed = asyncio.Event()
        self.news = asyncio.Event()
        self.error: BaseException | None = None
        self.shard: _Shard | None = None
        self.left = False  # the pool object left the hub


class _SlotMoved(Exception):
    """A sharded channel was unsubscribed by the server (its slot migrated)."""


def _kind(msg: dict[str, Any]) -> str:
    k = msg["type"]
    return k.decode() if isinstance(k, bytes) else str(k)


def _name(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


class _Shard:
    """One subscription connection (to ``client``, a client of one server) and its channels."""

    def __init__(self, hub: Hub, key: str, client: Any):
        self.hub, self.key, self.client = hub, key, client
        self.channels: dict[str, Channel] = {}
        self.sharded: bool | None = None  # None until the server answered
        self.ps: Any = None  # the live PubSub, once its first subscription was sent
        self.task: asyncio.Task[None] | None = None
        self._log = FailureLog(
            f"pub/sub subscription{' on ' + key if key else ''}", level=logging.INFO
        )

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(
                self._run(), name=f"gpulock-pubsub{('-' + self.key) if self.key else ''}"
            )

    async def subscribe(self, names: list[str]) -> None:
        """Send the subscription of ``names`` on the live connection (the reader gets the
        confirmations); no-op while there is none (the reader subscribes everything when it
        connects)."""
        ps = self.ps
        if ps is None or not names:
            return
        if self.sharded is False:
            await ps.subscribe(*names)
        else:
            await ps.ssubscribe(*names)

    async def unsubscribe(self, name: str) -> None:
        ps = self.ps
        if ps is None:
            return
        try:
            if self.sharded is False:
                await ps.unsubscribe(name)
            else:
                await ps.sunsubscribe(name)
        except Exception:  # noqa: BLE001 - best effort: an unread channel costs nothing
            pass

    async def _run(self) -> None:
        attempt = 0
        while self.channels:
            ps = self.client.pubsub(ignore_subscribe_messages=False)
            try:
                self.ps = ps
                await self.subscribe(list(self.channels))
                while self.channels:
                    msg = await ps.get_message(timeout=1.0)
                    if msg is None:
                        continue
                    kind = _kind(msg)
                    ch = self.channels.get(_name(msg.get("channel")))
                    if kind in ("subscribe", "ssubscribe"):
                        self.sharded = kind == "ssubscribe"
                        attempt = 0
                        self._log.ok()
                        if ch is not None:
                            ch.error = None
                            ch.subscribed.set()
                            ch.news.set()
                    elif kind in ("message", "smessage") and ch is not None:
                        ch.deliver(msg["data"])
                    elif kind == "sunsubscribe" and ch is not None:
                        # the server dropped a channel we still want: its slot moved away
                        raise _SlotMoved(f"the slot of {ch.name} moved to another node")
            except asyncio.CancelledError:
                raise
            except Exception as e:  # connection trouble: the heartbeat's polling covers us
                self.ps = None
                if (
                    isinstance(e, ResponseError)
                    and self.sharded is not False
                    and "unknown command" in str(e).lower()
                ):
                    self.sharded = False  # Redis 6.2, no SSUBSCRIBE: its scripts PUBLISH
                    continue
                for ch in self.channels.values():
                    ch.subscribed.clear()
                    ch.error = e  # for ensure_subscribed: stop waiting, and why
                    ch.news.set()
                self._log.failed(e)
                attempt += 1
                await asyncio.sleep(retry_delay(attempt))
                await self.hub.regroup(self)
            finally:
                self.ps = None
                try:
                    await ps.aclose()
                except Exception:  # noqa: BLE001 - the connection is being dropped anyway
                    pass


class Hub:
    """The subscription connections of one asyncio client (standalone, Sentinel or cluster)
    in one event loop: :meth:`of` finds or makes it."""

    _hubs: weakref.WeakKeyDictionary[Any, Hub] = weakref.WeakKeyDictionary()

    def __init__(self, redis: Any):
        self.redis = redis
        self.loop = asyncio.get_running_loop()
        self.cluster = is_cluster_client(redis)
        self.shards: dict[str, _Shard] = {}

    @classmethod
    def of(cls, redis: Any) -> Hub:
        """The hub of ``redis`` in the running event loop."""
        hub = cls._hubs.get(redis)
        if hub is None or hub.loop is not asyncio.get_running_loop():
            hub = cls._hubs[redis] = cls(redis)
        return hub

    async def _shard_for(self, name: str) -> _Shard:
        if not self.cluster:
            key, client = "", self.redis
        else:
            await cluster_ready(self.redis)  # the slot map (a no-op once read)
            node = self.redis.get_node_from_key(name)
            key, client = node.name, primary_client(self.redis, name)
        shard = self.shards.get(key)
        if shard is None:
            shard = self.shards[key] = _Shard(self, key, client)
        return shard

    async def join(self, ch: Channel) -> None:
        """Subscribe ``ch`` on the connection of its shard (made and started when none). When
        the cluster cannot be read now, ``ch`` gets the error (its waiters poll) and a task
        tries again on the common retry schedule."""
        try:
            shard = await self._shard_for(ch.name)
        except Exception as e:  # noqa: BLE001 - the cluster is away: retry in the background
            ch.error = e
            ch.news.set()
            self.loop.create_task(self._join_later(ch), name="gpulock-pubsub-join")
            return
        self._attach(shard, ch)
        if shard.task is not None and not shard.task.done() and shard.ps is not None:
            try:
                await shard.subscribe([ch.name])
            except Exception as e:  # noqa: BLE001 - the reader sees the same failure and retries
                ch.error = e
                ch.news.set()

    async def _join_later(self, ch: Channel) -> None:
        attempt = 0
        while ch.shard is None and not ch.left:
            attempt += 1
            await asyncio.sleep(retry_delay(attempt))
            try:
                shard = await self._shard_for(ch.name)
            except Exception as e:  # noqa: BLE001 - still away
                ch.error = e
                continue
            if not ch.left:
                self._attach(shard, ch)
            return

    def _attach(self, shard: _Shard, ch: Channel) -> None:
        ch.shard = shard
        shard.channels[ch.name] = ch
        if shard.task is None or shard.task.done():
            shard.start()  # it subscribes all its channels when it connects

    def leave(self, ch: Channel) -> list[asyncio.Task[Any]]:
        """Unsubscribe ``ch``; a connection left with no channel is closed. Returns the tasks
        to await."""
        shard = ch.shard
        ch.shard = None
        ch.left = True
        if shard is None or shard.channels.get(ch.name) is not ch:
            return []
        del shard.channels[ch.name]
        ch.subscribed.clear()
        if shard.channels:
            return [self.loop.create_task(shard.unsubscribe(ch.name))]
        if self.shards.get(shard.key) is shard:
            del self.shards[shard.key]
        if shard.task is None:
            return []
        shard.task.cancel()
        return [shard.task]

    async def regroup(self, shard: _Shard) -> None:
        """After ``shard``'s connection failed (cluster): re-read the slot map and move each
        of its channels to the master that serves it now. Standalone: nothing moves."""
        if not self.cluster:
            return
        try:
            await self.redis.nodes_manager.initialize()
        except Exception:  # noqa: BLE001 - the cluster is still away: try again next time
            return
        for name, ch in list(shard.channels.items()):
            try:
                target = await self._shard_for(name)
            except Exception:  # noqa: BLE001 - the cluster is away: this shard retries
                return
            if target is not shard:
                del shard.channels[name]
                await self.join(ch)
        if not shard.channels and self.shards.get(shard.key) is shard:
            del self.shards[shard.key]
