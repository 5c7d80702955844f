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
heartbeat's polling), waits :func:`gpulock.protocol.retry.retry_delay`, and subscribes them again — on
a cluster after re-reading the slot map, each on the master that serves its slot now.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Callable, Union

from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from gpulock_common.driver import adrive

from gpulock.transport.cluster import is_cluster_client
from gpulock.transport.route import ShardUnavailable
from gpulock.transport.failure_log import FailureLog
from gpulock.protocol.retry import retry_delay
from gpulock.transport.translate import translate

__all__ = ["Channel", "Hub"]

log = logging.getLogger("gpulock")


#: Seconds an acquire waits for its subscription's confirmation before it queues (then it goes
#: on, and its grant may come by the heartbeat's polling).
CONFIRM_WAIT_S = 5.0


class Channel:
    """One pool object's channel on a subscription connection: ``deliver(data)`` gets each
    message's payload; ``subscribed`` is set while the server confirms the subscription;
    ``news`` is set at each confirmation and each failure (``error``: the last one, None once
    subscribed). ``event``: the class of the two events (``asyncio.Event`` for a connection
    read in an event loop, ``threading.Event`` for one read by threads). ``resubscribed()``
    (optional) is called, on the reading side, when the channel is confirmed again after it
    was lost (a failure, or its slot moved)."""

    def __init__(
        self,
        name: str,
        deliver: Callable[[bytes], None],
        event: Callable[[], Any] = asyncio.Event,
        resubscribed: Callable[[], None] | None = None,
    ):
        self.name = name
        self.deliver = deliver
        self.subscribed = event()
        self.news = event()
        # Called when the server confirms the channel again after it was lost (a message
        # published meanwhile was missed: the pool object polls its waiters at once).
        self.resubscribed = resubscribed
        self.lost = False
        self.error: BaseException | None = None
        self.shard: _Shard | None = None  # the hub's connection it is on
        self.left = False  # the pool object left the connection

    def awaiting_news(self) -> bool:
        """Before a wait for the subscription's confirmation (up to :data:`CONFIRM_WAIT_S`):
        whether there is anything to wait for; an old failure is forgotten, so the wait is for
        the connection's next attempt."""
        if self.subscribed.is_set():
            return False
        if self.error is not None:
            self.news.clear()
        return True

    def after_news(self, pool: str, in_time: bool) -> None:
        """After that wait (``in_time``: news came): say so when none came (waiters fall back
        to polling); raise an error retrying cannot help (AuthenticationError,
        NoPermissionError: translated). Redis unreachable raises nothing: the acquire call
        reports it within its own bound, and waiters would fall back to polling."""
        if not in_time:
            log.warning(
                "gpulock: pub/sub subscription to pool %s not confirmed in %g s; "
                "waiters fall back to polling",
                pool,
                CONFIRM_WAIT_S,
            )
        err = self.error
        if err is not None and not self.subscribed.is_set():
            if isinstance(err, (AuthenticationError, NoPermissionError)):
                raise translate(err, pool) from err


class _SlotMoved(Exception):
    """A sharded channel was unsubscribed by the server (its slot migrated)."""


def _kind(msg: dict[str, Any]) -> str:
    k = msg["type"]
    return k.decode() if isinstance(k, bytes) else str(k)


def _name(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


# ---- the life of one subscription connection, without I/O ------------------------------------
# Its driver (the asyncio _Shard below, or the sync shell's ThreadSubscription) carries out
# each step with its own client and sends back the result (a Read: the message or None; the
# others: None), or throws in the error the step raised (an Exception; anything else, such as
# a cancellation, ends the driver without resuming the life).


@dataclass(frozen=True)
class Open:
    """Make a new pub/sub connection object (nothing is sent yet); it is the live one now."""


@dataclass(frozen=True)
class Send:
    """Subscribe ``names`` on the live connection: ``SSUBSCRIBE`` unless ``sharded`` is False
    (then ``SUBSCRIBE``)."""

    names: tuple[str, ...]
    sharded: bool


@dataclass(frozen=True)
class Read:
    """The next message of the live connection, or None when none came within the driver's
    wait."""


@dataclass(frozen=True)
class Close:
    """Close the live connection, quietly; none is live after."""


@dataclass(frozen=True)
class Pause:
    """Wait ``seconds`` before the next attempt to connect."""

    seconds: float


@dataclass(frozen=True)
class Regroup:
    """After a failure: let the driver move its channels to the servers that serve them now
    (a cluster's slots may have moved); nothing to do on one server."""


@dataclass(frozen=True)
class Rehome:
    """The server dropped channel ``ch`` (its slot moved to another node) while others stay
    on this connection: the driver subscribes it where its slot is served now. Only a
    connection of several channels (the hub's) gets it; a lone channel's connection starts
    again instead."""

    ch: Channel


SubStep = Union[Open, Send, Read, Close, Pause, Regroup, Rehome]


class Connection:
    """The state of one subscription connection and its channels (:attr:`channels`, by
    name), and :meth:`life`, what the connection does, as steps for a driver. ``what`` names
    it in the log."""

    def __init__(self, what: str):
        self.channels: dict[str, Channel] = {}
        self.sharded: bool | None = None  # None until the server answered
        self._log = FailureLog(what, level=logging.INFO)

    def life(self) -> Generator[SubStep, Any, None]:
        """Connect, subscribe every channel, hand each message to its channel, until no
        channel is left. A failure (a step's error) marks the channels unsubscribed (their
        waiters fall back to the heartbeat's polling), waits :func:`gpulock.protocol.retry.retry_delay`,
        regroups and connects again; a server without sharded pub/sub (Redis 6.2: "unknown
        command") makes it use classic ``SUBSCRIBE`` from then on, at once."""
        attempt = 0
        while self.channels:
            try:
                yield Open()
                yield Send(tuple(self.channels), self.sharded is not False)
                while self.channels:
                    msg = yield Read()
                    if msg is None:
                        continue
                    gone = self.dropped(msg)
                    if gone is not None and len(self.channels) > 1:
                        del self.channels[gone.name]
                        gone.subscribed.clear()
                        gone.lost = True
                        yield Rehome(gone)
                    elif self.take(msg):
                        attempt = 0
            except Exception as e:  # connection trouble: the heartbeat's polling covers us
                yield Close()
                if (
                    isinstance(e, ResponseError)
                    and self.sharded is not False
                    and "unknown command" in str(e).lower()
                ):
                    self.sharded = False  # Redis 6.2, no SSUBSCRIBE: its scripts PUBLISH
                    continue
                self.failed(e)
                attempt += 1
                yield Pause(retry_delay(attempt))
                yield Regroup()
                continue
            yield Close()

    def dropped(self, msg: dict[str, Any]) -> Channel | None:
        """The channel we still want that ``msg`` says the server dropped (its slot moved
        away), or None."""
        if _kind(msg) != "sunsubscribe":
            return None
        return self.channels.get(_name(msg.get("channel")))

    def take(self, msg: dict[str, Any]) -> bool:
        """Take in one message of the connection: a confirmation (returns True), a channel's
        payload (to its ``deliver``), or the server dropping a channel we still want
        (raises _SlotMoved); anything else is ignored."""
        kind = _kind(msg)
        ch = self.channels.get(_name(msg.get("channel")))
        if kind in ("subscribe", "ssubscribe"):
            self.sharded = kind == "ssubscribe"
            self._log.ok()
            if ch is not None:
                ch.error = None
                ch.subscribed.set()
                ch.news.set()
                if ch.lost:
                    ch.lost = False
                    if ch.resubscribed is not None:
                        ch.resubscribed()
            return True
        if kind in ("message", "smessage") and ch is not None:
            ch.deliver(msg["data"])
        elif kind == "sunsubscribe" and ch is not None:
            # the server dropped a channel we still want: its slot moved away
            raise _SlotMoved(f"the slot of {ch.name} moved to another node")
        return False

    def failed(self, e: BaseException) -> None:
        """The connection failed with ``e``: its channels are unsubscribed until it is back."""
        for ch in self.channels.values():
            ch.subscribed.clear()
            ch.lost = True
            ch.error = e  # for ensure_subscribed: stop waiting, and why
            ch.news.set()
        self._log.failed(e)


class _Shard(Connection):
    """One subscription connection of a hub (to ``client``, a client of one server) and its
    channels: the asyncio driver of :meth:`Connection.life`."""

    def __init__(self, hub: Hub, key: str, client: Any):
        super().__init__(f"pub/sub subscription{' on ' + key if key else ''}")
        self.hub, self.key, self.client = hub, key, client
        self.ps: Any = None  # the live PubSub, once its first subscription was sent
        self._open: Any = None  # the PubSub the life opened and has not closed
        self.task: asyncio.Task[None] | None = None

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
        try:
            # the life decides on an Exception; a cancellation (not one) ends it
            await adrive(self.life(), self._do, catch=Exception)
        finally:
            await self._close()

    async def _do(self, step: SubStep) -> Any:
        if isinstance(step, Read):
            return await self.ps.get_message(timeout=1.0)
        if isinstance(step, Open):
            self._open = self.client.pubsub(ignore_subscribe_messages=False)
            return None
        if isinstance(step, Send):
            self.ps = self._open
            return await self.subscribe(list(step.names))
        if isinstance(step, Close):
            return await self._close()
        if isinstance(step, Pause):
            return await asyncio.sleep(step.seconds)
        if isinstance(step, Rehome):
            return await self.hub.rehome(self, step.ch)
        return await self.hub.regroup(self)

    async def _close(self) -> None:
        ps, self._open, self.ps = self._open, None, None
        if ps is not None:
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
            from gpulock.transport.shards import shards_of, slot_of
            from gpulock.transport.shards_async import AsyncShards

            shards = shards_of(self.redis)
            assert isinstance(shards, AsyncShards)
            await shards.ready()  # the slot map (a no-op once read)
            slot = slot_of(name)
            shards.tracked.add(slot)
            node = shards.node_name(slot)
            if node is None:
                raise ShardUnavailable(slot, None, "no master serves it (the slot map has none)")
            key, client = node, shards.pubsub_client(node)
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
        if ch.left:  # left while the slot map was read: attaching it now would leak it
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

    async def rehome(self, shard: _Shard, ch: Channel) -> None:
        """``ch`` was dropped by ``shard``'s server (its slot moved): learn who serves it now
        and subscribe it there; the other channels of ``shard`` stay as they are."""
        ch.shard = None
        from gpulock.transport.shards import shards_of, slot_of
        from gpulock.transport.shards_async import AsyncShards

        shards = shards_of(self.redis)
        if isinstance(shards, AsyncShards):
            try:
                await shards.refresh(slot_of(ch.name), shard.key)
            except Exception:  # noqa: BLE001 - join retries in the background
                pass
        await self.join(ch)

    async def regroup(self, shard: _Shard) -> None:
        """After ``shard``'s connection failed (cluster): re-read the slot map and move each
        of its channels to the master that serves it now. Standalone: nothing moves."""
        if not self.cluster or not shard.channels:
            return
        from gpulock.transport.shards import shards_of, slot_of
        from gpulock.transport.shards_async import AsyncShards

        shards = shards_of(self.redis)
        assert isinstance(shards, AsyncShards)
        try:  # who serves the slots now (asked of a node other than the one that failed)
            await shards.refresh(slot_of(next(iter(shard.channels))), shard.key)
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
