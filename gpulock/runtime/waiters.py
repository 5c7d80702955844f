"""The waiters of one pool object: the acquires the server queued, and grant delivery to them.

A :class:`Waiter` is one queued request (one ticket) with the future its acquire waits on;
:class:`WaiterRegistry` holds them by ticket, completes their futures with the grants the
listener and the heartbeat find, takes in what a heartbeat's reply says of each (granted, its
position, forgotten) and ends the waits it can no longer keep while Redis is unreachable.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from gpulock.runtime.calls import Settings
from gpulock.protocol.request import Grant, LeaseState
from gpulock.protocol.replies import Queued, WaiterAnswer
from gpulock.errors import BackendUnavailable, PoolClosed

log = logging.getLogger("gpulock")


class WaiterFuture(asyncio.Future):  # type: ignore[type-arg]
    """A waiter's future (of its :class:`~gpulock.protocol.request.Grant`) that also calls its
    watchers (:meth:`watch`) synchronously, inside the call that completes or cancels it,
    rather than a loop iteration later as done-callbacks are: a thread blocked on it (the sync
    shell's) is woken by the very delivery. An exception set on it counts as retrieved (no
    "never retrieved" log): whoever still waits gets it, and nobody else is to be told.

    Completing it on another thread than its loop's is safe while nothing but watchers waits
    on it (done-callbacks would be scheduled unsafely): so for the sync shell's waiters, which
    its threads complete when they read a grant (:mod:`gpulock.runtime.sync_listener`)."""

    _watchers: list[Callable[[WaiterFuture], None]] | None = None

    def watch(self, fn: Callable[[WaiterFuture], None]) -> None:
        """Call ``fn(self)`` when the future is done (now, when it is already)."""
        if self.done():
            fn(self)
        elif self._watchers is None:
            self._watchers = [fn]
        else:
            self._watchers.append(fn)

    def _notify(self) -> None:
        watchers, self._watchers = self._watchers, None
        for fn in watchers or ():
            try:
                fn(self)
            except Exception:
                log.exception("gpulock: a waiter's watcher raised")

    def set_result(self, result: Any) -> None:
        super().set_result(result)
        self._notify()

    def set_exception(self, exception: Any) -> None:
        super().set_exception(exception)
        self.exception()  # marks it retrieved
        self._notify()

    def cancel(self, msg: Any = None) -> bool:
        cancelled = super().cancel(msg)
        if cancelled:
            self._notify()
        return cancelled


@dataclass
class Waiter:
    ticket: str
    future: WaiterFuture
    argv: list[str]  # the acquire ARGV, to re-enqueue idempotently if the queue forgot us
    waiter_ttl_ms: int
    position: int
    on_position: Callable[[int], Any] | None = None
    users: int = 1  # local acquires sharing this ticket (one request id used concurrently)
    refreshed: float = 0.0  # local time of the last call that kept (or took again) its place
    # Local time the acquire(s) waiting on it give up (their timeout); None: no timeout.
    deadline: float | None = None
    # The script that queued it and queues it again with ``argv``: "acquire", or "resize" for
    # a lease's growth (its grant is the lease's new amount).
    script: str = "acquire"


class WaiterRegistry:
    """The waiters of pool ``pool`` by ticket (:attr:`waiters`); ``leases``: the leases the
    pool object holds (:meth:`ticket_in_use`); ``settings``: its backend_timeout.

    Registering, removing and completing waiters is safe from any thread (:attr:`lock`): the
    sync shell registers and leaves its waiters on its callers' threads, while the loop
    delivers grants and fails waits."""

    def __init__(
        self,
        pool: str,
        clock: Callable[[], float],
        settings: Settings,
        leases: Mapping[str, LeaseState],
    ):
        self.pool = pool
        self.clock = clock
        self.settings = settings
        self.leases = leases
        self.waiters: dict[str, Waiter] = {}
        self._unclaimed: OrderedDict[str, Grant] = OrderedDict()  # grants that beat their waiter
        self.lock = threading.RLock()

    def add(self, w: Waiter, now: float) -> bool:
        """Register ``w`` (its place kept as of ``now`` unless it says when) and hand it a
        grant that arrived before it. Returns whether it is the only waiter."""
        with self.lock:
            first = not self.waiters
            self.waiters[w.ticket] = w
            if not w.refreshed:
                w.refreshed = now
            g = self._unclaimed.pop(w.ticket, None)
            if g is not None and g.lease_id == w.argv[1] and not w.future.done():
                w.future.set_result(g)  # only a grant made with this request's own lease id
            return first

    def remove(self, ticket: str) -> bool:
        """Forget the waiter of ``ticket``; returns whether no waiter is left."""
        with self.lock:
            self.waiters.pop(ticket, None)
            return not self.waiters

    def ticket_in_use(self, ticket: str) -> bool:
        """Whether another local acquire still waits on ``ticket`` or a live local lease came
        from it: then a give-up must not withdraw the request on the server."""
        return ticket in self.waiters or any(
            s.ticket == ticket and not s.released and s.lost_reason is None
            for s in list(self.leases.values())
        )

    def deliver(self, grant: Grant) -> None:
        """Complete the future of the waiter ``grant`` is for, or keep the grant for it."""
        with self.lock:
            w = self.waiters.get(grant.ticket)
            if w is not None:
                if not w.future.done():
                    w.future.set_result(grant)
                return
            # No waiter yet: the grant may have overtaken the reply that queued the ticket (the
            # pub/sub connection was read first, or the sync shell has not registered its
            # waiter yet). Keep it briefly so add can claim it instead of waiting for a poll.
            self._unclaimed[grant.ticket] = grant
            while len(self._unclaimed) > 1024:
                self._unclaimed.popitem(last=False)

    def fail(self, w: Waiter, err: BaseException) -> None:
        """End the wait of ``w`` with ``err`` unless it is over."""
        with self.lock:
            if not w.future.done():
                w.future.set_exception(err)

    def waiter_bound(self, w: Waiter) -> float:
        """Seconds a queued waiter may go without a call that keeps its place before it fails
        with BackendUnavailable: its waiter_ttl (the server keeps the place that long without a
        refresh) plus backend_timeout (the retries a new acquire would get to queue again), or
        until its deadline when that is later (time left means keep trying: a failover
        shorter than the acquire's timeout is ridden out)."""
        bound = w.waiter_ttl_ms / 1000.0 + self.settings.backend_timeout
        if w.deadline is not None:
            bound = max(bound, w.deadline - w.refreshed)
        return bound

    def soonest_bound(self) -> float:
        """The local time just after the first waiter still waiting passes its
        :meth:`waiter_bound` (inf: none waits)."""
        t = float("inf")
        for w in self.waiters.values():
            if w.future is not None and not w.future.done():
                t = min(t, w.refreshed + self.waiter_bound(w) + 0.001)
        return t

    def fail_stranded(self, now: float, err: BaseException | None = None) -> None:
        """End the waits of waiters whose place could not be kept or taken again within
        :meth:`waiter_bound` while Redis is unreachable (the heartbeat's last try failed, with
        ``err``; it calls this only then): BackendUnavailable."""
        backend_timeout = self.settings.backend_timeout
        for w in list(self.waiters.values()):
            if w.future is None or w.future.done():
                continue
            if now - w.refreshed > self.waiter_bound(w):
                self.fail(
                    w,
                    BackendUnavailable(
                        f"pool {self.pool!r}: Redis unreachable for {now - w.refreshed:.1f}s while this request "
                        f"was queued: its place could not be kept or taken again (bound: waiter_ttl "
                        f"{w.waiter_ttl_ms / 1000:g}s + backend_timeout {backend_timeout:g}s, or "
                        f"the acquire's timeout){'; the last error: ' + str(err) if err else ''}"
                    ),
                )

    def fail_all_closed(self) -> None:
        """End every wait with PoolClosed (the pool object closed)."""
        for w in list(self.waiters.values()):
            self.fail(w, PoolClosed(self.pool))

    def take_answers(
        self, waiters: list[Waiter], answers: list[WaiterAnswer], sent: float
    ) -> list[Waiter]:
        """Take in a heartbeat's answer for each of ``waiters`` (sent at local time ``sent``;
        :func:`gpulock.protocol.replies.decode_renew`): a grant is delivered, a new position
        reported. Returns those the queue forgot and that still wait, in their old order."""
        forgotten = []
        for w, res in zip(waiters, answers):
            # Redis answered for this waiter: its bound (see waiter_bound) counts from here,
            # also when the answer is that the queue forgot it and it is queued again
            # (a crowd of waiters re-queued one by one after a restart must not fail because
            # one later heartbeat failed while they had not yet had their turn).
            w.refreshed = sent
            if isinstance(res, Grant):
                self.deliver(res)
            elif isinstance(res, Queued):
                pos = res.position
                if pos != w.position:
                    w.position = pos
                    if w.on_position:
                        try:
                            w.on_position(res.place)
                        except Exception:
                            log.exception("gpulock: on_queued callback raised")
            elif w.ticket in self.waiters and w.future is not None and not w.future.done():
                forgotten.append(w)
        forgotten.sort(key=lambda w: w.position)
        return forgotten
