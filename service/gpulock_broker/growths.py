"""Resizing a lease through the broker (``POST /v1/pools/{pool}/leases/{lease_id}/resize``):
a shrink, or a growth granted now, answers at once; a growth that has to wait waits across
the client's HTTP requests as an acquire does (the protocol in :mod:`gpulock_broker.core`)::

    client                  broker                                    Redis
    POST resize 6GiB ───►   try it now (RemoteHolders.resize, timeout 0)  not now
                            start the growth: RemoteHolders.resize(6GiB, timeout) in a task
                            wait up to `wait` s for it                    queued (grow:<lease>)
    ◄── 503 queued, Retry-After: 0 (after a long poll), X-Queue-Position; kept `hold` s
    POST resize 6GiB ───►   the same growth: wait up to `wait` s for it   granted (hand-off)
    ◄── 200 the lease: amount 6GiB, expires_in

One growth per lease, the core's flow (:meth:`gpulock.runtime.remote.RemoteHolders.resize`)
run as a task of the broker: its own timeout (the first request's ``timeout``) ends it with
AcquireTimeout, and whatever ends it early withdraws the growth (a resize back to the amount
before, which also undoes a grant that raced in). It ends early when nobody comes back for it
within its hold (the rule of the acquire's parked places, :class:`gpulock.http.places.KeptPlaces`),
when the client hangs up during a long poll and no other request of it waits, and when a
resize of the same lease to another amount arrives (the later one replaces it; the client's
withdrawal is such a resize, back to the amount it holds).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from gpulock.errors import (
    AcquireTimeout,
    BackendUnavailable,
    LeaseLost,
    PoolClosed,
    PoolNotFound,
    QueueFull,
)
from gpulock.http.places import KeptPlace, KeptPlaces
from gpulock.protocol.replies import Grant
from .acquire import _true, queue_full, refused, retry_after_of
from .auth import Principal
from .leases import LeaseRecord, Leases
from .outcomes import ClientGone, Refused
from .pools import Pools
from .tasks import Tasks

__all__ = ["Growing", "Growths", "Resized"]

Key = tuple[str, str]  # (pool, lease id)


@dataclass(frozen=True)
class Resized:
    """The lease as the server has it after the resize: ``rec`` (its record, amount updated),
    ``grant`` (server-clock milliseconds), ``expires_in`` (seconds left when the answer is
    made, on the broker's clock) and ``held_s`` (how long this request was held before the
    lease's expiry was read: the client counts ``expires_in`` from its send plus that)."""

    rec: LeaseRecord
    grant: Grant
    expires_in: float
    held_s: float


@dataclass(frozen=True)
class Growing:
    """The growth still waits after ``wait``: its place (``position``, 1-based, None before
    the first refresh knows it), the ``retry_after_s`` to tell and how long it is kept for a
    retry (``hold_s``)."""

    amount: int
    position: int | None
    retry_after_s: int
    hold_s: float
    estimated_wait_s: float | None = None  # the server's estimate at the last refresh, or None


@dataclass(eq=False)
class _Growth(KeptPlace):
    amount: int = 0
    task: asyncio.Task | None = None
    done_at: float = 0.0  # local clock, when the task ended
    position: int | None = None  # its place in the queue, as last seen (a QueuePlace)
    queued: asyncio.Future | None = None  # done once the growth is in the queue

    def on_queued(self, position: int) -> None:
        self.position = position
        if self.queued is not None and not self.queued.done():
            self.queued.set_result(None)


class Growths:
    """The growths waited for, by ``(pool, lease id)``.

    Args:
        pools, leases, tasks: the broker's parts.
        waiter_ttl: the fewest seconds a growth is kept after an answer that left it waiting.
        park_max: the most seconds it is kept after one answer.
        max_wait: the longest a request is held while the growth waits, seconds.
        retry_after_max: the largest Retry-After sent, seconds.
        clock: the local clock, seconds.
    """

    def __init__(
        self,
        pools: Pools,
        leases: Leases,
        tasks: Tasks,
        *,
        waiter_ttl: float,
        park_max: float,
        max_wait: float,
        retry_after_max: int,
        clock: Callable[[], float],
    ):
        self._pools, self._leases, self._tasks = pools, leases, tasks
        self.max_wait, self.retry_after_max = max_wait, retry_after_max
        self._clock = clock
        self.places: KeptPlaces[Key, _Growth] = KeptPlaces(
            waiter_ttl, self._expired, cap=park_max, clock=clock
        )

    async def resize(
        self,
        who: Principal,
        pool: str,
        lease_id: str,
        amount: int,
        timeout: float | None,
        *,
        wait: float,
        gone: asyncio.Future | None = None,
    ) -> Resized | Growing:
        """Resize ``who``'s lease ``lease_id`` on ``pool`` to ``amount`` bytes; a growth waits
        up to ``timeout`` seconds (None: as long as its client comes back; 0: never queued),
        this request at most ``wait`` seconds (capped by ``max_wait``) of it. ``gone``: turns
        true when the client hung up (the growth is withdrawn then).

        Raises: LeaseGone, NotYours, InvalidArgument, CapacityExceeded (QuotaExceeded,
        RoomExceeded), ResizeRefused, QueueFull, AcquireTimeout (the lease keeps its amount),
        PoolNotFound, BackendUnavailable, ClientGone."""
        t0 = self._clock()
        rec = await self._leases.find(who, pool, lease_id)
        key = (pool, lease_id)
        hint = None  # the server's hint of the first try (seconds), for the first answer
        if await self._current(key, amount) is None:
            # what can be answered at once is, in this request; only a growth that has to
            # wait becomes a task that outlives it
            try:
                res = await self._call(rec, amount, 0.0, self._tasks.backend_timeout)
                return await self._answer(rec, res, self._clock(), t0)
            except AcquireTimeout as e:
                if timeout == 0:
                    raise self._refused(e, pool, None) from e
                hint = e.retry_after
            if timeout is not None:
                timeout = max(0.0, timeout - (self._clock() - t0))
            await self._current(key, amount)  # another request may have started one meanwhile
        g = self.places.attach(key, lambda: _Growth(amount=amount))  # (no await since the check)
        final = False
        try:
            if g.task is None:
                g.queued = asyncio.get_running_loop().create_future()
                g.task = self._tasks.spawn(self._grow(g, rec, amount, timeout))
                # its first answer is this request's to give: queued, or what ended it
                await self._wait({g.task, g.queued}, self._tasks.backend_timeout, gone)
            poll = max(0.0, min(wait, self.max_wait) - (self._clock() - t0))
            await self._wait({g.task}, poll, gone)
            if _true(gone) and not g.task.done():
                final = True
                if g.attached == 1:  # no other request of it waits here
                    await self._end(key, g)
                raise ClientGone(lease_id)
            if g.task.done():
                final = True
                try:
                    return await self._answer(rec, g.task, g.done_at, t0)
                except QueueFull as e:
                    more = max(1, amount - rec.amount)  # the bytes the growth asks for
                    raise await queue_full(
                        self._pools, pool, e, more, cap=self.retry_after_max
                    ) from e
                except AcquireTimeout as e:
                    raise self._refused(e, pool, g) from e
            est = getattr(g.position, "estimated_wait", None)  # a QueuePlace's estimate
            grace = self._pools.get(pool).pool.grace_left()  # as last seen, no I/O
            ra = retry_after_of(
                est,
                hint,
                cap=self.retry_after_max,
                grace_left=grace,
                held=self._clock() - t0,
                keep_place=self.places.cap,
            )
            hold = self.places.hold_for(ra, extra=grace)
            self.places.keep(key, g, until=self._clock() + hold)
            return Growing(amount, g.position, ra, hold, est)
        finally:
            self.places.detach(key, g, keep=not final)

    def _refused(self, e: AcquireTimeout, pool: str, g: _Growth | None) -> Refused:
        """A growth not granted within its timeout (``g``: its kept place; None: it never
        queued, ``timeout=0``), with its Retry-After: from the server's estimate the error
        carries (a growth never queued: had it joined the queue's tail), else the growth's own
        at its last refresh, else the server's hint; at least the grace period left."""
        est = e.estimated_wait
        if est is None and g is not None:
            est = getattr(g.position, "estimated_wait", None)  # a QueuePlace's estimate
        grace = max(e.grace_left, self._pools.get(pool).pool.grace_left())  # no I/O
        return refused(e, est, e.retry_after, cap=self.retry_after_max, grace_left=grace)

    async def _call(
        self,
        rec: LeaseRecord,
        amount: int,
        timeout: float | None,
        bound: float | None,
        queued: Callable[[int], None] | None = None,
    ) -> Grant:
        """One resize through the pool object (``bound``: on the wait for it, seconds; None:
        none), ``queued(position)`` called when the growth queues and its place changes. Raises
        as the core's, LeaseLost as LeaseGone (the record forgotten), PoolClosed as
        PoolNotFound (the pool was deleted) or BackendUnavailable (the broker stops)."""
        p = self._pools.get(rec.pool)
        try:
            call = p.resize(rec.lease_id, amount, timeout, priority=rec.priority, on_queued=queued)
            if bound is None:
                return await call
            res: Grant = await self._tasks.guard(call, bound=bound)
            return res
        except LeaseLost:
            raise self._leases.lost(rec) from None
        except PoolClosed:
            if self._pools.was_retired(p):
                raise PoolNotFound(rec.pool) from None
            raise BackendUnavailable("the lease broker is shutting down") from None

    async def _grow(
        self, g: _Growth, rec: LeaseRecord, amount: int, timeout: float | None
    ) -> Grant:
        try:
            return await self._call(rec, amount, timeout, None, g.on_queued)
        finally:
            g.done_at = self._clock()

    async def _answer(
        self, rec: LeaseRecord, res: Grant | asyncio.Task, got_at: float, t0: float
    ) -> Resized:
        """The answer of a resize whose grant ``res`` (or the task that returned it, or
        raised) was read at ``got_at`` (local clock), for a request that came at ``t0``: the
        lease renewed to a full ttl when a hand-off left it less than half (as a parked
        acquire's grant), its record updated."""
        if isinstance(res, asyncio.Task) and res.cancelled():
            raise AcquireTimeout(
                f"pool {rec.pool!r}: the growth of lease {rec.lease_id[:8]}… was withdrawn (a "
                f"later resize of the lease replaced it, or its client went); it keeps its amount"
            )
        g = res if isinstance(res, Grant) else res.result()
        fresh = await self._leases.full_ttl(rec.pool, g, rec.ttl_s)
        if fresh is not g:
            g, got_at = fresh, self._clock()
        # seconds left at got_at; a grant read before this request came counts down to it
        expires_in = max(0, g.expires_ms - g.now_ms) / 1000 - max(0.0, t0 - got_at)
        self._leases.resized(rec, g, expires_in)
        return Resized(rec, g, max(0.0, expires_in), max(0.0, got_at - t0))

    async def _wait(
        self, futures: set[asyncio.Future], timeout: float, gone: asyncio.Future | None
    ) -> None:
        """Wait up to ``timeout`` s for one of ``futures`` to be done (none is cancelled) or
        the client to hang up."""
        waits = set(futures)
        if gone is not None and not (gone.done() and not _true(gone)):
            waits.add(gone)
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)

    async def _current(self, key: Key, amount: int) -> _Growth | None:
        """The growth kept for ``key`` to ``amount`` bytes, or None; a growth kept to another
        amount (or one ended, which an answer of it kept again) is ended first: a resize to
        another amount replaces it."""
        while True:
            g = self.places.get(key)
            if g is None or (
                g.amount == amount and not (g.task is not None and g.task.cancelled())
            ):
                return g
            await self._end(key, g)

    async def _end(self, key: Key, g: _Growth) -> None:
        """Stop keeping ``g`` and end its growth (its flow withdraws it); waits for that, at
        most ``backend_timeout`` (it goes on in the background after)."""
        self.places.discard(key, g)
        t = g.task
        if t is not None and not t.done():
            t.cancel()
            await asyncio.wait((t,), timeout=self._tasks.backend_timeout)

    def _expired(self, key: Key, g: _Growth) -> None:
        """Nobody came back for a growth within its hold: end it."""
        if g.task is not None and not g.task.done():
            g.task.cancel()

    def holds(self, pool: str) -> bool:
        """Whether a growth on ``pool`` is kept."""
        return any(k[0] == pool for k in self.places)

    def drop_pool(self, pool: str) -> None:
        """End every growth on ``pool`` (its pool object is retired)."""
        for key in [k for k in self.places if k[0] == pool]:
            g = self.places.discard(key)
            if g is not None and g.task is not None:
                g.task.cancel()

    async def aclose(self) -> None:
        """End every growth (each withdrawn, best effort: 1 s)."""
        ts = []
        for _, g in self.places.clear():
            if g.task is not None and not g.task.done():
                g.task.cancel()
                ts.append(g.task)
        if ts:
            await asyncio.wait(ts, timeout=1.0)
