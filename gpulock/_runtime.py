"""The per-pool background runtime: one per pool object, living in one event loop.

It runs two tasks:

* the **listener**: one pub/sub subscription to the pool's ``events`` channel. Release,
  cancel, reap and configure grant the FIFO prefix that fits *on the server* and publish the
  grants; the listener completes exactly those waiters' futures. Nobody else is woken and no
  extra round trip is needed (server-side hand-off).
* the **ticker**: one batched ``renew`` call per interval renews every lease this pool object
  holds (at ttl/3) and refreshes every waiter's expiry (each ``poll_interval``); the same reply
  returns grants whose message was missed (the backstop). It also fires the reap timer at the
  nearest lease expiry the server reported, so a crashed holder's bytes move on at once, and it
  marks leases lost when their local validity deadline passes.

Creating a lease starts no thread and no task; the tasks start with the first lease or waiter.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

from redis.exceptions import AuthenticationError, NoPermissionError

from ._protocol import (
    DEFAULT_MAX_WAITERS,
    DEFAULT_POLL_INTERVAL_S,
    REASSERT_REFUSED,
    RETRYABLE,
    Grant,
    LeaseState,
    decode_events,
    retry_delay,
    retrying,
    translate,
    ttl_ms,
    validity_deadline,
)
from ._failure_log import FailureLog
from ._flow import configure_args, queue_synced_renew, synced_renew_reply
from ._keys import pool_key
from ._scripts import scripts
from .errors import BackendUnavailable, PoolClosed

log = logging.getLogger("gpulock")

DEFAULT_BACKEND_TIMEOUT_S = 5.0  # the pool object's backend_timeout, until it sets its own


@dataclass
class Waiter:
    ticket: str
    future: asyncio.Future
    argv: list[str]  # the acquire ARGV, to re-enqueue idempotently if the queue forgot us
    waiter_ttl_ms: int
    position: int
    on_position: Callable[[int], Any] | None = None
    users: int = 1  # local acquires sharing this ticket (one request id used concurrently)
    refreshed: float = 0.0  # local time of the last call that kept (or took again) its place


class Runtime:
    def __init__(
        self,
        redis,
        pool: str,
        keys: Sequence[str],
        clock: Callable[[], float],
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        self.redis = redis  # a redis.asyncio client
        self.pool = pool
        self.keys = keys
        self.clock = clock
        self.poll_interval = poll_interval
        self.leases: dict[str, LeaseState] = {}
        self.waiters: dict[str, Waiter] = {}
        self.anchor: tuple[float, int] | None = None  # (local time sent, server now ms)
        self.reap_at: float | None = None
        self.next_poll = 0.0
        self._wake: asyncio.Event | None = None
        self._loop = loop  # the loop the tasks run in (known up front for the sync shell)
        self._ticker: asyncio.Task | None = None
        self._ticker_at = 0.0  # when the ticker plans to wake next (local clock)
        self._watchdog: asyncio.Task | None = None
        self._dog_wake: asyncio.Event | None = None
        self._dog_at = 0.0  # when the watchdog plans to wake next; inf while it has no lease
        self._listener: asyncio.Task | None = None
        self._subscribed: asyncio.Event | None = None
        self._background: set[asyncio.Task] = set()
        self._closed = False
        # This process's pub/sub channel for hand-offs: "<events key>:<channel_id>".
        self.channel_id = secrets.token_hex(8)
        self._states: weakref.WeakValueDictionary[str, LeaseState] = weakref.WeakValueDictionary()
        self._states_lock = threading.Lock()  # the sync shell makes leases on caller threads
        self._unclaimed: OrderedDict[str, Grant] = OrderedDict()  # grants that beat their waiter
        # What this pool object knows of its pool, to create it again and put its leases back
        # when Redis lost it (the grace period in docs/SEMANTICS.md). The pool object sets the first
        # three; the others come from replies.
        self.capacity: int | None = None  # the pool object's capacity= (None: not given)
        self.max_waiters = DEFAULT_MAX_WAITERS
        self.max_ttl_ms = 0
        # What the server last showed of the incarnation this object knows (known_epoch): a
        # pool made again after a loss gets these, not the pool object's own settings.
        self.capacity_seen = 0
        self.max_waiters_seen = 0
        self.max_ttl_seen_ms = 0
        self._settings_asked = False  # one background status read for max_ttl/max_waiters
        # The pool's epoch this object knows (0: never seen). Only the first reply and the
        # recovery after a loss set it (see seen()): a reply with another epoch, or none, makes
        # the heartbeat run at once (_restart_suspected) and recover.
        self.known_epoch = 0
        self._restart_suspected = False
        self._jeopardy = False  # a renewal failed and none has succeeded since
        self.backend_timeout = DEFAULT_BACKEND_TIMEOUT_S  # the bound of background retries
        self._retry_at = 0.0  # after a failed tick: not before this (local clock)
        self._requeue: OrderedDict[str, Waiter] = OrderedDict()  # waiters whose place Redis forgot
        self._requeuer: asyncio.Task | None = None
        self._tick_log = FailureLog(f"heartbeat for pool {pool}", clock=clock)
        self._sub_log = FailureLog(
            f"pub/sub subscription for pool {pool}", clock=clock, level=logging.INFO
        )
        # sync_replicas (the pool object's option): a renewal counts for the lease's validity
        # only once that many replicas acknowledged it (WAIT), so a failover to one of them
        # cannot lose what the holder relies on. 0: off.
        self.sync_replicas = 0
        self.sync_timeout_ms = 1000
        self.sync_key = pool_key(pool, "sync")  # a counter INCRed before each WAIT

    # ---- the pool object's side ------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (no heartbeat or listener serves a lease after)."""
        return self._closed

    @property
    def subscribed(self) -> bool:
        """Whether the hand-off subscription is confirmed now (see :meth:`ensure_subscribed`)."""
        return self._subscribed is not None and self._subscribed.is_set()

    def use_settings(
        self,
        *,
        capacity: int | None,
        max_waiters: int,
        max_ttl_ms: int,
        sync_replicas: int,
        sync_timeout_ms: int,
        backend_timeout: float,
    ) -> None:
        """Take the pool object's settings: what the heartbeat needs to create the pool again
        after Redis lost it (capacity in bytes, None: not given; max_waiters; max_ttl in ms),
        ``sync_replicas`` with its WAIT timeout (ms), and the bound of background retries (s)."""
        self.capacity, self.max_waiters, self.max_ttl_ms = capacity, max_waiters, max_ttl_ms
        self.sync_replicas, self.sync_timeout_ms = sync_replicas, sync_timeout_ms
        self.backend_timeout = backend_timeout

    # ---- clock -------------------------------------------------------------------------
    def observe(self, sent: float, now_ms: int) -> None:
        """Record a (local send time, server time) pair from a completed call."""
        self.anchor = (sent, now_ms)

    def deadline_for(self, grant: Grant) -> float:
        sent, server_now = self.anchor if self.anchor else (self.clock(), grant.now_ms)
        return validity_deadline(sent, server_now, grant.expires_ms)

    def seen(
        self, epoch: int, capacity: int = 0, max_waiters: int = 0, max_ttl_ms: int = 0
    ) -> None:
        """Take in what a reply showed of the pool: its epoch (0: the pool is gone) and its
        capacity (bytes), max_waiters and max_ttl (ms; 0: not in the reply). Safe from any
        thread.

        The first epoch seen is adopted. After that, a reply with another epoch or none means
        Redis lost the pool: this does not adopt it but makes the heartbeat run at once, which
        makes the pool again if it is gone, puts the leases back, queues the waiters again and
        only then adopts the new epoch. Settings are recorded from replies of the known epoch
        only, so a pool made again by someone else does not overwrite what the operator set."""
        adopted = False
        if not self.known_epoch and epoch:
            self.known_epoch = epoch
            adopted = True
        if not self.known_epoch:
            return
        if epoch != self.known_epoch:
            self.suspect_restart()
            return
        if capacity:
            self.capacity_seen = capacity
        if max_waiters:
            self.max_waiters_seen = max_waiters
        if max_ttl_ms:
            self.max_ttl_seen_ms = max_ttl_ms
        if adopted and not (self.max_ttl_seen_ms and self.max_waiters_seen):
            self._learn_settings_soon()

    def _learn_settings_soon(self) -> None:
        """The pool was first seen in a reply without its max_ttl and max_waiters (an
        acquire's): read them once, in the background, so that a pool made again after a loss
        has the operator's values and grace period, not this object's defaults. Safe from any
        thread."""
        if self._settings_asked or self._closed:
            return
        self._settings_asked = True
        try:
            self._in_loop(lambda: self.spawn(self._learn_settings()))
        except (RuntimeError, AttributeError):  # no loop yet: the next adopted epoch asks again
            self._settings_asked = False

    async def _learn_settings(self) -> None:
        from ._protocol import decode_status

        try:
            r = await self._eval("status", ["0"], bound=self.backend_timeout)
        except Exception as e:  # noqa: BLE001 - best effort: a later status()/configure() also tells
            self._settings_asked = False
            log.info(
                "gpulock: pool %s: could not read its max_ttl and max_waiters (%s: %s); a pool made "
                "again after a loss would have this object's own",
                self.pool,
                type(e).__name__,
                e,
            )
            return
        st = decode_status(self.pool, r)
        if st is not None:  # recorded only for the known epoch (see seen)
            self.seen(
                st.epoch, st.capacity, st.max_waiters, ttl_ms(st.max_ttl) if st.max_ttl else 0
            )

    def suspect_restart(self) -> None:
        """A reply showed the pool gone or made again: run the heartbeat (and so the recovery)
        now rather than at the next renewal. Safe from any thread."""
        if self._closed:
            return
        self._restart_suspected = True  # seen by the ticker even if the poke below cannot run
        try:
            self._in_loop(self._recover_soon)
        except (RuntimeError, AttributeError):  # no loop yet, or it is closed: nothing to wake
            pass

    def _recover_soon(self) -> None:
        self._restart_suspected = True
        self._ensure_ticker()
        self._poke()

    def configure_argv(
        self,
        capacity: int,
        max_waiters: int,
        max_ttl_ms: int,
        create_only: bool,
        grace: bool = False,
    ) -> list[str]:
        """ARGV of ``configure.lua`` for the pool object's ``configure``. A create-only call by
        a pool object that knew the pool (so Redis lost it) makes it again as the server last
        showed it — capacity, max_waiters, max_ttl: an operator's ``pool set`` wins over the
        values given here, which count only for a pool never seen — and with a grace period."""
        if create_only and self.known_epoch:
            capacity = self.capacity_seen or capacity
            max_waiters = self.max_waiters_seen or max_waiters
            max_ttl_ms = self.max_ttl_seen_ms or max_ttl_ms
            grace = True
        return configure_args(capacity, max_waiters, max_ttl_ms, create_only, grace)

    def set_reap_timer(self, received: float, next_expiry_in_ms: int) -> None:
        """Schedule a reap at the nearest lease expiry (local time, biased late by using the
        receive time) while this process has waiters."""
        if next_expiry_in_ms < 0:
            return
        at = received + next_expiry_in_ms / 1000.0 + 0.0005
        if self.reap_at is None or at < self.reap_at or self.reap_at <= self.clock():
            self.reap_at = at
            self._poke()

    # ---- lifecycle -----------------------------------------------------------------------
    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._loop = asyncio.get_running_loop()
            if self._wake is None:
                self._wake = asyncio.Event()
                self._dog_wake = asyncio.Event()
            self._ticker = self._loop.create_task(
                self._tick_loop(), name=f"gpulock-ticker-{self.pool}"
            )
            self._watchdog = self._loop.create_task(
                self._watch_deadlines(), name=f"gpulock-watchdog-{self.pool}"
            )

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def ensure_subscribed(self) -> None:
        """Subscribe (once) and wait until Redis confirmed it, so that no grant published
        after our next enqueue can be missed."""
        if self._subscribed is None:
            self._subscribed = asyncio.Event()
            self._sub_news = asyncio.Event()  # set at each subscription and each failure
            self._sub_error: BaseException | None = None
        if self._listener is None or self._listener.done():
            self._listener = asyncio.get_running_loop().create_task(
                self._listen(), name=f"gpulock-listener-{self.pool}"
            )
        if not self._subscribed.is_set():
            if self._sub_error is not None:
                self._sub_news.clear()  # an old failure: wait for the listener's next attempt
            try:
                await asyncio.wait_for(self._sub_news.wait(), 5.0)
            except asyncio.TimeoutError:
                log.warning(
                    "gpulock: pub/sub subscription to pool %s not confirmed in 5 s; "
                    "waiters fall back to polling",
                    self.pool,
                )
            err = self._sub_error
            if err is not None and not self._subscribed.is_set():
                if isinstance(err, (AuthenticationError, NoPermissionError)):
                    raise translate(err, self.pool) from err  # retrying cannot help
                # Redis unreachable: go on; the acquire call reports it within its own bound
                # (instead of after this wait), and waiters would fall back to polling.

    def track(self, state: LeaseState) -> None:
        """Start heartbeating a lease. Safe from any thread (the sync shell calls it on the
        caller's thread): a dict insert, plus a wake-up of the loop only when the ticker or the
        watchdog must run sooner than planned (a first lease, or a shorter ttl)."""
        self.leases[state.lease_id] = state
        if (
            self._ticker is None
            or state.next_renew < self._ticker_at
            or state.valid_until < self._dog_at
        ):
            self._in_loop(self._start_and_poke)

    def _start_and_poke(self) -> None:
        self._ensure_ticker()
        self._poke()
        assert self._dog_wake is not None  # made by _ensure_ticker, with _wake
        self._dog_wake.set()

    def _in_loop(self, fn: Callable[[], Any]) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and (self._loop is None or running is self._loop):
            fn()
        elif self._loop is None:  # no loop yet: nothing to run it in
            raise RuntimeError(f"gpulock: pool {self.pool}: no event loop yet")
        else:
            self._loop.call_soon_threadsafe(fn)

    async def _watch_deadlines(self) -> None:
        """Mark leases lost (firing on_lost) at their local validity deadlines. A task of its
        own, because the ticker may sit in a renew call to a hung Redis until the socket
        timeout, which can be longer than the ttl (invariant 5 in docs/SEMANTICS.md: a holder knows it lost
        the lease before the server expires it). One task for all leases: renewals only move
        deadlines later, so it wakes at most once per renewal period."""
        dog_wake = self._dog_wake
        assert dog_wake is not None  # made by _ensure_ticker before it starts this task
        while not self._closed:
            now = self.clock()
            soonest = float("inf")
            for s in list(self.leases.values()):
                if s.released or s.lost_reason is not None:
                    continue
                if now >= s.valid_until:
                    s.mark_lost(
                        "no successful renewal before the local validity deadline "
                        "(Redis unreachable or too slow, or this process was paused)"
                    )
                    self.leases.pop(s.lease_id, None)
                else:
                    soonest = min(soonest, s.valid_until)
            self._dog_at = soonest
            dog_wake.clear()
            try:
                await asyncio.wait_for(
                    dog_wake.wait(), None if soonest == float("inf") else soonest - now
                )
            except asyncio.TimeoutError:
                pass

    def untrack(self, lease_id: str) -> None:
        self.leases.pop(lease_id, None)

    def add_waiter(self, w: Waiter) -> None:
        first = not self.waiters
        self.waiters[w.ticket] = w
        now = self.clock()
        if not w.refreshed:
            w.refreshed = now
        g = self._unclaimed.pop(w.ticket, None)
        if g is not None and g.lease_id == w.argv[1] and not w.future.done():
            w.future.set_result(g)  # only a grant made with this request's own lease id
        # The first waiter's refresh is due in poll_interval; a later one must not postpone the
        # refresh already due (waiters queueing faster than poll_interval would starve it).
        self.next_poll = (
            now + self.poll_interval if first else min(self.next_poll, now + self.poll_interval)
        )
        self._ensure_ticker()
        self._poke()

    def remove_waiter(self, ticket: str) -> None:
        self.waiters.pop(ticket, None)
        if not self.waiters:
            self.reap_at = None

    def join_waiter(self, w: Waiter) -> Waiter:
        """Register ``w``, or join the waiter this process already has for the same ticket
        (one request id used by two acquires at once: one place, one grant, seen by both)."""
        cur = self.waiters.get(w.ticket)
        if cur is not None and not cur.future.done():
            cur.users += 1
            return cur
        self.add_waiter(w)
        return w

    def leave_waiter(self, w: Waiter) -> None:
        w.users -= 1
        if w.users <= 0 and self.waiters.get(w.ticket) is w:
            self.remove_waiter(w.ticket)

    def queue_waiter(
        self,
        ticket: str,
        argv: list[str],
        waiter_ttl_ms: int,
        position: int,
        on_position: Callable[[int], Any] | None,
        retry_after_ms: int,
    ) -> Waiter:
        """In the runtime's loop: queue a waiter for an acquire the server queued (``argv``: its
        ARGV, to queue it again; its future belongs to this loop), or join the one this process
        has for ``ticket`` (:meth:`join_waiter`); schedule the reap timer at the nearest lease
        expiry (``retry_after_ms``, -1: none). Returns the waiter to wait on and to leave."""
        w = Waiter(
            ticket,
            asyncio.get_running_loop().create_future(),
            argv,
            waiter_ttl_ms,
            position,
            on_position,
        )
        joined = self.join_waiter(w)
        self.set_reap_timer(self.clock(), retry_after_ms)
        return joined

    def leave(self, w: Waiter) -> bool:
        """Leave waiter ``w`` (:meth:`leave_waiter`); True when its ticket is still in use
        locally (:meth:`ticket_in_use`: then the request must not be withdrawn on the server)."""
        self.leave_waiter(w)
        return self.ticket_in_use(w.ticket)

    def ticket_in_use(self, ticket: str) -> bool:
        """Whether another local acquire still waits on ``ticket`` or a live local lease came
        from it: then a give-up must not withdraw the request on the server."""
        return ticket in self.waiters or any(
            s.ticket == ticket and not s.released and s.lost_reason is None
            for s in list(self.leases.values())
        )

    def state_for(
        self, grant: Grant, ttl_s: float, valid_until: float, meta: str = ""
    ) -> tuple[LeaseState, bool]:
        """The local state of a granted lease: the existing one when this process already
        holds that lease (the same request id acquired again returns the same grant), so that
        both lease objects share one validity clock and one release. Returns (state, new)."""
        with self._states_lock:
            s = self._states.get(grant.lease_id)
            if (
                s is not None
                and s.token == grant.token
                and not s.released
                and s.lost_reason is None
            ):
                return s, False
            s = LeaseState(self.pool, grant, ttl_s, valid_until, self.clock)
            s.meta = meta
            if not s.epoch:
                s.epoch = self.known_epoch
            self._states[grant.lease_id] = s
            return s, True

    def spawn(self, coro) -> asyncio.Task:
        """Run a coroutine that must finish even if its caller is cancelled."""
        t = asyncio.get_running_loop().create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)
        return t

    async def close(self) -> None:
        """Stop the background tasks; every acquire still waiting ends with PoolClosed (its
        shell then withdraws the request from the queue)."""
        self._closed = True
        for w in list(self.waiters.values()):
            if w.future is not None and not w.future.done():
                w.future.set_exception(PoolClosed(self.pool))
        for t in (self._ticker, self._listener, self._watchdog):
            if t is not None:
                t.cancel()
        for t in (self._ticker, self._listener, self._watchdog):
            if t is not None:
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass
        if self._background:
            # Withdrawals and releases in flight get a moment to finish; against a Redis that
            # does not answer they are dropped (what they were for expires on its own).
            pending = set(self._background)
            _, left = await asyncio.wait(pending, timeout=2.0)
            for t in left:
                t.cancel()
            if left:
                await asyncio.gather(*left, return_exceptions=True)

    # ---- grants --------------------------------------------------------------------------
    def _deliver(self, grant: Grant) -> None:
        w = self.waiters.get(grant.ticket)
        if w is not None:
            if not w.future.done():
                w.future.set_result(grant)
            return
        # No waiter yet: the grant may have overtaken the reply that queued the ticket (the
        # pub/sub connection was read first, or the sync shell has not registered its waiter
        # yet). Keep it briefly so add_waiter can claim it instead of waiting for a poll.
        self._unclaimed[grant.ticket] = grant
        while len(self._unclaimed) > 1024:
            self._unclaimed.popitem(last=False)

    async def _listen(self) -> None:
        channel = f"{self.keys[7]}:{self.channel_id}"
        subscribed = self._subscribed
        assert subscribed is not None  # made by ensure_subscribed before it starts this task
        attempt = 0
        while not self._closed:
            ps = self.redis.pubsub(ignore_subscribe_messages=False)
            try:
                await ps.subscribe(channel)
                while not self._closed:
                    msg = await ps.get_message(timeout=1.0)
                    if msg is None:
                        continue
                    if msg["type"] == "subscribe":
                        subscribed.set()
                        self._sub_error = None
                        self._sub_news.set()
                        attempt = 0
                        self._sub_log.ok()
                    elif msg["type"] == "message":
                        for g in decode_events(msg["data"]):
                            self._deliver(g)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # connection trouble: the ticker's polling covers us
                subscribed.clear()
                self._sub_error = e  # for ensure_subscribed: stop waiting, and why
                self._sub_news.set()
                self._sub_log.failed(e)
                attempt += 1
                await asyncio.sleep(retry_delay(attempt))
            finally:
                try:
                    await ps.aclose()
                except Exception:
                    pass

    # ---- ticker ----------------------------------------------------------------------------
    def _next_wake(self, now: float) -> float:
        t = now + 60.0
        for s in self.leases.values():
            t = min(t, s.next_renew, s.valid_until)
        if self.waiters:
            t = min(t, self.next_poll)
            if self.reap_at is not None:
                t = min(t, self.reap_at)
        if self._restart_suspected:
            t = min(t, now)
        t = max(t, self._retry_at)  # after a failure, not before the retry (deadlines: watchdog)
        if self._tick_log.failing:  # ... but a waiter's bound is checked when it passes
            for w in self.waiters.values():
                if w.future is not None and not w.future.done():
                    t = min(t, w.refreshed + self.waiter_bound(w) + 0.001)
        return t

    async def _tick_loop(self) -> None:
        wake = self._wake
        assert wake is not None  # made by _ensure_ticker before it starts this task
        attempt = 0
        while not self._closed:
            now = self.clock()
            self._ticker_at = self._next_wake(now)
            delay = self._ticker_at - now
            if delay > 0:
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), delay)
                except asyncio.TimeoutError:
                    pass
            if not self.leases and not self.waiters and not self._restart_suspected:
                if self._closed:
                    return
                continue
            now = self.clock()
            for s in list(self.leases.values()):
                if now >= s.valid_until:
                    if (
                        s.mark_lost(
                            "no successful renewal before the local validity deadline "
                            "(Redis unreachable or too slow)"
                        )
                        or s.lost_reason
                    ):
                        self.leases.pop(s.lease_id, None)
            self._fail_stranded_waiters(now)
            if now < self._retry_at:
                await asyncio.sleep(0)  # never spin without yielding
                continue  # woken early (a new lease, a poke) while backing off: not yet
            suspected = self._restart_suspected
            try:
                did = False
                if self.waiters and self.reap_at is not None and now >= self.reap_at:
                    self.reap_at = None
                    did = True
                    await self._reap()
                due = any(s.next_renew <= now for s in self.leases.values())
                if due or suspected or (self.waiters and now >= self.next_poll):
                    self._restart_suspected = False
                    did = True
                    await self._heartbeat()
                if did:
                    attempt = 0
                    self._tick_log.ok()
                else:
                    await asyncio.sleep(0)  # nothing was due: never spin without yielding
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # Every failure is retried on the one schedule (retry_delay); the leases'
                # local deadlines and the waiters' bound (_fail_stranded_waiters) end it.
                self._restart_suspected = self._restart_suspected or suspected
                self._tick_log.failed(e, exc_info=not isinstance(e, RETRYABLE))
                self._enter_jeopardy(e)
                if isinstance(e, RETRYABLE):
                    await self._drop_idle_connections()
                attempt += 1
                retry = self._retry_at = self.clock() + retry_delay(attempt)
                for s in self.leases.values():
                    s.next_renew = min(max(s.next_renew, retry), s.valid_until)
                self.next_poll = max(self.next_poll, retry)

    async def _drop_idle_connections(self) -> None:
        """After a connection error, close the client's idle pooled connections: if Redis
        restarted they are all dead, and each would fail one later call ("Connection closed by
        server"); new ones are opened on demand."""
        try:
            await self.redis.connection_pool.disconnect(inuse_connections=False)
        except Exception:  # noqa: BLE001 - best effort; a dead connection fails once and is dropped
            pass

    def waiter_bound(self, w: Waiter) -> float:
        """Seconds a queued waiter may go without a call that keeps its place before it fails
        with BackendUnavailable: its waiter_ttl (the server keeps the place that long without a
        refresh) plus backend_timeout (the retries a new acquire would get to queue again)."""
        return w.waiter_ttl_ms / 1000.0 + self.backend_timeout

    def _fail_stranded_waiters(self, now: float) -> None:
        """End the waits of waiters whose place could not be kept or taken again within
        :meth:`waiter_bound` while Redis is unreachable (the ticker's last try failed):
        BackendUnavailable. While Redis answers, a waiter is never ended here."""
        if not self._tick_log.failing:
            return
        for w in list(self.waiters.values()):
            if w.future is None or w.future.done():
                continue
            if now - w.refreshed > self.waiter_bound(w):
                w.future.set_exception(
                    BackendUnavailable(
                        f"pool {self.pool!r}: Redis unreachable for {now - w.refreshed:.1f}s while this request "
                        f"was queued: its place could not be kept or taken again (bound: waiter_ttl "
                        f"{w.waiter_ttl_ms / 1000:g}s + backend_timeout {self.backend_timeout:g}s)"
                    )
                )

    def _enter_jeopardy(self, err: BaseException) -> None:
        """A renewal failed: the leases are in jeopardy (Chubby's term). Each is lost at its
        own local deadline unless a renewal gets through first; say so once."""
        live = [s for s in self.leases.values() if not s.released and s.lost_reason is None]
        if self._jeopardy or not live:
            return
        self._jeopardy = True
        first = min(s.valid_until for s in live) - self.clock()
        log.warning(
            "gpulock: pool %s: %d lease(s) in jeopardy: renewal failed (%s); each is lost at "
            "its local deadline (the first in %.2fs) unless a renewal gets through before",
            self.pool,
            len(live),
            err,
            max(0.0, first),
        )

    async def cancel_quietly(self, ticket: str) -> None:
        """Withdraw a request (leave the queue, give back a grant that raced in), retried on
        the common policy for backend_timeout; if Redis stays away the waiter expires after its
        waiter_ttl and a grant after its ttl."""
        try:
            await self._eval("cancel", [ticket], bound=self.backend_timeout)
        except Exception:  # noqa: BLE001 - best effort; expiry is the backstop
            pass

    async def _eval_once(self, name: str, args: list) -> Any:
        from redis.exceptions import NoScriptError

        sc = scripts()[name]
        try:
            try:
                return await self.redis.evalsha(sc.sha, len(self.keys), *self.keys, *args)
            except NoScriptError:
                await self.redis.script_load(sc.source)
                return await self.redis.evalsha(sc.sha, len(self.keys), *self.keys, *args)
        except AuthenticationError as e:  # a ConnectionError to redis-py; retrying cannot help
            raise translate(e, self.pool) from e

    async def _eval(self, name: str, args: list, *, bound: float = 0.0) -> Any:
        """EVALSHA with NOSCRIPT reload. ``bound`` > 0: retry connection errors on the common
        policy (:func:`gpulock._protocol.retrying`, the foreground's) for that many seconds; 0:
        one try (the ticker's own calls: the loop retries them on the same schedule)."""
        if bound <= 0:
            return await self._eval_once(name, args)
        async for attempt in retrying(bound, asynchronous=True):
            with attempt:
                return await self._eval_once(name, args)
        raise AssertionError("unreachable")

    async def renew_synced(self, args: list) -> tuple[Any, int]:
        """Run ``renew`` of ``args`` and then, on the same connection, an INCR of the pool's
        sync counter and ``WAIT sync_replicas sync_timeout_ms``
        (:func:`gpulock._flow.queue_synced_renew`): returns (renew reply, replicas that
        acknowledged everything this connection wrote, the renewal included)."""
        for attempt in range(2):
            async with self.redis.pipeline(transaction=False) as p:
                queue_synced_renew(
                    p, self.keys, args, self.sync_replicas, self.sync_timeout_ms, self.sync_key
                )
                out = synced_renew_reply(await p.execute(raise_on_error=False), attempt == 0)
            if out is not None:
                return out
            await self.redis.script_load(scripts()["renew"].source)
        raise AssertionError("unreachable")

    async def _reap(self) -> None:
        r = await self._eval("reap", [])
        received = self.clock()
        if self.waiters:
            self.set_reap_timer(received, int(r[3]))

    async def _heartbeat(self) -> None:
        leases = [s for s in self.leases.values() if not s.released and s.lost_reason is None]
        waiters = list(self.waiters.values())
        args: list[Any] = [len(leases)]
        for s in leases:
            args += [s.lease_id, s.token, ttl_ms(s.ttl_s)]
        args.append(len(waiters))
        for w in waiters:
            args += [w.ticket, w.waiter_ttl_ms]
        sent = self.clock()
        self.next_poll = sent + self.poll_interval
        acked = None
        if self.sync_replicas and leases:
            r, acked = await self.renew_synced(args)
        else:
            r = await self._eval("renew", args)
        now_ms, epoch = int(r[0]), int(r[1])
        self.observe(sent, now_ms)
        # The pool is gone (epoch 0) or was made again (another epoch): Redis lost its data.
        pool_lost = epoch == 0 or (self.known_epoch != 0 and epoch != self.known_epoch)
        orphans = []
        for s, exp in zip(leases, r[2]):
            exp = int(exp)
            if s.released:
                continue
            if exp > 0:
                if acked is None or acked >= self.sync_replicas:
                    s.renewed(sent, now_ms, exp)
                # else: not on enough replicas yet; the validity stays where the last
                # acknowledged renewal put it (the ticker tries again at once; WAIT paces it).
            elif pool_lost:
                orphans.append(s)
            else:
                s.mark_lost("the server no longer has it (expired and reaped)")
                self.leases.pop(s.lease_id, None)
        if acked is not None and acked < self.sync_replicas:
            self._enter_jeopardy(
                RuntimeError(
                    f"renewal acknowledged by {acked} of {self.sync_replicas} "
                    f"replica(s) within {self.sync_timeout_ms} ms"
                )
            )
        elif self._jeopardy:
            self._jeopardy = False
            held = sum(1 for s in leases if not s.released and s.lost_reason is None)
            if held:
                log.warning(
                    "gpulock: pool %s: renewals get through again; the %d lease(s) still held are "
                    "out of jeopardy",
                    self.pool,
                    held,
                )
            else:
                log.warning(
                    "gpulock: pool %s: Redis answers renewals again; no lease was still held (those "
                    "in jeopardy were lost at their local deadlines)",
                    self.pool,
                )
        if pool_lost and (orphans or waiters):
            epoch = await self._recover(orphans, epoch)
        elif epoch:
            self.known_epoch = epoch
        forgotten = []
        for w, res in zip(waiters, r[3]):
            kind = res[0].decode() if isinstance(res[0], bytes) else res[0]
            # Redis answered for this waiter: its bound (see waiter_bound) counts from here,
            # also when the answer is that the queue forgot it and it is queued again below
            # (a crowd of waiters re-queued one by one after a restart must not fail because
            # one later heartbeat failed while they had not yet had their turn).
            w.refreshed = sent
            if kind == "g":
                lid = res[1].decode() if isinstance(res[1], bytes) else res[1]
                self._deliver(
                    Grant(w.ticket, lid, int(res[2]), int(res[3]), int(res[4]), now_ms, epoch)
                )
            elif kind == "q":
                pos = int(res[1])
                if pos != w.position:
                    w.position = pos
                    if w.on_position:
                        try:
                            w.on_position(pos)
                        except Exception:
                            log.exception("gpulock: on_queued callback raised")
            elif w.ticket in self.waiters and w.future is not None and not w.future.done():
                forgotten.append(w)
        if forgotten:
            # The queue forgot them (Redis lost the pool, or refreshes were missed for
            # waiter_ttl, e.g. a pause): enqueue again with the same tickets (idempotent), one
            # after the other in their old order, so FIFO among them holds.
            forgotten.sort(key=lambda w: w.position)
            for w in forgotten:
                self._requeue.setdefault(w.ticket, w)
            if self._requeuer is None or self._requeuer.done():
                self._requeuer = self.spawn(self._requeue_all())

    async def _recover(self, orphans: list[LeaseState], epoch: int) -> int:
        """Redis lost the pool (a restart without its data, or the keys were deleted) while
        this process holds ``orphans`` or waits. Create the pool again if it is gone — as it was
        last seen, with a grace period, since we know it existed — then put our leases back
        with their old ids, amounts and tokens (``reassert.lua``); only then adopt the new
        epoch. A lease that cannot be put back is lost. The calls retry on the common policy
        until the first orphan's local deadline (at most backend_timeout); if they fail, the
        next heartbeat finds the loss again. Returns the pool's new epoch (0: not created)."""
        live_until = [s.valid_until for s in orphans if not s.released and s.lost_reason is None]
        bound = max(0.5, min([self.backend_timeout] + [t - self.clock() for t in live_until]))
        if epoch == 0:
            if not (self.capacity_seen or self.capacity):
                for s in orphans:
                    s.mark_lost(
                        "the pool's configuration is gone (Redis restarted without its data?) "
                        "and this pool object does not know its capacity to create it again"
                    )
                    self.leases.pop(s.lease_id, None)
                return 0
            argv = self.configure_argv(
                self.capacity or 0, self.max_waiters, self.max_ttl_ms, True, True
            )
            r = await self._eval("configure", argv, bound=bound)
            epoch = int(r[2])
            if int(r[0]):
                log.warning(
                    "gpulock: pool %s was gone from Redis (restarted without its data?): created it "
                    "again (capacity %d bytes) with a grace period of %.1fs for holders to put "
                    "their leases back; nothing new is granted until it ends",
                    self.pool,
                    int(r[1]),
                    int(r[6]) / 1000 if len(r) > 6 else 0.0,
                )
        live = [s for s in orphans if not s.released and s.lost_reason is None]
        if live:
            args: list[Any] = [len(live)]
            for s in live:
                args += [s.lease_id, s.token, s.amount, ttl_ms(s.ttl_s), s.ticket, s.meta]
            sent = self.clock()
            r = await self._eval("reassert", args, bound=bound)
            now_ms = int(r[0])
            self.observe(sent, now_ms)
            for s, res in zip(live, r[3]):
                res = int(res)
                if s.released or s.lost_reason is not None:
                    continue
                if res > 0:
                    s.renewed(sent, now_ms, res)
                    s.epoch = epoch
                    log.warning(
                        "gpulock: lease %s… on pool %s (token %d, %d bytes) put back after Redis lost "
                        "the pool",
                        s.lease_id[:8],
                        self.pool,
                        s.token,
                        s.amount,
                    )
                else:
                    s.mark_lost(
                        REASSERT_REFUSED.get(
                            res, f"Redis lost the pool and refused to take the lease back ({res})"
                        )
                    )
                    self.leases.pop(s.lease_id, None)
        self.known_epoch = epoch  # recovered: this is the pool now
        return epoch

    async def _requeue_all(self) -> None:
        """Queue again, one at a time in their old order, the waiters whose place Redis forgot."""
        while self._requeue and not self._closed:
            _, w = self._requeue.popitem(last=False)
            if self.waiters.get(w.ticket) is w and w.future is not None and not w.future.done():
                await self._requeue_one(w)

    async def _requeue_one(self, w: Waiter) -> None:
        """Enqueue ``w`` again with its ticket (idempotent), retrying on the common policy
        within the waiter's bound. The waiter fails only when Redis stays unreachable past
        :meth:`waiter_bound`, or when the server refuses the request (say the capacity shrank
        below it); a pool found gone again is left to the heartbeat, which recovers it and
        queues the waiter again."""
        from redis.exceptions import ResponseError

        from ._protocol import decode_acquire

        left = self.waiter_bound(w) - (self.clock() - w.refreshed)
        try:
            sent = self.clock()
            r = await self._eval("acquire", w.argv, bound=max(1.0, left))
        except ResponseError as e:
            if str(e).startswith("GPULOCK_NOPOOL"):
                self.suspect_restart()  # the heartbeat makes the pool again and re-queues us
                return
            if not w.future.done():
                w.future.set_exception(e)
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # Redis unreachable past the bound (retries exhausted), or refused
            if not w.future.done() and (
                not isinstance(e, RETRYABLE) or self.clock() - w.refreshed > self.waiter_bound(w)
            ):
                w.future.set_exception(e)
            return
        res = decode_acquire(w.ticket, r)
        w.refreshed = sent
        self.observe(sent, res.now_ms)
        self.seen(res.epoch, res.capacity)
        if self.waiters.get(w.ticket) is not w and not self.ticket_in_use(w.ticket):
            # Given up while this re-enqueue was in flight (its cancel may have run first):
            # withdraw again, or the place (and later a grant) would be orphaned.
            await self.cancel_quietly(w.ticket)
            return
        if isinstance(res, Grant):
            self._deliver(res)
        else:
            w.position = res.position
            self.set_reap_timer(self.clock(), res.retry_after_ms)
