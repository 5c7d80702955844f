"""The hand-off subscription of one pool object: the grants the server publishes, delivered,
and the yield requests of preemption, handed to the leases held.

Release, cancel, reap and configure grant the FIFO prefix that fits *on the server* and
publish the grants on this process's channel (``<events key>:<channel_id>``); the pool
object's channel, on its client's shared subscription connection (:mod:`gpulock.transport.pubsub`: one
per shard, however many pool objects use the client), hands exactly those waiters their grants
(:meth:`WaiterRegistry.deliver`). Nobody else is woken and no extra round trip is needed
(server-side hand-off). While the subscription is down the heartbeat's polling finds the grants
instead.

The same channel carries the requests to yield a lease (preemption): they go to the held
leases (:meth:`HeldLeases.ask`). So the subscription stays while the pool object holds leases,
not only while it waits: the runtime subscribes when it starts to hold one
(:meth:`gpulock.runtime.runtime.Runtime.track`) and leaves only when it closes. Where another
reader takes the grants (the sync shell's waiting threads: :mod:`gpulock.runtime.sync_listener`),
:attr:`Listener.grants_elsewhere` is set and this one hands on only the yield requests.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from gpulock_common.aio import stop_tasks, wait_for
from gpulock.protocol.replies import decode_events, decode_give_back, decode_yields
from gpulock.transport.pubsub import CONFIRM_WAIT_S, Channel, Hub
from gpulock.runtime.shared import Shared

log = logging.getLogger("gpulock")


class Listener:
    """The subscription of the pool of ``shared`` to ``channel`` on ``redis`` (a
    redis.asyncio client); grants go to its waiters (the shared connection logs and stops on
    its own). ``resubscribed()``: called when the subscription is back after it was lost;
    ``wanted_back()``: when the server asks for kept bytes back (:mod:`gpulock.runtime.kept`)."""

    def __init__(
        self,
        redis: Any,
        channel: str,
        shared: Shared,
        resubscribed: Callable[[], None] | None = None,
        wanted_back: Callable[[], None] | None = None,
    ):
        self.redis = redis
        self._resubscribed = resubscribed
        self._wanted_back = wanted_back
        self.pool = shared.pool
        self.channel = channel
        self._registry = shared.waiters
        self._leases = shared.leases
        self._tasks = shared.tasks
        self._is_closed = shared.is_closed
        #: Whether the grants are read by someone else (the sync shell's waiting threads):
        #: this one then hands on only the yield requests.
        self.grants_elsewhere = False
        self._hub: Hub | None = None
        self._ch: Channel | None = None

    @property
    def subscribed(self) -> bool:
        """Whether the subscription is confirmed now (see :meth:`ensure_subscribed`)."""
        return self._ch is not None and self._ch.subscribed.is_set()

    @property
    def sharded(self) -> bool | None:
        """Whether the subscription is sharded (SSUBSCRIBE); None until the server answered."""
        shard = self._ch.shard if self._ch is not None else None
        return shard.sharded if shard is not None else None

    def _deliver(self, data: bytes) -> None:
        grants = decode_events(data)
        if not grants:
            if self._wanted_back is not None and decode_give_back(data) is not None:
                self._wanted_back()  # kept bytes: someone waits (gpulock.runtime.kept)
            else:
                self._leases.ask(decode_yields(data))
        elif not self.grants_elsewhere:
            for g in grants:
                self._registry.deliver(g)

    @property
    def joined(self) -> bool:
        """Whether it has joined the shared connection (subscribed, or subscribing)."""
        return self._ch is not None

    async def ensure_subscribed(self) -> None:
        """Subscribe (once) and wait until Redis confirmed it, so that no grant published
        after our next enqueue can be missed."""
        if self._ch is None:
            self._hub = Hub.of(self.redis)
            self._ch = Channel(self.channel, self._deliver, resubscribed=self._resubscribed)
            await self._hub.join(self._ch)
        ch = self._ch
        if ch.awaiting_news():
            try:
                await wait_for(ch.news.wait(), CONFIRM_WAIT_S)
                in_time = True
            except asyncio.TimeoutError:
                in_time = False
            ch.after_news(self.pool, in_time)

    def listen_soon(self) -> None:
        """Subscribe in the background (in the loop), unless done already or closed; for a
        lease whose holder must hear from the server while it holds it (an ask to yield, a
        request for kept bytes back), and whose acquire did not subscribe. Safe from any
        thread; nothing when there is no loop (the renewals' replies tell it too)."""

        def start() -> None:
            if not self._is_closed() and not self.joined:
                self._tasks.spawn(self.subscribe_quietly())

        if not self.joined:
            try:
                self._tasks.in_loop(start)
            except RuntimeError:  # no loop yet, or it is closed: renewals still tell
                pass

    async def subscribe_quietly(self) -> None:
        """Subscribe and wait until confirmed, unless closed; a failure is logged, not raised:
        what comes on the channel for held leases also comes in the renewals' replies."""
        # close() may have run between the spawn and this start, or during the subscription:
        # then leave at once, or the shared connection would keep a channel nobody leaves
        if self._is_closed():
            return
        try:
            await self.ensure_subscribed()
        except Exception as e:  # noqa: BLE001 - best effort: the renewals tell it too
            log.debug("gpulock: pool %s: subscription for held leases failed: %s", self.pool, e)
        if self._is_closed():
            await stop_tasks(self.cancel())

    def cancel(self) -> list[asyncio.Task[Any]]:
        """Leave the shared connection (closed when no pool object uses it any more);
        returns the tasks for the caller to await."""
        if self._ch is None or self._hub is None:
            return []
        ch, self._ch = self._ch, None
        return self._hub.leave(ch)
