"""The broker's state: one :class:`gpulock.AsyncPool` per pool name, the places kept for
clients between their HTTP retries, and which token owns which lease.

Waiting costs no thread and no Redis connection per waiter: a queued request is an entry in
its pool's runtime (one pub/sub subscription and one batched refresh per pool), and an HTTP
request that waits is a coroutine awaiting a future.

A place in the queue outlives the HTTP request that made it. When a request is answered 503
(still queued after ``wait``), its place is *parked* for ``hold`` seconds: the pool's runtime
keeps refreshing it, and a retry with the same ``request_id`` (scoped to the token) re-attaches
to it; a grant that lands meanwhile is kept for that retry. When ``hold`` passes with no retry,
the request is withdrawn (``cancel``: it leaves the queue, or its grant is released)::

    client            broker                                   Redis
    POST rid=r1 ───►  enqueue r1 ─────────────────────────►  queued, position 3
                      wait up to `wait` s (a future)
    ◄── 503 Retry-After: 2, X-Queue-Position: 3; r1 parked for `hold` s
                      (runtime refreshes r1; a hand-off grant for r1 is caught and kept)
    POST rid=r1 ───►  enqueue r1 (idempotent) ────────────►  granted (or the new position)
    ◄── 201 lease

``Retry-After`` (whole seconds) paces clients that do not long-poll:
``clamp(time to the nearest lease expiry, 1, retry_after_max)``, from the queue's real state;
``hold = min(park_max, max(waiter_ttl, 2 * Retry-After + 2))``, so a client honouring it (with
up to +30% jitter) keeps its place. While parked, one coroutine per request catches a grant
that lands and renews it (ttl/3) until the client collects it or the window ends; a grant
collected with less than half its ttl left is renewed once more, so the client starts with a
full ttl. A request the broker held for at least ``LONG_POLL_S`` was paced by that wait
already, and a grant may land any moment: it gets ``Retry-After: 0`` (come back now and go on
waiting), so a long-polling client is never away while its grant sits unused.

Leases are renewed and released only by the token that acquired them: the broker records the
token's identity (a hash prefix, see ``auth.py``) with the lease, in memory and in the holder
metadata in Redis (``owner``), so a restarted broker can still check it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable

import redis.asyncio as aioredis

from gpulock import AsyncPool
from gpulock._admin import DeleteResult, adelete_pool
from gpulock._connect import async_client
from gpulock._keys import POOL_CFG_MATCH, pool_name_from_key
from gpulock._protocol import Grant, NotGranted, new_id, retrying, translate, validate_pool_name
from gpulock.errors import BackendUnavailable, LeaseLost, PoolClosed, PoolNotFound
from gpulock.retry_after import from_expiry_ms

from .auth import Principal

log = logging.getLogger("gpulock.broker")

# A request the broker held at least this long (a long poll) is answered Retry-After: 0.
LONG_POLL_S = 1.0

__all__ = ["Broker", "ClientGone", "Granted", "Queued", "LeaseGone", "NotYours", "PoolBeingDeleted"]


class LeaseGone(Exception):
    """The lease is not held any more (410). ``outcome``: "lost" or "released"."""

    def __init__(self, lease_id: str, outcome: str, message: str):
        super().__init__(message)
        self.lease_id, self.outcome = lease_id, outcome


class NotYours(Exception):
    """The lease exists but belongs to another token, or was not made through a broker (404)."""


class PoolBeingDeleted(BackendUnavailable):
    """A forced delete of the pool is under way (503, Retry-After: 1; a retry finds it gone)."""


class ClientGone(Exception):
    """The client closed its connection during the long poll: its request was withdrawn (it
    left the queue, or the grant that raced the hang-up was released)."""


@dataclass(frozen=True)
class Granted:
    pool: str
    request_id: str
    grant: Grant
    ttl_s: float
    acquired_ms: int  # server clock, when the grant was made


@dataclass(frozen=True)
class Queued:
    """Not granted within ``wait``: ``queued`` (the place is kept ``hold_s``) or not queued
    (``queue=False``)."""

    request_id: str
    queued: bool
    position: int
    queue_length: int
    retry_after_s: int
    hold_s: float


@dataclass
class _Parked:
    attached: int = 0
    until: float = 0.0
    inflight: set = field(default_factory=set)
    keeper: asyncio.Task | None = None
    granted_ms: int = 0  # server time of a grant the keeper caught


@dataclass
class _LeaseRec:
    pool: str
    lease_id: str
    owner: str
    token: int
    ttl_s: float
    ticket: str
    amount: int
    expires_local: float = 0.0  # local monotonic estimate of the server expiry (for cleanup)
    releasing: asyncio.Task | None = None


@dataclass
class _Tomb:
    pool: str
    owner: str
    outcome: str  # "released" | "lost"
    at: float


class Broker:
    """The HTTP lease API's engine, independent of HTTP (the router in ``api.py`` maps its
    results and errors to status codes).

    Args:
        redis_url: the Redis holding the pools: any URL of :mod:`gpulock._connect`
            (redis://, rediss://, unix://, redis+sentinel://).
        tokens: the principals (see :func:`~gpulock_broker.auth.load_tokens`).
        max_wait: the longest a POST is held while queued, seconds.
        backend_timeout: the longest a request waits for Redis before answering 503, seconds
            (the call itself finishes in the background, and what it did is kept track of).
        park_max: the longest a place is kept after a 503, seconds.
        retry_after_max: the largest Retry-After sent, seconds.
        redis_max_connections: the bound on the broker's Redis connections (one per pool name
            goes to its pub/sub subscription).
    """

    def __init__(
        self,
        redis_url: str,
        tokens: Iterable[Principal],
        *,
        max_wait: float = 20.0,
        backend_timeout: float = 3.0,
        park_max: float = 30.0,
        retry_after_max: int = 5,
        waiter_ttl: float = 5.0,
        poll_interval: float = 1.0,
        redis_max_connections: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ):
        from .auth import TokenStore

        self.redis_url = redis_url
        self.tokens = TokenStore(tokens)
        self.max_wait = max_wait
        self.backend_timeout = backend_timeout
        self.park_max = park_max
        self.retry_after_max = retry_after_max
        self.waiter_ttl = waiter_ttl
        self.poll_interval = poll_interval
        self.redis_max_connections = redis_max_connections
        self.clock = clock
        self._redis: aioredis.Redis | None = None
        self._pools: dict[str, AsyncPool] = {}
        self._parked: dict[tuple[str, str], _Parked] = {}
        self._handed: dict[tuple[str, str], str] = {}  # (pool, ticket) -> lease id given in a 201
        self._leases: dict[str, _LeaseRec] = {}
        self._tombs: OrderedDict[str, _Tomb] = OrderedDict()
        self._background: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None
        self._deleting: dict[str, int] = {}  # pools being deleted by force (count of deletes)
        self._retired: weakref.WeakSet[AsyncPool] = (
            weakref.WeakSet()
        )  # pool objects closed by a delete
        self.tomb_ttl = 3600.0
        self.max_tombs = 100_000

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self._redis is None:
            # A bounded pool: requests beyond it wait for a connection (waiting for a grant
            # holds none). Each pool name's pub/sub subscription takes one of them for good.
            # gpulock._connect: the library's one URL parser and connector (redis://,
            # rediss://, unix://, redis+sentinel://).
            self._redis = async_client(
                self.redis_url,
                max_connections=self.redis_max_connections,
                socket_timeout=min(2.0, self.backend_timeout),
                socket_connect_timeout=min(1.0, self.backend_timeout),
                health_check_interval=10,
            )
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep_loop(), name="gpulock-broker-sweeper"
            )

    async def aclose(self) -> None:
        """Stop; queued places are withdrawn (best effort), granted leases stay (they expire)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except (asyncio.CancelledError, Exception):
                pass
            self._sweeper = None
        for (pool, ticket), e in list(self._parked.items()):
            if e.keeper is not None:
                e.keeper.cancel()
            if (pool, ticket) not in self._handed and pool in self._pools:
                try:
                    await asyncio.wait_for(self._pools[pool].cancel_remote(ticket), 1.0)
                except Exception:
                    pass
        self._parked.clear()
        for p in list(self._pools.values()):
            await p.aclose()
        self._pools.clear()
        for t in list(self._background):  # keepers, and Redis calls that outlived a request
            t.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    def _client(self) -> aioredis.Redis:
        if self._redis is None:
            raise BackendUnavailable("the lease broker is not started")
        return self._redis

    def _pool(self, name: str) -> AsyncPool:
        if name in self._deleting:
            raise PoolBeingDeleted(f"pool {name!r} is being deleted; retry")
        p = self._pools.get(name)
        if p is None:
            p = AsyncPool(
                self._client(),
                validate_pool_name(name),
                waiter_ttl=self.waiter_ttl,
                poll_interval=self.poll_interval,
                backend_timeout=self.backend_timeout,
            )
            self._pools[name] = p
        return p

    async def _drop_pool_if_idle(self, name: str) -> None:
        """Forget a pool object that turned out not to exist, so requests for made-up pool
        names do not pile up subscriptions."""
        p = self._pools.get(name)
        if p is None or p._runtime.waiters or any(k[0] == name for k in self._parked):
            return
        if any(r.pool == name for r in self._leases.values()):
            return
        del self._pools[name]
        await p.aclose()

    def _spawn(self, aw: Awaitable) -> asyncio.Task:
        t = asyncio.ensure_future(aw)
        self._background.add(t)
        t.add_done_callback(self._background.discard)
        t.add_done_callback(lambda t: t.cancelled() or t.exception())  # consume the error
        return t

    async def _guard(self, aw: Awaitable, entry: _Parked | None = None) -> Any:
        """Await a Redis operation for at most ``backend_timeout`` seconds. On timeout raise
        BackendUnavailable; the operation goes on in the background (it may have queued or
        granted: its place is parked like any other, and withdrawn if nobody comes back)."""
        t = aw if isinstance(aw, asyncio.Future) else self._spawn(aw)
        if entry is not None:
            entry.inflight.add(t)
            t.add_done_callback(entry.inflight.discard)
        done, _ = await asyncio.wait((t,), timeout=self.backend_timeout)
        if not done:
            raise BackendUnavailable(f"Redis did not answer within {self.backend_timeout:g}s")
        return t.result()

    # ---- acquire -----------------------------------------------------------------------------
    def _ticket(self, who: Principal, request_id: str) -> str:
        return f"{who.id}:{request_id}"

    async def acquire(
        self,
        who: Principal,
        pool: str,
        amount: int,
        *,
        ttl: float,
        wait: float,
        queue: bool = True,
        holder: dict[str, Any] | None = None,
        request_id: str | None = None,
        gone: asyncio.Future | None = None,
    ) -> Granted | Queued:
        """Grant now, or within ``wait`` seconds, or report the place (kept for a retry).
        ``gone``: a future that turns true when the HTTP client hung up (see
        ``gpulock._disconnect.watch_disconnect``); the long poll then ends at once and the request
        is withdrawn (unless another retry of it is attached), so it is never granted.

        Raises: CapacityExceeded, PoolNotFound, QueueFull, InvalidArgument, BackendUnavailable,
        ClientGone."""
        rid = request_id or new_id()
        ticket = self._ticket(who, rid)
        p = self._pool(pool)
        meta = {**(holder or {}), "owner": who.id, "principal": who.name, "via": "broker"}
        key = (pool, ticket)
        entry = self._parked.setdefault(key, _Parked())
        entry.attached += 1
        final = False  # granted, or nothing was queued: no place to keep

        def enqueue():
            return p.enqueue_remote(amount, request_id=ticket, ttl=ttl, holder=meta, queue=queue)

        start = self.clock()
        try:
            res: Grant | NotGranted = await self._guard(enqueue(), entry)
            if isinstance(res, NotGranted) and res.queued and wait > 0:
                wt = asyncio.ensure_future(p.wait_remote(ticket, min(wait, self.max_wait)))
                if gone is not None and not (gone.done() and not _true(gone)):
                    await asyncio.wait((wt, gone), return_when=asyncio.FIRST_COMPLETED)
                if _true(gone):
                    wt.cancel()
                    final = True  # nothing to keep: nobody will come back for this answer
                    if entry.attached == 1:  # no retry of it is waiting here
                        await self._guard(
                            p.cancel_remote(ticket), entry
                        )  # leaves, or releases the raced grant
                    raise ClientGone(rid)
                g = await wt
                # No grant: ask again (idempotent) for the fresh position and retry-after.
                res = g if g is not None else await self._guard(enqueue(), entry)
            if isinstance(res, Grant):
                final = True
                acquired_ms = entry.granted_ms or res.expires_ms - round(ttl * 1000)
                entry.granted_ms = 0
                if res.expires_ms - res.now_ms < ttl * 500:
                    # A grant that waited for its client (parked): give the client a full ttl.
                    try:
                        exp, now = await self._guard(p.renew_remote(res.lease_id, res.token, ttl))
                        res = dataclasses.replace(res, expires_ms=exp, now_ms=now)
                    except (LeaseLost, BackendUnavailable):
                        pass  # as it is: the client's first renewal tells
                return self._granted(who, pool, rid, ticket, ttl, res, acquired_ms)
            if not res.queued:
                final = True  # queue=False and busy: no place was taken
            if res.queued and self.clock() - start >= LONG_POLL_S:
                ra = 0  # it long-polled: pacing is done; come back now to go on waiting
            else:
                ra = from_expiry_ms(res.retry_after_ms, self.retry_after_max)
            hold = min(self.park_max, max(self.waiter_ttl, 2.0 * ra + 2.0))
            entry.until = max(entry.until, self.clock() + hold)
            return Queued(rid, res.queued, res.position, res.queue_length, ra, hold)
        except PoolNotFound:
            final = True
            self._spawn(self._drop_pool_if_idle(pool))
            raise
        except PoolClosed:
            final = True
            if p in self._retired:  # the pool was deleted while this request waited
                raise PoolNotFound(pool) from None
            raise BackendUnavailable("the lease broker is shutting down") from None
        finally:
            entry.attached -= 1
            if not final:
                entry.until = max(entry.until, self.clock() + self.waiter_ttl)
                if self._parked.setdefault(key, entry) is entry and entry.keeper is None:
                    entry.keeper = self._spawn(self._keep(key, entry, p, ticket, ttl))
            elif not entry.attached and not entry.inflight and self._parked.get(key) is entry:
                del self._parked[key]

    async def _keep(
        self, key: tuple[str, str], entry: _Parked, p: AsyncPool, ticket: str, ttl: float
    ) -> None:
        """While a request is parked, catch a grant that lands for it and keep that lease alive
        (renew at ttl/3) until the client collects it or the hold window ends (then the sweeper
        withdraws it). One coroutine per parked request: no thread, no connection."""
        try:
            while True:
                if self._parked.get(key) is not entry or key in self._handed:
                    return
                left = entry.until - self.clock()
                if left <= 0:
                    return
                t0 = self.clock()
                g = await p.wait_remote(ticket, left)
                if g is not None:
                    entry.granted_ms = g.now_ms  # the hand-off's server time
                    break
                if self.clock() - t0 < left * 0.5:
                    return  # not queued here (refused, or withdrawn)
            while True:
                await asyncio.sleep(ttl / 3)
                if (
                    self._parked.get(key) is not entry
                    or key in self._handed
                    or self.clock() > entry.until
                ):
                    return
                try:
                    await p.renew_remote(g.lease_id, g.token, ttl)
                except LeaseLost:
                    return
                except Exception:
                    continue
        finally:
            entry.keeper = None

    def _granted(
        self,
        who: Principal,
        pool: str,
        rid: str,
        ticket: str,
        ttl: float,
        g: Grant,
        acquired_ms: int,
    ) -> Granted:
        self._parked.pop((pool, ticket), None)
        rec = self._leases.get(g.lease_id)
        if rec is None:
            rec = _LeaseRec(pool, g.lease_id, who.id, g.token, ttl, ticket, g.amount)
            self._leases[g.lease_id] = rec
            self._handed[(pool, ticket)] = g.lease_id
        rec.expires_local = self.clock() + max(0, g.expires_ms - g.now_ms) / 1000
        return Granted(pool, rid, g, ttl, acquired_ms)

    async def cancel(self, who: Principal, pool: str, request_id: str) -> int:
        """Withdraw a request: 0 nothing, 1 left the queue, 2 its grant was released."""
        ticket = self._ticket(who, request_id)
        self._parked.pop((pool, ticket), None)
        p = self._pool(pool)
        what = await self._guard(p.cancel_remote(ticket))
        lid = self._handed.get((pool, ticket))
        if lid and lid in self._leases:
            self._forget(self._leases[lid], "released")
        return what

    # ---- renew / release ---------------------------------------------------------------------
    def _forget(self, rec: _LeaseRec, outcome: str) -> None:
        self._leases.pop(rec.lease_id, None)
        if self._handed.get((rec.pool, rec.ticket)) == rec.lease_id:
            del self._handed[(rec.pool, rec.ticket)]
        self._tombs[rec.lease_id] = _Tomb(rec.pool, rec.owner, outcome, self.clock())
        self._tombs.move_to_end(rec.lease_id)
        while len(self._tombs) > self.max_tombs:
            self._tombs.popitem(last=False)

    async def _find(self, who: Principal, pool: str, lease_id: str) -> _LeaseRec:
        rec = self._leases.get(lease_id)
        if rec is None or rec.pool != pool:
            tomb = self._tombs.get(lease_id)
            if tomb is not None and tomb.pool == pool:
                if tomb.owner != who.id:
                    raise NotYours(lease_id)
                raise LeaseGone(lease_id, tomb.outcome, _gone_message(lease_id, tomb.outcome))
            rec = await self._lookup(pool, lease_id)
        if rec.owner != who.id:
            raise NotYours(lease_id)
        return rec

    async def _lookup(self, pool: str, lease_id: str) -> _LeaseRec:
        """A lease this broker has no record of (it restarted, or another broker granted it):
        read its owner from the holder metadata in Redis."""
        try:
            st = await self._guard(self._pool(pool).status(limit=100_000))
        except PoolNotFound:
            st = None
        info = next((x for x in st.leases if x.lease_id == lease_id), None) if st else None
        if info is None:
            raise LeaseGone(lease_id, "lost", _gone_message(lease_id, "unknown"))
        owner = info.holder.get("owner")
        if not isinstance(owner, str):
            raise NotYours(lease_id)
        rec = _LeaseRec(
            pool,
            lease_id,
            owner,
            info.token,
            info.ttl,
            info.request_id,
            info.amount,
            self.clock() + info.expires_in,
        )
        self._leases[lease_id] = rec
        return rec

    async def renew(
        self, who: Principal, pool: str, lease_id: str, ttl: float | None
    ) -> tuple[_LeaseRec, int, int]:
        """Returns (record, expires_ms, server_now_ms). Raises LeaseGone, NotYours,
        BackendUnavailable."""
        rec = await self._find(who, pool, lease_id)
        ttl_s = rec.ttl_s if ttl is None else ttl
        try:
            exp, now = await self._guard(self._pool(pool).renew_remote(lease_id, rec.token, ttl_s))
        except LeaseLost:
            if self._leases.get(lease_id) is rec:
                self._forget(rec, "lost")
            raise LeaseGone(lease_id, "lost", _gone_message(lease_id, "lost")) from None
        rec.ttl_s = ttl_s
        rec.expires_local = self.clock() + max(0, exp - now) / 1000
        return rec, exp, now

    async def release(self, who: Principal, pool: str, lease_id: str) -> int | None:
        """Release; returns the server time (ms) of the release, None when it was released
        before (idempotent). Raises LeaseGone (lost), NotYours, BackendUnavailable."""
        try:
            rec = await self._find(who, pool, lease_id)
        except LeaseGone as e:
            if e.outcome == "released":
                return None
            raise
        if rec.releasing is None or (
            rec.releasing.done() and rec.releasing.exception() is not None
        ):
            rec.releasing = self._spawn(self._release(rec))
        ok, now = await self._guard(rec.releasing)
        if not ok:
            raise LeaseGone(lease_id, "lost", _gone_message(lease_id, "lost"))
        return now

    async def _release(self, rec: _LeaseRec) -> tuple[bool, int]:
        ok, now = await self._pool(rec.pool).release_remote(rec.lease_id, rec.token)
        if self._leases.get(rec.lease_id) is rec:
            self._forget(rec, "released" if ok else "lost")
        return ok, now

    # ---- pools -------------------------------------------------------------------------------
    async def status(self, pool: str, limit: int = 1000):
        return await self._guard(self._pool(pool).status(limit=limit))

    async def pool_names(self) -> list[str]:
        """Every pool configured in Redis, sorted (the key shape is gpulock._keys')."""
        redis = self._client()

        async def scan() -> list[str]:
            # A read: retried on the core's policy (a connection that Redis dropped, as after
            # a restart, was a 500 on the first call), then the core's errors (503).
            try:
                async for attempt in retrying(self.backend_timeout, asynchronous=True):
                    with attempt:
                        names = {
                            pool_name_from_key(k)
                            async for k in redis.scan_iter(match=POOL_CFG_MATCH, count=1000)
                        }
            except Exception as e:  # noqa: BLE001 - translated to gpulock's tree
                raise translate(e, "*") from e
            return sorted(n for n in names if n)

        return await self._guard(scan())

    async def configure(
        self, pool: str, capacity: int, max_waiters: int | None, max_ttl: float | None = None
    ) -> dict[str, Any]:
        """Create or change a pool; ``max_waiters``/``max_ttl`` None keep the pool's current
        values (the library's defaults for a new pool). Returns the configure reply with
        ``max_ttl`` (seconds) added."""
        p = self._pool(pool)
        if max_waiters is None or max_ttl is None:
            try:
                st = await self._guard(p.status(limit=0))
                max_waiters = st.max_waiters if max_waiters is None else max_waiters
                if max_ttl is None and st.max_ttl:
                    max_ttl = st.max_ttl
            except PoolNotFound:
                pass
        r: dict[str, Any] = await self._guard(
            p.configure(capacity, max_waiters=max_waiters, max_ttl=max_ttl)
        )
        return {**r, "max_ttl": p.max_ttl}

    async def delete_pool(self, pool: str, *, force: bool = False) -> DeleteResult:
        """Delete a pool in Redis (gpulock._admin's script: refused while leases or waiters are
        live unless ``force``), then forget what this broker kept for it.

        With ``force``, this broker's own waiters on the pool are withdrawn first (their long
        polls answer 404, as for any pool that is gone): otherwise the pool's runtime, which
        keeps them queued, would see the pool gone and make it again. Requests for the pool
        that arrive meanwhile are answered 503 (:class:`PoolBeingDeleted`; a retry then sees
        the pool gone). Leases granted through the broker answer 410 at their next renewal.

        Raises: InvalidArgument, BackendUnavailable."""
        validate_pool_name(pool)
        redis = self._client()
        if force:
            self._deleting[pool] = self._deleting.get(pool, 0) + 1
        try:
            if force:
                await self._retire(pool)
            r: DeleteResult = await self._guard(adelete_pool(redis, pool, force=force))
        finally:
            if force:
                self._deleting[pool] -= 1
                if not self._deleting[pool]:
                    del self._deleting[pool]
        if r.state == "deleted":
            for rec in [x for x in self._leases.values() if x.pool == pool]:
                self._forget(rec, "lost")
            await self._retire(pool)  # with force: a request that raced the delete
        return r

    async def _retire(self, pool: str) -> None:
        """Close this broker's pool object for ``pool``: its waiters' waits end (PoolClosed,
        answered 404 in acquire), its parked places and their keepers are dropped. A closed
        runtime neither refreshes nor re-creates anything, so a request that raced this with
        the old object only finds the pool gone."""
        for key in [k for k in self._parked if k[0] == pool]:
            e = self._parked.pop(key)
            if e.keeper is not None:
                e.keeper.cancel()
        p = self._pools.pop(pool, None)
        if p is not None:
            self._retired.add(p)
            await p.aclose()

    # ---- housekeeping ------------------------------------------------------------------------
    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            try:
                self.sweep()
            except Exception:
                log.exception("gpulock broker: sweep failed")

    def sweep(self) -> None:
        """Withdraw places nobody came back for; forget records of long-expired leases."""
        now = self.clock()
        for key, e in list(self._parked.items()):
            if e.attached or e.inflight or e.until > now:
                continue
            del self._parked[key]
            pool, ticket = key
            if key in self._handed or pool not in self._pools:
                continue
            self._spawn(self._withdraw(pool, ticket))
        for rec in [
            r for r in self._leases.values() if r.releasing is None and now > r.expires_local + 60
        ]:
            self._forget(rec, "lost")
        while self._tombs:
            lid, t = next(iter(self._tombs.items()))
            if now - t.at < self.tomb_ttl:
                break
            self._tombs.popitem(last=False)

    async def _withdraw(self, pool: str, ticket: str) -> None:
        try:
            what = await self._pools[pool].cancel_remote(ticket)
            if what == 2:
                log.info(
                    "gpulock broker: released a grant on pool %s that its client did not collect",
                    pool,
                )
        except Exception as e:  # the waiter expires after waiter_ttl, a grant after its ttl
            log.info("gpulock broker: could not withdraw a parked request on pool %s: %s", pool, e)


def _true(f: asyncio.Future | None) -> bool:
    return (
        f is not None
        and f.done()
        and not f.cancelled()
        and f.exception() is None
        and bool(f.result())
    )


def _gone_message(lease_id: str, outcome: str) -> str:
    short = lease_id[:8]
    if outcome == "released":
        return f"lease {short}… was released"
    if outcome == "unknown":
        return (
            f"lease {short}… is not held: it expired on the server (no renewal within its ttl), "
            f"was released, or never existed; nothing was freed"
        )
    return (
        f"lease {short}… is lost: it expired on the server (no renewal within its ttl) or the "
        f"pool was reset; nothing of other holders was freed"
    )
