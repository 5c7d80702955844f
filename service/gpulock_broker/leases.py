"""The leases granted through the broker: which token owns which lease, their renewal and
release, and what is remembered of a lease after it ends (a *tomb*: released or lost).

Leases are renewed and released only by the token that acquired them: the broker records the
token's identity (a hash prefix, see ``auth.py``) with the lease, in memory and in the holder
metadata in Redis (``owner``), so a restarted broker can still check it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from gpulock.protocol.replies import Grant, Renewal
from gpulock.errors import BackendUnavailable, LeaseLost, PoolNotFound

from .auth import Principal
from .outcomes import LeaseGone, NotYours, gone_message
from .pools import Pools
from .tasks import Tasks

__all__ = ["LeaseRecord", "Leases"]

#: A record of a lease not renewed or released for this long past its expiry (seconds, local
#: clock) is forgotten as lost.
FORGET_AFTER_S = 60


@dataclass
class LeaseRecord:
    pool: str
    lease_id: str
    owner: str
    token: int
    ttl_s: float
    ticket: str
    amount: int
    expires_local: float = 0.0  # local monotonic estimate of the server expiry (for cleanup)
    device: int = 0  # the device the lease is on (0 on a pool of one device)
    releasing: asyncio.Task | None = None
    priority: int = 0  # its acquire's (a growth's place where none is stored); 0 when read back


@dataclass
class _Tomb:
    pool: str
    owner: str
    outcome: str  # "released" | "lost"
    at: float


class Leases:
    """The lease records by lease id, the lease handed out for each ticket, and the tombs.

    Args:
        pools: the pool objects the leases are renewed and released through.
        tasks: where Redis calls run, bounded by ``tasks.backend_timeout``.
        clock: the local clock, seconds.

    Attributes:
        tomb_ttl: how long an ended lease is remembered, seconds.
        max_tombs: the most ended leases remembered (the oldest go first).
    """

    def __init__(self, pools: Pools, tasks: Tasks, clock: Callable[[], float]):
        self._pools, self._tasks, self._clock = pools, tasks, clock
        self._leases: dict[str, LeaseRecord] = {}
        self._handed: dict[tuple[str, str], str] = {}  # (pool, ticket) -> lease id given in a 201
        self._tombs: OrderedDict[str, _Tomb] = OrderedDict()
        self.tomb_ttl = 3600.0
        self.max_tombs = 100_000

    def handed(self, pool: str, ticket: str) -> bool:
        """Whether the request ``ticket`` on ``pool`` was answered with its lease (201)."""
        return (pool, ticket) in self._handed

    def holds(self, pool: str) -> bool:
        """Whether a lease on ``pool`` is recorded."""
        return any(r.pool == pool for r in self._leases.values())

    def record(
        self, owner: str, pool: str, ticket: str, ttl: float, g: Grant, priority: int = 0
    ) -> LeaseRecord:
        """Record the grant ``g`` of the request ``ticket`` (of ``priority``) as handed to
        ``owner`` (a token's identity); a lease recorded before keeps its record. Its local
        expiry estimate is updated from ``g``."""
        rec = self._leases.get(g.lease_id)
        if rec is None:
            rec = LeaseRecord(
                pool,
                g.lease_id,
                owner,
                g.token,
                ttl,
                ticket,
                g.amount,
                device=g.device,
                priority=priority,
            )
            self._leases[g.lease_id] = rec
            self._handed[(pool, ticket)] = g.lease_id
        rec.expires_local = self._clock() + max(0, g.expires_ms - g.now_ms) / 1000
        return rec

    def forget_handed(self, pool: str, ticket: str, outcome: str) -> None:
        """Forget the lease handed to the request ``ticket`` on ``pool``, if any, as
        ``outcome``."""
        lid = self._handed.get((pool, ticket))
        if lid and lid in self._leases:
            self.forget(self._leases[lid], outcome)

    def forget_pool(self, pool: str) -> None:
        """Forget every lease on ``pool`` as lost (the pool was deleted)."""
        for rec in [x for x in self._leases.values() if x.pool == pool]:
            self.forget(rec, "lost")

    def forget(self, rec: LeaseRecord, outcome: str) -> None:
        """Drop ``rec`` and remember its lease as ``outcome`` ("released" or "lost")."""
        self._leases.pop(rec.lease_id, None)
        if self._handed.get((rec.pool, rec.ticket)) == rec.lease_id:
            del self._handed[(rec.pool, rec.ticket)]
        self._tombs[rec.lease_id] = _Tomb(rec.pool, rec.owner, outcome, self._clock())
        self._tombs.move_to_end(rec.lease_id)
        while len(self._tombs) > self.max_tombs:
            self._tombs.popitem(last=False)

    async def find(self, who: Principal, pool: str, lease_id: str) -> LeaseRecord:
        """The record of lease ``lease_id`` on ``pool`` if ``who`` owns it (read back from the
        holder metadata in Redis when this broker has none). Raises LeaseGone (released or
        lost), NotYours, BackendUnavailable."""
        rec = self._leases.get(lease_id)
        if rec is None or rec.pool != pool:
            tomb = self._tombs.get(lease_id)
            if tomb is not None and tomb.pool == pool:
                if tomb.owner != who.id:
                    raise NotYours(lease_id)
                raise LeaseGone(lease_id, tomb.outcome, gone_message(lease_id, tomb.outcome))
            rec = await self._lookup(pool, lease_id)
        if rec.owner != who.id:
            raise NotYours(lease_id)
        return rec

    async def _lookup(self, pool: str, lease_id: str) -> LeaseRecord:
        """A lease this broker has no record of (it restarted, or another broker granted it):
        read its owner from the holder metadata in Redis."""
        try:
            st = await self._tasks.guard(self._pools.get(pool).pool.status(limit=100_000))
        except PoolNotFound:
            st = None
        info = next((x for x in st.leases if x.lease_id == lease_id), None) if st else None
        if info is None:
            raise LeaseGone(lease_id, "lost", gone_message(lease_id, "unknown"))
        owner = info.holder.get("owner")
        if not isinstance(owner, str):
            raise NotYours(lease_id)
        rec = LeaseRecord(
            pool,
            lease_id,
            owner,
            info.token,
            info.ttl,
            info.request_id,
            info.amount,
            self._clock() + info.expires_in,
            device=info.device,
        )
        self._leases[lease_id] = rec
        return rec

    async def renew(
        self, who: Principal, pool: str, lease_id: str, ttl: float | None
    ) -> tuple[LeaseRecord, Renewal]:
        """Renew for ``ttl`` seconds (None: the lease's last ttl). Returns (record, the
        server's :class:`Renewal`: expires_ms, server_now_ms, and yield_deadline_ms, not 0
        when the server asked the holder to yield the lease). Raises LeaseGone, NotYours,
        BackendUnavailable."""
        rec = await self.find(who, pool, lease_id)
        ttl_s = rec.ttl_s if ttl is None else ttl
        try:
            r = await self._tasks.guard(self._pools.get(pool).renew(lease_id, rec.token, ttl_s))
        except LeaseLost:
            raise self.lost(rec) from None
        rec.ttl_s = ttl_s
        rec.expires_local = self._clock() + max(0, r.expires_ms - r.now_ms) / 1000
        return rec, r

    async def release(self, who: Principal, pool: str, lease_id: str) -> int | None:
        """Release; returns the server time (ms) of the release, None when it was released
        before (idempotent). Raises LeaseGone (lost), NotYours, BackendUnavailable."""
        try:
            rec = await self.find(who, pool, lease_id)
        except LeaseGone as e:
            if e.outcome == "released":
                return None
            raise
        if rec.releasing is None or (
            rec.releasing.done() and rec.releasing.exception() is not None
        ):
            rec.releasing = self._tasks.spawn(self._release(rec))
        ok, now = await self._tasks.guard(rec.releasing)
        if not ok:
            raise LeaseGone(lease_id, "lost", gone_message(lease_id, "lost"))
        return now

    def lost(self, rec: LeaseRecord) -> LeaseGone:
        """The server said ``rec``'s lease is lost: forget it as lost (unless another record
        replaced it) and return the error its caller gets (410)."""
        if self._leases.get(rec.lease_id) is rec:
            self.forget(rec, "lost")
        return LeaseGone(rec.lease_id, "lost", gone_message(rec.lease_id, "lost"))

    def resized(self, rec: LeaseRecord, g: Grant, expires_in: float) -> None:
        """``rec``'s lease has ``g.amount`` bytes now, ``expires_in`` seconds left (local
        clock from now)."""
        rec.amount = g.amount
        rec.expires_local = self._clock() + max(0.0, expires_in)

    async def full_ttl(self, pool: str, g: Grant, ttl: float) -> Grant:
        """``g`` renewed to ``ttl`` seconds from now when less than half of it is left (a grant
        that waited for its client, parked, or a growth that a hand-off granted), so the
        client starts with a full ttl; else ``g``. A renewal that fails leaves ``g`` as it is
        (the client's first renewal tells)."""
        if g.expires_ms - g.now_ms >= ttl * 500:
            return g
        try:
            r = await self._tasks.guard(self._pools.get(pool).renew(g.lease_id, g.token, ttl))
        except (LeaseLost, BackendUnavailable):
            return g
        return dataclasses.replace(g, expires_ms=r.expires_ms, now_ms=r.now_ms)

    async def _release(self, rec: LeaseRecord) -> tuple[bool, int]:
        # retried while the lease may still be valid (then its bytes are freed at expiry):
        # this task outlives a request answered 503, and the client's retry awaits it
        left = max(1.0, rec.expires_local - self._clock())
        ok, now = await self._pools.get(rec.pool).release(rec.lease_id, rec.token, left)
        if self._leases.get(rec.lease_id) is rec:
            self.forget(rec, "released" if ok else "lost")
        return ok, now

    def sweep(self, now: float) -> None:
        """Forget records of leases expired more than :data:`FORGET_AFTER_S` before ``now``
        (local clock) and tombs older than ``tomb_ttl``."""
        for rec in [
            r
            for r in self._leases.values()
            if r.releasing is None and now > r.expires_local + FORGET_AFTER_S
        ]:
            self.forget(rec, "lost")
        while self._tombs:
            lid, t = next(iter(self._tombs.items()))
            if now - t.at < self.tomb_ttl:
                break
            self._tombs.popitem(last=False)
