"""What a pool object knows of its pool's incarnation, and its recovery when Redis lost it.

The epoch seen first is adopted (:meth:`Recovery.seen`); a reply with another epoch, or none,
means Redis lost the pool (a restart without its data, or the keys were deleted): the
heartbeat then runs at once and calls :meth:`Recovery.recover`, which makes the pool again as
last seen, with a grace period (docs/SEMANTICS.md), puts the leases back with their old ids,
amounts and tokens (``reassert.lua``) and only then adopts the new epoch. Waiters the queue
forgot are queued again, one at a time in their old order (:meth:`Recovery.requeue`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any, Callable

from redis.exceptions import ResponseError

from gpulock.errors import AcquireTimeout
from gpulock.protocol.flow import configure_args
from gpulock.protocol.replies import QueueConfig, decode_configure, decode_reassert
from gpulock.protocol.request import (
    REASSERT_REFUSED,
    Grant,
    LeaseState,
    decode_acquire,
    decode_status,
    ttl_ms,
)
from gpulock.runtime.shared import Shared
from gpulock.transport.retry import RETRYABLE
from gpulock.runtime.waiters import Waiter

log = logging.getLogger("gpulock")


class Recovery:
    """The epoch knowledge and restart recovery of the pool of ``shared`` (a held lease that
    cannot be put back is lost and dropped). ``suspect_restart()`` makes the heartbeat run
    now; ``set_reap_timer(received, next_expiry_in_ms)`` schedules a reap (the heartbeat's)."""

    def __init__(
        self,
        shared: Shared,
        *,
        suspect_restart: Callable[[], None],
        set_reap_timer: Callable[[float, int], None],
    ):
        self.pool = shared.pool
        self.clock = shared.clock
        self._shared = shared
        self._calls = shared.calls
        self._settings = shared.settings
        self._leases = shared.leases
        self._registry = shared.waiters
        self._tasks = shared.tasks
        self._is_closed = shared.is_closed
        self._suspect_restart = suspect_restart
        self._set_reap_timer = set_reap_timer
        # The pool's epoch this object knows (0: never seen). Only the first reply and the
        # recovery after a loss set it (see seen()): a reply with another epoch, or none, makes
        # the heartbeat run at once and recover.
        self.known_epoch = 0
        # What the server last showed of the incarnation this object knows (known_epoch): a
        # pool made again after a loss gets these, not the pool object's own settings.
        self.capacity_seen = 0
        self.max_waiters_seen = 0
        self.max_ttl_seen_ms = 0
        self.policy_seen: QueueConfig | None = None
        self._settings_asked = False  # one background status read for max_ttl/max_waiters
        self._requeue: OrderedDict[str, Waiter] = OrderedDict()  # waiters whose place Redis forgot
        self._requeuer: asyncio.Task[None] | None = None
        # When the pool's grace period ends, on the local clock, as the last reply that told
        # showed it (0: not in one).
        self._grace_until = 0.0

    def note_grace(self, sent: float, left_ms: int) -> None:
        """A reply to a call sent at ``sent`` (local clock) showed ``left_ms`` ms left in the
        pool's grace period (0: none). Safe from any thread."""
        self._grace_until = sent + left_ms / 1000 if left_ms > 0 else 0.0

    def grace_left(self) -> float:
        """Seconds left in the pool's grace period as last seen (0: not in one, or never
        seen). No I/O."""
        return max(0.0, self._grace_until - self.clock())

    def seen(
        self,
        epoch: int,
        capacity: int = 0,
        max_waiters: int = 0,
        max_ttl_ms: int = 0,
        policy: QueueConfig | None = None,
    ) -> None:
        """Take in what a reply showed of the pool: its epoch (0: the pool is gone) and its
        capacity (bytes), max_waiters and max_ttl (ms; 0: not in the reply), and its queue
        policy, backfill window (ms) and quotas (None: not in the reply). Safe from any thread.

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
            self._suspect_restart()
            return
        if capacity:
            self.capacity_seen = capacity
        if max_waiters:
            self.max_waiters_seen = max_waiters
        if max_ttl_ms:
            self.max_ttl_seen_ms = max_ttl_ms
        if policy is not None:
            self.policy_seen = policy
        if adopted and not (self.max_ttl_seen_ms and self.max_waiters_seen):
            self._learn_settings_soon()
        elif capacity and _devices_sum(self.policy_seen) not in (None, capacity):
            # Someone changed the devices since they were read (a reply's capacity is no
            # longer their sum): read them again, so a pool made again has the new ones.
            self._settings_asked = False
            self._learn_settings_soon()

    def _learn_settings_soon(self) -> None:
        """The pool was first seen in a reply without its max_ttl and max_waiters (an
        acquire's): read them once, in the background, so that a pool made again after a loss
        has the operator's values and grace period, not this object's defaults. Safe from any
        thread."""
        if self._settings_asked or self._is_closed():
            return
        self._settings_asked = True
        try:
            self._tasks.in_loop(lambda: self._tasks.spawn(self._learn_settings()))
        except (RuntimeError, AttributeError):  # no loop yet: the next adopted epoch asks again
            self._settings_asked = False

    async def _learn_settings(self) -> None:
        try:
            r = await self._calls.eval("status", ["0"], bound=self._settings.backend_timeout)
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
                st.epoch,
                st.capacity,
                st.max_waiters,
                ttl_ms(st.max_ttl) if st.max_ttl else 0,
                st.queue_config(),
            )

    def remake_capacity(self) -> int | None:
        """The capacity (bytes) :meth:`configure_argv` makes the pool again with after Redis
        lost it when given none: what the server last showed (the sum of its devices when it
        had several); None when this object never saw the pool (or no capacity of it). Safe
        from any thread."""
        if not self.known_epoch:
            return None
        return int(self.configure_argv(0, 0, 0, create_only=True)[0]) or None

    def configure_argv(
        self,
        capacity: int,
        max_waiters: int,
        max_ttl_ms: int,
        create_only: bool,
        grace: bool = False,
        policy: QueueConfig | None = None,
    ) -> list[str]:
        """ARGV of ``configure.lua`` for the pool object's ``configure`` (``policy``: a queue
        policy, backfill window in ms and quotas, each None: unchanged). A create-only call by
        a pool object that knew the pool (so Redis lost it) makes it again as the server last
        showed it — capacity, max_waiters, max_ttl, queue policy, quotas: an operator's ``pool set``
        wins over the values given here, which count only for a pool never seen — and with a
        grace period."""
        if create_only and self.known_epoch:
            capacity = self.capacity_seen or capacity
            max_waiters = self.max_waiters_seen or max_waiters
            max_ttl_ms = self.max_ttl_seen_ms or max_ttl_ms
            grace = True
            policy = self.policy_seen or policy
            # The devices and the capacity may come from different replies: the devices
            # say how the capacity is split, so the pool is made with their sum.
            capacity = _devices_sum(policy) or capacity
        return configure_args(capacity, max_waiters, max_ttl_ms, create_only, grace, policy)

    async def recover(self, orphans: list[LeaseState], epoch: int) -> int:
        """Redis lost the pool (a restart without its data, or the keys were deleted) while
        this process holds ``orphans`` or waits. Create the pool again if it is gone — as it was
        last seen, with a grace period, since we know it existed — then put our leases back
        with their old ids, amounts and tokens (``reassert.lua``); only then adopt the new
        epoch. A lease that cannot be put back is lost. The calls retry on the common policy
        until the first orphan's local deadline (at most backend_timeout); if they fail, the
        next heartbeat finds the loss again. Returns the pool's new epoch (0: not created)."""
        st = self._settings
        live_until = [s.valid_until for s in orphans if not s.released and s.lost_reason is None]
        bound = max(0.5, min([st.backend_timeout] + [t - self.clock() for t in live_until]))
        if epoch == 0:
            if not (self.capacity_seen or st.capacity):
                for s in orphans:
                    self._leases.lose(
                        s,
                        "the pool's configuration is gone (Redis restarted without its data?) "
                        "and this pool object does not know its capacity to create it again",
                    )
                return 0
            argv = self.configure_argv(st.capacity or 0, st.max_waiters, st.max_ttl_ms, True, True)
            sent = self.clock()
            made = decode_configure(await self._calls.eval("configure", argv, bound=bound))
            epoch = made.epoch
            if made.grace_left_ms is not None:
                self.note_grace(sent, made.grace_left_ms)
            if made.created:
                log.warning(
                    "gpulock: pool %s was gone from Redis (restarted without its data?): created it "
                    "again (capacity %d bytes) with a grace period of %.1fs for holders to put "
                    "their leases back; nothing new is granted until it ends",
                    self.pool,
                    made.capacity,
                    (made.grace_left_ms or 0) / 1000,
                )
        live = [s for s in orphans if not s.released and s.lost_reason is None]
        if live:
            await self._reassert(live, epoch, bound)
        self.known_epoch = epoch  # recovered: this is the pool now
        return epoch

    async def _reassert(self, live: list[LeaseState], epoch: int, bound: float) -> None:
        """Put ``live`` back into the pool of ``epoch`` (``reassert.lua``, retried for
        ``bound`` seconds); a lease the server refuses is lost."""
        args: list[Any] = [len(live)]
        for s in live:
            args += [
                s.lease_id,
                s.token,
                s.amount,
                ttl_ms(s.ttl_s),
                s.ticket,
                s.meta,
                s.tenant,
                s.device,
                "resident" if s.resident else "",
                s.preemption_field(self._shared.channel_id),
            ]
        sent = self.clock()
        rep = decode_reassert(await self._calls.eval("reassert", args, bound=bound))
        now_ms = rep.now_ms
        self._shared.anchor.observe(sent, now_ms)
        self.note_grace(sent, rep.grace_left_ms)
        for s, res in zip(live, rep.results):
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
                self._leases.lose(
                    s,
                    REASSERT_REFUSED.get(
                        res, f"Redis lost the pool and refused to take the lease back ({res})"
                    ),
                )

    def requeue(self, forgotten: list[Waiter]) -> None:
        """Queue ``forgotten`` (waiters the queue forgot: Redis lost the pool, or refreshes
        were missed for waiter_ttl, e.g. a pause) again with the same tickets (idempotent), one
        after the other in the given order, so FIFO among them holds."""
        for w in forgotten:
            self._requeue.setdefault(w.ticket, w)
        if self._requeuer is None or self._requeuer.done():
            self._requeuer = self._tasks.spawn(self._requeue_all())

    async def _requeue_all(self) -> None:
        """Queue again, one at a time in their old order, the waiters whose place Redis forgot."""
        waiters = self._registry.waiters
        while self._requeue and not self._is_closed():
            _, w = self._requeue.popitem(last=False)
            if waiters.get(w.ticket) is w and w.future is not None and not w.future.done():
                await self._requeue_one(w)

    async def _requeue_one(self, w: Waiter) -> None:
        """Enqueue ``w`` again with its ticket (idempotent; its own script: an acquire, or a
        lease's growth, ``resize.lua``, which answers the grant made meanwhile), retrying on the common policy
        within the waiter's bound. The waiter fails only when Redis stays unreachable past
        :meth:`WaiterRegistry.waiter_bound`, or when the server refuses the request (say the
        capacity shrank below it); a pool found gone again is left to the heartbeat, which
        recovers it and queues the waiter again."""
        reg = self._registry
        left = reg.waiter_bound(w) - (self.clock() - w.refreshed)
        try:
            sent = self.clock()
            r = await self._calls.eval(w.script, w.argv, bound=max(1.0, left))
        except ResponseError as e:
            if str(e).startswith("GPULOCK_NOPOOL"):
                self._suspect_restart()  # the heartbeat makes the pool again and re-queues us
                return
            reg.fail(w, e)
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # Redis unreachable past the bound (retries exhausted), or refused
            if not isinstance(e, RETRYABLE) or self.clock() - w.refreshed > reg.waiter_bound(w):
                reg.fail(w, e)
            return
        res = decode_acquire(w.ticket, r)
        w.refreshed = sent
        self._shared.anchor.observe(sent, res.now_ms)
        self.seen(res.epoch, res.capacity)
        if reg.waiters.get(w.ticket) is not w and not reg.ticket_in_use(w.ticket):
            # Given up while this re-enqueue was in flight (its cancel may have run first):
            # withdraw again, or the place (and later a grant) would be orphaned.
            await self._calls.cancel_quietly(w.ticket)
            return
        if isinstance(res, Grant):
            reg.deliver(res)
        elif res.resident is not None:  # a resident request the others leave no room for
            reg.fail(
                w,
                AcquireTimeout(
                    f"pool {self.pool!r}: this resident request no longer fits the capacity next "
                    f"to the resident leases held and queued ({res.resident} bytes); it left "
                    f"the queue",
                    queue_length=res.queue_length,
                ),
            )
        else:
            w.position = res.position
            self.note_grace(sent, res.grace_left_ms)
            self._set_reap_timer(self.clock(), res.retry_after_ms)


def _devices_sum(policy: QueueConfig | None) -> int | None:
    """The sum of a pool's devices' capacities as last seen (bytes), None when it was not
    seen to have several devices."""
    if policy is None or not policy.devices:
        return None
    return sum(int(c) for c in policy.devices.split())
