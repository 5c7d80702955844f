"""The heartbeat of one pool object: batched renewals, waiter refresh, reaps, deadlines.

Two tasks:

* the **ticker**: one batched ``renew`` call per interval renews every lease this pool object
  holds (at ttl/3) and refreshes every waiter's expiry (each ``poll_interval``); the same reply
  returns grants whose message was missed (the backstop). It also fires the reap timer at the
  nearest lease expiry the server reported, so a crashed holder's bytes move on at once, and
  it runs the recovery when a reply shows that Redis lost the pool.
* the **watchdog**: marks leases lost (firing on_lost) at their local validity deadlines, also
  while the ticker sits in a renew call to a hung Redis.

They start with the first lease or waiter.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gpulock_common.aio import wait_for

from gpulock.transport.failure_log import FailureLog
from gpulock.protocol.request import LeaseState, retry_delay, ttl_ms
from gpulock.transport.retry import RETRYABLE
from gpulock.protocol.replies import decode_reap, decode_renew
from gpulock.runtime.kept import KeptBack
from gpulock.runtime.recovery import Recovery
from gpulock.runtime.shared import Shared

log = logging.getLogger("gpulock")


class Heartbeat:
    """The ticker and the watchdog of the pool of ``shared``: renews its held leases and
    refreshes its waiters every ``poll_interval`` seconds; runs ``recovery`` when a reply shows
    that Redis lost the pool."""

    def __init__(
        self,
        shared: Shared,
        recovery: Recovery,
        poll_interval: float,
        kept_back: KeptBack | None = None,
    ):
        self.pool = shared.pool
        self._kept_back = kept_back
        self.clock = shared.clock
        self.poll_interval = poll_interval
        self._shared = shared
        self._calls = shared.calls
        self._settings = shared.settings
        self._leases = shared.leases
        self._registry = shared.waiters
        self._recovery = recovery
        self._tasks = shared.tasks
        self._is_closed = shared.is_closed
        self.reap_at: float | None = None
        self.next_poll = 0.0
        # A reply showed the pool gone or made again: the ticker runs (and recovers) at once.
        self.restart_suspected = False
        self._wake: asyncio.Event | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._ticker_at = 0.0  # when the ticker plans to wake next (local clock)
        self._watchdog: asyncio.Task[None] | None = None
        self._dog_wake: asyncio.Event | None = None
        self._dog_at = 0.0  # when the watchdog plans to wake next; inf while it has no lease
        # Counts the leases and waiters added: a task that planned its wake-up while one was
        # added (on another thread) plans again, so that the adder, which reads the plan to
        # decide whether to wake it, cannot have read the plan before it was made.
        self._added = 0
        self._jeopardy = False  # a renewal failed and none has succeeded since
        self._in_jeopardy: list[LeaseState] = []  # the leases held when it began
        self._retry_at = 0.0  # after a failed tick: not before this (local clock)
        self._tick_log = FailureLog(f"heartbeat for pool {self.pool}", clock=self.clock)

    # ---- scheduling ----------------------------------------------------------------------
    def ensure_started(self) -> None:
        """Start the ticker and the watchdog in the running loop unless they run."""
        if self._ticker is None or self._ticker.done():
            loop = self._tasks.bind()
            if self._wake is None:
                self._wake = asyncio.Event()
                self._dog_wake = asyncio.Event()
            self._ticker = loop.create_task(self._tick_loop(), name=f"gpulock-ticker-{self.pool}")
            self._watchdog = loop.create_task(
                self._watch_deadlines(), name=f"gpulock-watchdog-{self.pool}"
            )

    def poke(self) -> None:
        """Make the ticker look at its schedule now."""
        if self._wake is not None:
            self._wake.set()

    def lease_added(self, state: LeaseState) -> None:
        """A lease was tracked. Safe from any thread: wakes the loop only when the ticker or
        the watchdog must run sooner than planned (a first lease, or a shorter ttl)."""
        self._added += 1
        wake_ticker = self._ticker is None or state.next_renew < self._ticker_at
        wake_dog = state.valid_until < self._dog_at
        if wake_ticker or wake_dog:
            # The plans the woken tasks keep even if the lease is gone when they run (a
            # release follows at once), so that the next lease need not wake them again.
            if wake_ticker:
                self._ticker_at = state.next_renew
            if wake_dog:
                self._dog_at = state.valid_until
            self._tasks.in_loop(self._start_and_poke)

    def _start_and_poke(self) -> None:
        self.ensure_started()
        self.poke()
        assert self._dog_wake is not None  # made by ensure_started, with _wake
        self._dog_wake.set()

    def waiter_added(self, now: float, first: bool) -> None:
        """A waiter was registered at ``now`` (``first``: the only one): schedule its refresh.
        Safe from any thread: wakes the loop only when the ticker must run sooner than planned
        (or does not run)."""
        # The first waiter's refresh is due in poll_interval; a later one must not postpone the
        # refresh already due (waiters queueing faster than poll_interval would starve it).
        self.next_poll = (
            now + self.poll_interval if first else min(self.next_poll, now + self.poll_interval)
        )
        self._added += 1
        ticker = self._ticker
        if ticker is None or ticker.done() or self.next_poll < self._ticker_at:
            self._tasks.in_loop(self._start_ticker)

    def unreachable(self) -> tuple[float, BaseException] | None:
        """``(seconds, last error)`` while this pool object's background calls keep failing
        (Redis, or on a cluster the pool's shard, unreachable), else None."""
        log = self._tick_log
        if not log.failing or log.last is None:
            return None
        return log.failing_for, log.last

    def poll_now(self) -> None:
        """Poll the waiters at once (in the loop): see
        :meth:`gpulock.runtime.runtime.Runtime.poll_waiters_now`."""
        self.next_poll = min(self.next_poll, self.clock())
        self._start_ticker()

    def _start_ticker(self) -> None:
        self.ensure_started()
        self.poke()

    def suspect_restart(self) -> None:
        """A reply showed the pool gone or made again: run the heartbeat (and so the recovery)
        now rather than at the next renewal. Safe from any thread."""
        if self._is_closed():
            return
        self.restart_suspected = True  # seen by the ticker even if the poke below cannot run
        try:
            self._tasks.in_loop(self._recover_soon)
        except (RuntimeError, AttributeError):  # no loop yet, or it is closed: nothing to wake
            pass

    def _recover_soon(self) -> None:
        self.restart_suspected = True
        self.ensure_started()
        self.poke()

    def set_reap_timer(self, received: float, next_expiry_in_ms: int) -> None:
        """Schedule a reap at the nearest lease expiry (local time, biased late by using the
        receive time) while this process has waiters. Safe from any thread: wakes the loop
        only when the ticker must run sooner than planned."""
        if next_expiry_in_ms < 0:
            return
        at = received + next_expiry_in_ms / 1000.0 + 0.0005
        reap_at = self.reap_at  # read once: another thread may clear it (Runtime.remove_waiter)
        if reap_at is None or at < reap_at or reap_at <= self.clock():
            self.reap_at = at
            self._added += 1
            if at < self._ticker_at:
                self._tasks.in_loop(self.poke)

    def cancel(self) -> list[asyncio.Task[Any]]:
        """Cancel the ticker and the watchdog; returns them for the caller to await."""
        out = [t for t in (self._ticker, self._watchdog) if t is not None]
        for t in out:
            t.cancel()
        return out

    # ---- deadlines -----------------------------------------------------------------------
    async def _watch_deadlines(self) -> None:
        """Mark leases lost (firing on_lost) at their local validity deadlines. A task of its
        own, because the ticker may sit in a renew call to a hung Redis until the socket
        timeout, which can be longer than the ttl (invariant 5 in docs/SEMANTICS.md: a holder
        knows it lost the lease before the server expires it). One task for all leases:
        renewals only move deadlines later, so it wakes at most once per renewal period."""
        dog_wake = self._dog_wake
        assert dog_wake is not None  # made by ensure_started before it starts this task
        while not self._is_closed():
            now = self.clock()
            added = self._added
            soonest = float("inf")
            for s in list(self._leases.values()):
                if s.released or s.lost_reason is not None:
                    continue
                if now >= s.valid_until:
                    self._leases.lose(
                        s,
                        s.deadline_passed_reason(
                            "Redis unreachable or too slow, or this process was paused"
                        ),
                    )
                else:
                    soonest = min(soonest, s.valid_until)
            if soonest == float("inf") and now < self._dog_at:
                # No lease now: keep the wake-up the last one planned (the next lease's
                # deadline is later, so adding it need not wake this task: lease_added).
                soonest = self._dog_at
            self._dog_at = soonest
            if self._added != added:
                continue  # a lease came while this plan was made: plan again
            dog_wake.clear()
            try:
                await wait_for(dog_wake.wait(), None if soonest == float("inf") else soonest - now)
            except asyncio.TimeoutError:
                pass

    def _enter_jeopardy(self, err: BaseException) -> None:
        """A renewal failed: the leases are in jeopardy (Chubby's term). Each is lost at its
        own local deadline unless a renewal gets through first; say so once."""
        live = self._leases.live()
        if self._jeopardy or not live:
            return
        self._jeopardy = True
        self._in_jeopardy = live
        first = min(s.valid_until for s in live) - self.clock()
        log.warning(
            "gpulock: pool %s: %d lease(s) in jeopardy: renewal failed (%s); each is lost at "
            "its local deadline (the first in %.2fs) unless a renewal gets through before",
            self.pool,
            len(live),
            err,
            max(0.0, first),
        )

    def _leave_jeopardy(self, leases: list[LeaseState]) -> None:
        """A renewal of ``leases`` got through after one failed: say so once, with what became
        of the leases that were in jeopardy (still held, released meanwhile, or lost)."""
        self._jeopardy = False
        was, self._in_jeopardy = self._in_jeopardy, []
        held = sum(1 for s in leases if not s.released and s.lost_reason is None)
        lost = sum(1 for s in was if s.lost_reason is not None)
        released = sum(1 for s in was if s.released and s.lost_reason is None)
        fates = [
            f"the {held} lease(s) still held are out of jeopardy"
            if held
            else "no lease was still held"
        ]
        if released:
            fates.append(f"{released} were released meanwhile")
        if lost:
            fates.append(f"{lost} were lost at their local deadlines")
        log.warning(
            "gpulock: pool %s: Redis answers renewals again; %s", self.pool, "; ".join(fates)
        )

    # ---- the ticker ----------------------------------------------------------------------
    def _next_wake(self, now: float) -> float:
        t = now + 60.0
        if not self._leases and now < self._ticker_at:
            # No lease now: keep the wake-up the last one planned, so that a lease acquired
            # before then (its renewal is due later) need not wake the loop (lease_added):
            # a loop of acquire+release would otherwise wake it on every acquire.
            t = min(t, self._ticker_at)
        for s in self._leases.values():
            t = min(t, s.next_renew, s.valid_until)
        if self._registry.waiters:
            t = min(t, self.next_poll)
            reap_at = self.reap_at  # read once: another thread may clear it
            if reap_at is not None:
                t = min(t, reap_at)
        if self.restart_suspected:
            t = min(t, now)
        t = max(t, self._retry_at)  # after a failure, not before the retry (deadlines: watchdog)
        if self._tick_log.failing:  # ... but a waiter's bound is checked when it passes
            t = min(t, self._registry.soonest_bound())
        return t

    async def _tick_loop(self) -> None:
        wake = self._wake
        assert wake is not None  # made by ensure_started before it starts this task
        waiters = self._registry.waiters
        attempt = 0
        while not self._is_closed():
            now = self.clock()
            added = self._added
            self._ticker_at = self._next_wake(now)
            if self._added != added:
                continue  # a lease or waiter came while this plan was made: plan again
            delay = self._ticker_at - now
            if delay > 0:
                wake.clear()
                try:
                    await wait_for(wake.wait(), delay)
                except asyncio.TimeoutError:
                    pass
            if not self._leases and not waiters and not self.restart_suspected:
                if self._is_closed():
                    return
                continue
            now = self.clock()
            for s in list(self._leases.values()):
                if now >= s.valid_until:
                    if (
                        s.mark_lost(s.deadline_passed_reason("Redis unreachable or too slow"))
                        or s.lost_reason
                    ):
                        self._leases.drop(s.lease_id)
            if self._tick_log.failing:
                self._registry.fail_stranded(now, self._tick_log.last)
            if now < self._retry_at:
                await asyncio.sleep(0)  # never spin without yielding
                continue  # woken early (a new lease, a poke) while backing off: not yet
            suspected = self.restart_suspected
            try:
                did = False
                reap_at = self.reap_at  # read once: another thread may clear it
                if waiters and reap_at is not None and now >= reap_at:
                    self.reap_at = None
                    did = True
                    await self._reap()
                due = any(s.next_renew <= now for s in self._leases.values())
                if due or suspected or (waiters and now >= self.next_poll):
                    self.restart_suspected = False
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
                # local deadlines and the waiters' bound (fail_stranded) end it.
                self.restart_suspected = self.restart_suspected or suspected
                self._tick_log.failed(e, exc_info=not isinstance(e, RETRYABLE))
                self._enter_jeopardy(e)
                if isinstance(e, RETRYABLE):
                    await self._calls.drop_idle_connections()
                attempt += 1
                retry = self._retry_at = self.clock() + retry_delay(attempt)
                for s in self._leases.values():
                    s.next_renew = min(max(s.next_renew, retry), s.valid_until)
                self.next_poll = max(self.next_poll, retry)

    async def _reap(self) -> None:
        rep = decode_reap(await self._calls.eval("reap", []))
        received = self.clock()
        if self._registry.waiters:
            self.set_reap_timer(received, rep.next_expiry_in_ms)

    async def _heartbeat(self) -> None:
        st = self._settings
        kb = self._kept_back
        if kb is not None:
            kb.expire()  # idle kept leases past their time go back (gpulock.runtime.kept)
        leases = self._leases.live()
        waiters = list(self._registry.waiters.values())
        args: list[Any] = [len(leases)]
        for s in leases:
            args += [s.lease_id, s.token, ttl_ms(s.ttl_s)]
        args.append(len(waiters))
        for w in waiters:
            args += [w.ticket, w.waiter_ttl_ms]
        sent = self.clock()
        self.next_poll = sent + self.poll_interval
        acked = None
        if st.sync_replicas and leases:
            r, acked = await self._calls.renew_synced(args)
        else:
            r = await self._calls.eval("renew", args)
        rep = decode_renew(r, [w.ticket for w in waiters])
        now_ms, epoch = rep.now_ms, rep.epoch
        self._shared.anchor.observe(sent, now_ms)
        # The pool is gone (epoch 0) or was made again (another epoch): Redis lost its data.
        known = self._recovery.known_epoch
        pool_lost = epoch == 0 or (known != 0 and epoch != known)
        orphans = []
        for s, exp, ask in zip(leases, rep.expiries, rep.yields):
            if s.released:
                continue
            if exp > 0:
                if acked is None or acked >= st.sync_replicas:
                    s.renewed(sent, now_ms, exp)
                if ask > 0:  # asked to yield (preemption): exp is capped at ask already
                    s.asked(ask)
                # else: not on enough replicas yet; the validity stays where the last
                # acknowledged renewal put it (the ticker tries again at once; WAIT paces it).
            elif pool_lost:
                orphans.append(s)
            else:
                self._leases.lose(s, "the server no longer has it (expired and reaped)")
        if acked is not None and acked < st.sync_replicas:
            self._enter_jeopardy(
                RuntimeError(
                    f"renewal acknowledged by {acked} of {st.sync_replicas} "
                    f"replica(s) within {st.sync_timeout_ms} ms"
                )
            )
        elif self._jeopardy:
            self._leave_jeopardy(leases)
        if pool_lost and kb is not None:
            # the server's list of kept leases went with the pool: give the idle ones back,
            # and take nothing from kept bytes until a release is answered "kept" again
            kb.wanted_back()
        if pool_lost and (orphans or waiters):
            epoch = await self._recovery.recover(orphans, epoch)
        elif epoch:
            self._recovery.known_epoch = epoch
        if kb is not None and kb.kept.idle_count and (rep.queue_length or rep.grace_left_ms):
            kb.wanted_back()  # someone waits, or a grace period: kept bytes go back
        forgotten = self._registry.take_answers(waiters, rep.waiters, sent)
        if forgotten:
            self._recovery.requeue(forgotten)
