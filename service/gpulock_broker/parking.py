"""The places kept for requests between their HTTP retries ("parked" places).

A place is keyed by ``(pool, ticket)``; the ticket is the request id scoped to the token
(:func:`ticket`). How long it is kept is the rule every surface shares
(:class:`gpulock.http.places.KeptPlaces`): while an HTTP request for it is attached or a Redis
call for it is in flight, and for its hold after each answer that left it queued. One
coroutine per parked request (the *keeper*) catches a grant that lands for it and renews
that lease. A place nobody came back for is withdrawn (it leaves the queue, or its grant is
released) when its hold runs out."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

from gpulock_common.aio import wait_for

from gpulock.http.places import KeptPlace, KeptPlaces
from gpulock.errors import LeaseLost

from .auth import Principal
from .leases import Leases
from .pools import Holders, Pools
from .tasks import Tasks

__all__ = ["Parked", "Parking", "ticket"]

log = logging.getLogger("gpulock.broker")

Key = tuple[str, str]


def ticket(who: Principal, request_id: str) -> str:
    """The request id as the pool knows it: scoped to the token's identity."""
    return f"{who.id}:{request_id}"


@dataclass(eq=False)
class Parked(KeptPlace):
    inflight: set = field(default_factory=set)  # Redis calls for it not finished
    keeper: asyncio.Task | None = None
    granted_ms: int = 0  # server time of a grant the keeper caught

    def busy(self) -> bool:
        return self.attached > 0 or bool(self.inflight)


class Parking:
    """The parked places by ``(pool, ticket)``.

    Args:
        pools: the pool objects the requests are queued on.
        leases: the lease records (a place whose grant was handed out is not withdrawn).
        tasks: where keepers and withdrawals run.
        waiter_ttl: the shortest a place is kept after a request for it ends, seconds.
        park_max: the longest a place is kept after one answer, seconds.
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
        clock: Callable[[], float],
    ):
        self._pools, self._leases, self._tasks = pools, leases, tasks
        self._clock = clock
        self.places: KeptPlaces[Key, Parked] = KeptPlaces(
            waiter_ttl, self._expired, cap=park_max, clock=clock
        )

    def holds(self, pool: str) -> bool:
        """Whether a place on ``pool`` is kept."""
        return any(k[0] == pool for k in self.places)

    def attach(self, key: Key) -> Parked:
        """The place for ``key`` (made if none), with one more HTTP request attached."""
        return self.places.attach(key, Parked)

    def keep(self, key: Key, entry: Parked, hold: float) -> None:
        """Keep ``entry`` at least ``hold`` seconds from now."""
        self.places.keep(key, entry, until=self._clock() + hold)

    def detach(
        self,
        key: Key,
        entry: Parked,
        *,
        final: bool,
        pool: Holders,
        ttl: float,
    ) -> None:
        """End an HTTP request attached to ``entry``. ``final`` (granted, or nothing was
        queued): the place is dropped once nothing else uses it; else it is kept at least
        ``waiter_ttl`` seconds more, with a keeper on ``pool`` for a grant of ``ttl`` seconds."""
        self.places.detach(key, entry, keep=not final)
        if not final and self.places.get(key) is entry and entry.keeper is None:
            entry.keeper = self._tasks.spawn(self._keep(key, entry, pool, key[1], ttl))

    def discard(self, key: Key) -> None:
        """Forget the place for ``key`` (its keeper ends at its next check)."""
        self.places.discard(key)

    def drop_pool(self, pool: str) -> None:
        """Forget every place on ``pool`` and cancel their keepers (the pool is retired)."""
        for key in [k for k in self.places if k[0] == pool]:
            e = self.places.discard(key)
            if e is not None and e.keeper is not None:
                e.keeper.cancel()

    async def _keep(self, key: Key, entry: Parked, p: Holders, ticket: str, ttl: float) -> None:
        """While a request is parked, catch a grant that lands for it and keep that lease alive
        (renew at ttl/3) until the client collects it or the hold window ends (then it is
        withdraws it). One coroutine per parked request: no thread, no connection."""
        try:
            while True:
                if self.places.get(key) is not entry or self._leases.handed(*key):
                    return
                left = entry.until - self._clock()
                if left <= 0:
                    return
                t0 = self._clock()
                g = await p.wait(ticket, left)
                if g is not None:
                    entry.granted_ms = g.now_ms  # the hand-off's server time
                    break
                if self._clock() - t0 < left * 0.5:
                    return  # not queued here (refused, or withdrawn)
            while True:
                await asyncio.sleep(ttl / 3)
                if (
                    self.places.get(key) is not entry
                    or self._leases.handed(*key)
                    or self._clock() > entry.until
                ):
                    return
                try:
                    await p.renew(g.lease_id, g.token, ttl)
                except LeaseLost:
                    return
                except Exception:
                    continue
        finally:
            entry.keeper = None

    async def cancel(self, who: Principal, pool: str, request_id: str) -> int:
        """Withdraw a request: 0 nothing, 1 left the queue, 2 its grant was released."""
        t = ticket(who, request_id)
        self.places.discard((pool, t))
        p = self._pools.get(pool)
        what = await self._tasks.guard(p.cancel(t))
        self._leases.forget_handed(pool, t, "released")
        return what

    def _expired(self, key: Key, entry: Parked) -> None:
        """A place nobody came back for: withdraw it (unless its grant was handed out)."""
        if entry.keeper is not None:
            entry.keeper.cancel()
        pool, t = key
        if self._leases.handed(pool, t) or pool not in self._pools.objects:
            return
        self._tasks.spawn(self._withdraw(pool, t))

    async def _withdraw(self, pool: str, ticket: str) -> None:
        try:
            what = await self._pools.objects[pool].cancel(ticket)
            if what == 2:
                log.info(
                    "gpulock broker: released a grant on pool %s that its client did not collect",
                    pool,
                )
        except Exception as e:  # the waiter expires after waiter_ttl, a grant after its ttl
            log.info("gpulock broker: could not withdraw a parked request on pool %s: %s", pool, e)

    async def aclose(self) -> None:
        """Cancel the keepers and withdraw the places not handed out (best effort, 1 s
        each); forget them all."""
        for (pool, t), e in self.places.clear():
            if e.keeper is not None:
                e.keeper.cancel()
            p = self._pools.objects.get(pool)
            if not self._leases.handed(pool, t) and p is not None:
                try:
                    await wait_for(p.cancel(t), 1.0)
                except Exception:
                    pass
