"""The hand-off subscription of one pool object: the grants the server publishes, delivered.

Release, cancel, reap and configure grant the FIFO prefix that fits *on the server* and
publish the grants on this process's channel (``<events key>:<channel_id>``); one task reads
them and hands exactly those waiters their grants (:meth:`WaiterRegistry.deliver`). Nobody
else is woken and no extra round trip is needed (server-side hand-off). While the
subscription is down the heartbeat's polling finds the grants instead.

The scripts publish with ``SPUBLISH`` where the server has sharded pub/sub (Redis ≥ 7, Valkey
≥ 7.2) and with ``PUBLISH`` on Redis 6.2 (``lua/lib.lua``); the listener follows the same
rule, decided once per subscription connection: it sends ``SSUBSCRIBE`` first, and on a
server that does not know it, ``SUBSCRIBE``. On a cluster the sharded subscription is made
on the pool's own shard (redis-py's ``ClusterPubSub`` follows the slot when it moves).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from ._cluster import is_cluster_client

from ._failure_log import FailureLog
from ._protocol import decode_events, retry_delay, translate
from ._waiters import WaiterRegistry

log = logging.getLogger("gpulock")


class Listener:
    """The subscription of pool ``pool`` to ``channel`` on ``redis`` (a redis.asyncio
    client); grants go to ``registry``; it stops when ``is_closed()``."""

    def __init__(
        self,
        redis: Any,
        pool: str,
        channel: str,
        registry: WaiterRegistry,
        clock: Callable[[], float],
        is_closed: Callable[[], bool],
    ):
        self.redis = redis
        self.pool = pool
        self.channel = channel
        self._registry = registry
        self._is_closed = is_closed
        self._task: asyncio.Task[None] | None = None
        self._subscribed: asyncio.Event | None = None
        self._news: asyncio.Event | None = None  # set at each subscription and each failure
        self._error: BaseException | None = None
        self._log = FailureLog(
            f"pub/sub subscription for pool {pool}", clock=clock, level=logging.INFO
        )
        #: Whether the subscription is sharded (SSUBSCRIBE); None until the server answered.
        self.sharded: bool | None = None

    @property
    def subscribed(self) -> bool:
        """Whether the subscription is confirmed now (see :meth:`ensure_subscribed`)."""
        return self._subscribed is not None and self._subscribed.is_set()

    async def ensure_subscribed(self) -> None:
        """Subscribe (once) and wait until Redis confirmed it, so that no grant published
        after our next enqueue can be missed."""
        if self._subscribed is None:
            self._subscribed = asyncio.Event()
            self._news = asyncio.Event()
            self._error = None
        assert self._news is not None  # made with _subscribed
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._listen(), name=f"gpulock-listener-{self.pool}"
            )
        if not self._subscribed.is_set():
            if self._error is not None:
                self._news.clear()  # an old failure: wait for the listener's next attempt
            try:
                await asyncio.wait_for(self._news.wait(), 5.0)
            except asyncio.TimeoutError:
                log.warning(
                    "gpulock: pub/sub subscription to pool %s not confirmed in 5 s; "
                    "waiters fall back to polling",
                    self.pool,
                )
            err = self._error
            if err is not None and not self._subscribed.is_set():
                if isinstance(err, (AuthenticationError, NoPermissionError)):
                    raise translate(err, self.pool) from err  # retrying cannot help
                # Redis unreachable: go on; the acquire call reports it within its own bound
                # (instead of after this wait), and waiters would fall back to polling.

    def cancel(self) -> list[asyncio.Task[Any]]:
        """Cancel the listening task; returns it (none: empty) for the caller to await."""
        if self._task is None:
            return []
        self._task.cancel()
        return [self._task]

    async def _subscribe(self, ps: Any) -> bool:
        """Subscribe ``ps`` to the channel, sharded if the server has it; returns whether it
        is sharded. Raises what the server or the connection raises."""
        if self.sharded is not False:
            await ps.ssubscribe(self.channel)  # refused on 6.2: see _listen
            return True
        await ps.subscribe(self.channel)
        return False

    async def _listen(self) -> None:
        subscribed, news = self._subscribed, self._news
        assert subscribed is not None and news is not None  # made by ensure_subscribed
        attempt = 0
        cluster = is_cluster_client(self.redis)
        while not self._is_closed():
            ps = self.redis.pubsub(ignore_subscribe_messages=False)
            try:
                sharded = await self._subscribe(ps)
                read = ps.get_sharded_message if sharded and cluster else ps.get_message
                while not self._is_closed():
                    msg = await read(timeout=1.0)
                    if msg is None:
                        continue
                    kind = msg["type"]
                    kind = kind.decode() if isinstance(kind, bytes) else kind
                    if kind in ("subscribe", "ssubscribe"):
                        self.sharded = kind == "ssubscribe"
                        subscribed.set()
                        self._error = None
                        news.set()
                        attempt = 0
                        self._log.ok()
                    elif kind in ("message", "smessage"):
                        for g in decode_events(msg["data"]):
                            self._registry.deliver(g)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # connection trouble: the heartbeat's polling covers us
                if (
                    isinstance(e, ResponseError)
                    and self.sharded is not False
                    and "unknown command" in str(e).lower()
                ):
                    self.sharded = False  # Redis 6.2, no SSUBSCRIBE: its scripts PUBLISH
                    continue
                subscribed.clear()
                self._error = e  # for ensure_subscribed: stop waiting, and why
                news.set()
                self._log.failed(e)
                attempt += 1
                await asyncio.sleep(retry_delay(attempt))
            finally:
                try:
                    await ps.aclose()
                except Exception:
                    pass
