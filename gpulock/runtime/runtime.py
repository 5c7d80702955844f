"""The per-pool background runtime: one per pool object, living in one event loop.

:class:`Runtime` composes the parts and is the interface the drivers (``_async.py``,
``_sync.py``) use; the flows see it through :class:`gpulock.protocol.steps.RuntimeView`, which it
implements:

* the **listener** (:mod:`gpulock.runtime.listener`): the asyncio shell's pub/sub subscription to the
  pool object's channel (:attr:`Runtime.channel`); the grants the server publishes go straight
  to their waiters. The sync shell's waiting threads read the same channel themselves
  (:mod:`gpulock.runtime.sync_listener`) and hand what they read to :meth:`Runtime.deliver`.
* the **heartbeat** (:mod:`gpulock.runtime.heartbeat`): the ticker's batched ``renew`` call (leases
  at ttl/3, waiters each ``poll_interval``, grants whose message was missed), the reap timer,
  and the watchdog that fires on_lost at each lease's local validity deadline.
* the **waiters** (:mod:`gpulock.runtime.waiters`): the queued acquires of this pool object and the
  delivery of grants to them (safe from any thread: the sync shell queues, leaves and
  delivers on its callers' threads, waking the loop only when the ticker must run sooner).
* the **recovery** (:mod:`gpulock.runtime.recovery`): the epoch this object knows, and after Redis
  lost the pool its creation again as last seen, the leases put back, the waiters re-queued.

What the parts share (the held leases, the clock anchor, the calls, the settings, the loop's
tasks, the waiters) is one frozen value made here, :class:`gpulock.runtime.shared.Shared`;
code that needs a part reaches it as an attribute (``rt.heartbeat``, ``rt.recovery``, ...).

Creating a lease starts no thread and no task; the tasks start with the first lease or waiter.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Callable

from gpulock_common.aio import stop_tasks
from gpulock_common.lease import stop_renewal

from gpulock.runtime.calls import Calls, Settings
from gpulock.runtime.heartbeat import Heartbeat
from gpulock.runtime.kept import KeptBack
from gpulock.runtime.listener import Listener
from gpulock.protocol.keep import KeptLeases
from gpulock.protocol.request import DEFAULT_POLL_INTERVAL_S, Grant, LeaseState
from gpulock.protocol.replies import QueueConfig, YieldAsk
from gpulock.runtime.recovery import Recovery
from gpulock.runtime.shared import ClockAnchor, HeldLeases, Shared
from gpulock.runtime.tasks import LoopTasks
from gpulock.runtime.waiters import Waiter, WaiterFuture, WaiterRegistry
from gpulock.errors import PoolClosed

if TYPE_CHECKING:
    from gpulock.protocol.steps import Join

__all__ = ["Runtime", "Waiter"]

log = logging.getLogger("gpulock")


class Runtime:
    """The background work of pool ``pool`` on ``redis`` (a redis.asyncio client) with its
    ``keys``, on the local ``clock`` (s); waiters are refreshed every ``poll_interval`` s;
    ``loop``: the loop the work runs in when known up front (the sync shell's thread).

    Its parts: :attr:`heartbeat`, :attr:`recovery`, :attr:`listener`, :attr:`registry` (the
    waiters), :attr:`leases` (the held leases), :attr:`calls`, :attr:`tasks`, :attr:`settings`."""

    def __init__(
        self,
        redis: Any,
        pool: str,
        keys: Sequence[str],
        clock: Callable[[], float],
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        loop: asyncio.AbstractEventLoop | None = None,
    ):
        self.redis = redis  # a redis.asyncio client
        self.pool = pool
        self.clock = clock
        self._closed = False
        # This pool object's pub/sub channel for hand-offs: "<events key>:<channel_id>".
        self.channel_id = secrets.token_hex(8)
        self.channel = f"{keys[7]}:{self.channel_id}"
        self.settings = Settings()
        self.tasks = LoopTasks(pool, loop)
        self.calls = Calls(redis, pool, keys, self.settings)
        self.leases = HeldLeases(pool, clock)
        self.registry = WaiterRegistry(pool, clock, self.settings, self.leases)
        self.waiters: dict[str, Waiter] = self.registry.waiters
        self.anchor = ClockAnchor(clock)
        # the pool object turns keeping on (protocol/keep.py)
        self.kept = KeptLeases(0.0, clock, hold=self.leases.add)
        shared = Shared(
            pool,
            clock,
            self.calls,
            self.settings,
            self.tasks,
            self.leases,
            self.registry,
            self.anchor,
            is_closed=lambda: self._closed,
            channel_id=self.channel_id,
            kept=self.kept,
        )
        self.kept_back = KeptBack(shared)
        self.listener = Listener(
            redis,
            self.channel,
            shared,
            resubscribed=self.poll_waiters_now,
            wanted_back=self.kept_back.wanted_back,
        )
        self._subscribed: Callable[[], bool] = lambda: self.listener.subscribed
        self.recovery = Recovery(
            shared,
            suspect_restart=lambda: self.heartbeat.suspect_restart(),
            set_reap_timer=lambda at, ms: self.heartbeat.set_reap_timer(at, ms),
        )
        self.heartbeat = Heartbeat(shared, self.recovery, poll_interval, self.kept_back)

    # ---- the pool object's side ------------------------------------------------------------
    def unreachable(self) -> tuple[float, BaseException] | None:
        """``(seconds, last error)`` while the background calls keep failing, else None
        (:meth:`gpulock.runtime.heartbeat.Heartbeat.unreachable`)."""
        return self.heartbeat.unreachable()

    def poll_waiters_now(self) -> None:
        """The hand-off subscription is back after it was lost (a connection failure, a
        failover, a slot moved): a grant published meanwhile was missed, so the waiters are
        polled now rather than at the next ``poll_interval``. Safe from any thread."""
        if self._closed or not self.waiters:
            return
        try:
            self.tasks.in_loop(self.heartbeat.poll_now)
        except RuntimeError:  # no loop yet, or it is closed: nothing to poll for
            pass

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (no heartbeat or listener serves a lease after)."""
        return self._closed

    @property
    def subscribed(self) -> bool:
        """Whether the hand-off subscription is confirmed now, so that an acquire may queue
        without looking at it first: the listener's (see :meth:`ensure_subscribed`), or what
        the sync shell said it reads instead (:meth:`read_elsewhere`)."""
        return self._subscribed()

    @property
    def listening(self) -> bool:
        """Whether :attr:`listener`, which hands asks to yield to the leases held, is subscribed
        and confirmed now."""
        return self.listener.subscribed

    def read_elsewhere(self, ready: Callable[[], bool]) -> None:
        """The pool object's channel is read by someone else (the sync shell's waiting
        threads: :mod:`gpulock.runtime.sync_listener`), not by :attr:`listener`; ``ready()`` says
        whether that subscription needs no look before an acquire queues. :attr:`listener`
        then hands on only the yield requests (preemption) it reads while leases are held."""
        self._subscribed = ready
        self.listener.grants_elsewhere = True

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
        st = self.settings
        st.capacity, st.max_waiters, st.max_ttl_ms = capacity, max_waiters, max_ttl_ms
        st.sync_replicas, st.sync_timeout_ms = sync_replicas, sync_timeout_ms
        st.backend_timeout = backend_timeout

    # ---- clock and epoch (the protocol's RuntimeView) --------------------------------------
    def observe(self, sent: float, now_ms: int) -> None:
        """Record a (local send time, server time) pair from a completed call."""
        self.anchor.observe(sent, now_ms)

    def deadline_for(self, grant: Grant) -> float:
        """The local validity deadline of a grant that came by its waiter
        (:meth:`gpulock.runtime.shared.ClockAnchor.deadline_for`)."""
        return self.anchor.deadline_for(grant)

    def seen(
        self,
        epoch: int,
        capacity: int = 0,
        max_waiters: int = 0,
        max_ttl_ms: int = 0,
        policy: QueueConfig | None = None,
    ) -> None:
        """Take in what a reply showed of the pool (:meth:`gpulock.runtime.recovery.Recovery.seen`).
        Safe from any thread."""
        self.recovery.seen(epoch, capacity, max_waiters, max_ttl_ms, policy)

    def remake_capacity(self) -> int | None:
        """The capacity (bytes) a pool this object saw is made again with after Redis lost it;
        None when it never saw the pool (:meth:`gpulock.runtime.recovery.Recovery.remake_capacity`).
        Safe from any thread."""
        return self.recovery.remake_capacity()

    def note_grace(self, sent: float, left_ms: int) -> None:
        """A reply to a call sent at ``sent`` showed ``left_ms`` ms of grace period left
        (:meth:`gpulock.runtime.recovery.Recovery.note_grace`). Safe from any thread."""
        self.recovery.note_grace(sent, left_ms)

    def grace_left(self) -> float:
        """Seconds left in the pool's grace period as last seen; 0 outside one. No I/O."""
        return self.recovery.grace_left()

    def configure_argv(
        self,
        capacity: int,
        max_waiters: int,
        max_ttl_ms: int,
        create_only: bool,
        grace: bool = False,
        policy: QueueConfig | None = None,
    ) -> list[str]:
        """ARGV of ``configure.lua`` (:meth:`gpulock.runtime.recovery.Recovery.configure_argv`);
        ``policy``: a queue policy, backfill window in ms and quotas (each None: unchanged)."""
        return self.recovery.configure_argv(
            capacity, max_waiters, max_ttl_ms, create_only, grace, policy
        )

    # ---- leases --------------------------------------------------------------------------
    async def ensure_subscribed(self) -> None:
        """Subscribe (once) and wait until Redis confirmed it, so that no grant published
        after our next enqueue can be missed (:meth:`Listener.ensure_subscribed`)."""
        await self.listener.ensure_subscribed()

    def deliver(self, grants: Sequence[Grant]) -> None:
        """Hand grants read from the pool object's channel to their waiters. Safe from any
        thread: the sync shell's reading thread calls it."""
        for g in grants:
            self.registry.deliver(g)

    def track(self, state: LeaseState) -> None:
        """Start heartbeating a lease. Safe from any thread (the sync shell calls it on the
        caller's thread): a dict insert, plus a wake-up of the loop only when the ticker or the
        watchdog must run sooner than planned (a first lease, or a shorter ttl)."""
        self.leases.add(state)
        self.heartbeat.lease_added(state)
        if state.keeper is not None or (state.preemptible and not state.resident):
            # an ask to yield, or a request for kept bytes back, comes on the channel: listen
            # while the lease is held (an acquire that waited subscribed already; a try or a
            # sync shell's did not)
            self.listener.listen_soon()

    async def subscribe_quietly(self) -> None:
        """:meth:`gpulock.runtime.listener.Listener.subscribe_quietly` (a :data:`LISTEN`)."""
        await self.listener.subscribe_quietly()

    def yielded(self, asks: Sequence[YieldAsk]) -> None:
        """Hand yield requests read from the pool object's channel to the leases held
        (:meth:`gpulock.runtime.shared.HeldLeases.ask`). Safe from any thread: the sync shell's
        reading thread calls it."""
        self.leases.ask(asks)

    def untrack(self, lease_id: str) -> None:
        """Stop heartbeating a lease (a dict pop: safe from any thread)."""
        self.leases.drop(lease_id)

    def state_for(
        self,
        grant: Grant,
        ttl_s: float,
        valid_until: float,
        meta: str = "",
        tenant: str = "",
        resident: bool = False,
    ) -> tuple[LeaseState, bool]:
        """The local state of a granted lease (:meth:`gpulock.runtime.shared.HeldLeases.state_for`,
        in the epoch this object knows); the caller then calls :meth:`track` for a new one."""
        epoch = self.recovery.known_epoch
        return self.leases.state_for(grant, ttl_s, valid_until, epoch, meta, tenant, resident)

    # ---- waiters -------------------------------------------------------------------------
    def _add_waiter(self, w: Waiter) -> None:
        """Register ``w`` and schedule its refresh. Safe from any thread."""
        now = self.clock()
        first = self.registry.add(w, now)
        self.heartbeat.waiter_added(now, first)

    def _new_waiter(
        self, ticket: str, argv: list[str], waiter_ttl_ms: int, position: int, **kw: Any
    ) -> Waiter:
        loop = self.tasks.loop  # the sync shell's: known up front
        if loop is None:
            loop = asyncio.get_running_loop()
        return Waiter(ticket, WaiterFuture(loop=loop), argv, waiter_ttl_ms, position, **kw)

    def remove_waiter(self, ticket: str) -> None:
        """Forget the waiter of ``ticket``; the last one gone stops the reap timer. Safe from
        any thread."""
        if self.registry.remove(ticket):
            self.heartbeat.reap_at = None

    def leave_waiter(self, w: Waiter, grant: Grant | None = None) -> None:
        """One acquire sharing ``w`` stops waiting; the last one removes it. ``grant``: the
        grant of ``w`` as that acquire read it itself (the sync shell's reading thread), handed
        first to the others still sharing ``w``. Safe from any thread."""
        with self.registry.lock:
            if grant is not None and w.users > 1:
                self.registry.deliver(grant)
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
        deadline: float | None = None,
        script: str = "acquire",
        *,
        claim: Join | None = None,
    ) -> Waiter:
        """Queue a waiter for an acquire the server queued (``argv``: its ARGV, to queue it
        again), or join the one this process has for ``ticket`` (one request id used by two
        acquires at once: one place, one grant, seen by both); schedule the reap timer at the
        nearest lease expiry (``retry_after_ms``, -1: none). Returns the waiter to wait on and
        to leave; its future belongs to the runtime's loop. Safe from any thread (the sync
        shell calls it on the caller's); in a runtime already closed, the wait of a new waiter
        has ended with PoolClosed. ``deadline``: local time the acquire gives up (None:
        never), which keeps its place through an outage that long. ``script``: the script
        that queued it (``argv`` is its ARGV): "acquire", or "resize" for a lease's growth.
        ``claim``: the acquire's :class:`~gpulock.protocol.steps.Join`, whose ``waiter`` is
        set to the waiter it registered on, so that the acquire can leave it when an interrupt
        lands between here and the flow (:meth:`~gpulock.protocol.steps.Join.undo`)."""
        w = self._new_waiter(
            ticket,
            argv,
            waiter_ttl_ms,
            position,
            on_position=on_position,
            deadline=deadline,
            script=script,
        )
        with self.registry.lock:
            cur = self.waiters.get(ticket)
            # ``claim`` is set with no call between it and the registration, where an
            # interrupt could land (CPython runs a signal handler at calls and loop jumps only): after
            # a join (leaving a join that did not happen would take another acquire's place),
            # before an add (leaving a waiter never added does nothing).
            if cur is not None and not cur.future.done():
                cur.users += 1
                if claim is not None:
                    claim.waiter = cur
                if cur.deadline is not None:  # the latest deadline of those sharing it
                    cur.deadline = None if deadline is None else max(cur.deadline, deadline)
                w = cur
            else:
                if claim is not None:
                    claim.waiter = w
                self._add_waiter(w)
        if self._closed:
            self.registry.fail(w, PoolClosed(self.pool))
        self.heartbeat.set_reap_timer(self.clock(), retry_after_ms)
        return w

    def leave(self, w: Waiter, grant: Grant | None = None) -> bool:
        """Leave waiter ``w`` (:meth:`leave_waiter`, with ``grant``); True when its ticket is
        still in use locally (:meth:`ticket_in_use`: then the request must not be withdrawn on
        the server)."""
        self.leave_waiter(w, grant)
        return self.ticket_in_use(w.ticket)

    def ticket_in_use(self, ticket: str) -> bool:
        """Whether another local acquire still waits on ``ticket`` or a live local lease came
        from it: then a give-up must not withdraw the request on the server."""
        return self.registry.ticket_in_use(ticket)

    # ---- places kept for remote holders (the protocol's PlaceKeeper) ------------------------
    def keep_place(
        self, ticket: str, argv: list[str], waiter_ttl_ms: int, position: int, retry_after_ms: int
    ) -> None:
        """Keep the place of a remote holder's request the server queued (``argv``: its ARGV,
        sent again by the refreshes) until its grant is taken (:meth:`forget_place`) or it is
        withdrawn: a waiter nobody in this process waits on yet, or the one kept, at its new
        ``position``; schedule the reap timer (``retry_after_ms``, -1: none). In a runtime
        already closed, its wait has ended with PoolClosed."""
        with self.registry.lock:
            w = self.waiters.get(ticket)
            if w is None or w.future.done():
                w = self._new_waiter(ticket, argv, waiter_ttl_ms, position)
                self._add_waiter(w)
            else:
                w.position = position
        if self._closed:
            self.registry.fail(w, PoolClosed(self.pool))
        self.heartbeat.set_reap_timer(self.clock(), retry_after_ms)

    def kept_place(self, ticket: str) -> Waiter | None:
        """The waiter kept for ``ticket`` (:meth:`keep_place`), None when none is kept."""
        return self.waiters.get(ticket)

    def forget_place(self, w: Waiter) -> None:
        """Stop keeping the place of ``w`` (its grant was taken, or its wait failed), unless
        another took its ticket's place meanwhile."""
        with self.registry.lock:
            if self.waiters.get(w.ticket) is w:
                self.remove_waiter(w.ticket)

    def hand_over(self, grant: Grant) -> None:
        """A remote holder's request was granted in the reply to its enqueue: the place kept
        for it (if any) is forgotten, and whoever waits on it gets ``grant``."""
        with self.registry.lock:
            w = self.waiters.get(grant.ticket)
            if w is not None:
                self.remove_waiter(grant.ticket)
                if not w.future.done():
                    w.future.set_result(grant)

    # ---- calls and lifecycle -------------------------------------------------------------
    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run a coroutine that must finish even if its caller is cancelled."""
        return self.tasks.spawn(coro)

    async def cancel_quietly(
        self, ticket: str, args: list[str] | None = None, script: str = "cancel"
    ) -> None:
        """Withdraw a request, best effort (:meth:`gpulock.runtime.calls.Calls.cancel_quietly`)."""
        await self.calls.cancel_quietly(ticket, args, script)

    async def renew_synced(self, args: list[Any], bound: float = 0.0) -> tuple[Any, int]:
        """``renew`` then ``WAIT`` on one connection (:meth:`gpulock.runtime.calls.Calls.renew_synced`,
        its connection errors retried for ``bound`` s): (renew reply, replicas that acked it)."""
        return await self.calls.renew_synced(args, bound)

    async def close(self) -> None:
        """Stop the background tasks; every acquire still waiting ends with PoolClosed (its
        shell then withdraws the request from the queue)."""
        self._closed = True
        stop_renewal(list(self.leases.values()), self.pool)
        self.registry.fail_all_closed()
        await stop_tasks(self.heartbeat.cancel() + self.listener.cancel())
        await self.tasks.drain(timeout=2.0)
