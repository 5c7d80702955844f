"""The hand-off subscription of one pool object: the grants the server publishes, delivered.

Release, cancel, reap and configure grant the FIFO prefix that fits *on the server* and
publish the grants on this process's channel (``<events key>:<channel_id>``); one task reads
them and hands exactly those waiters their grants (:meth:`WaiterRegistry.deliver`). Nobody
else is woken and no extra round trip is needed (server-side hand-off). While the
subscription is down the heartbeat's polling finds the grants instead.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from redis.exceptions import AuthenticationError, NoPermissionError

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

    async def _listen(self) -> None:
        subscribed, news = self._subscribed, self._news
        assert subscribed is not None and news is not None  # made by ensure_subscribed
        attempt = 0
        while not self._is_closed():
            ps = self.redis.pubsub(ignore_subscribe_messages=False)
            try:
                await ps.subscribe(self.channel)
                while not self._is_closed():
                    msg = await ps.get_message(timeout=1.0)
                    if msg is None:
                        continue
                    if msg["type"] == "subscribe":
                        subscribed.set()
                        self._error = None
                        news.set()
                        attempt = 0
                        self._log.ok()
                    elif msg["type"] == "message":
                        for g in decode_events(msg["data"]):
                            self._registry.deliver(g)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # connection trouble: the heartbeat's polling covers us
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
