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

``Retry-After`` (whole seconds) paces clients that do not long-poll: the server's wait
estimate (the 503's ``estimated_wait_s``; while the pool's drain rate is not measured, the
script's time to the nearest lease expiry) put through the policy the FastAPI service shares
(``gpulock.retry_after``): at least the grace period left, at most ``park_max / 2`` (or the
grace left) for a request whose place is kept, in [1, retry_after_max];
``hold = min(park_max, max(waiter_ttl, 2 * Retry-After + 2))`` plus the grace period left
(the rule the FastAPI service shares, ``gpulock.http.places``), so a client honouring it (with
up to +30% jitter) keeps its place, and keeps it for as long as it keeps coming back. While parked, one coroutine per request catches a grant
that lands and renews it (ttl/3) until the client collects it or the window ends; a grant
collected with less than half its ttl left is renewed once more, so the client starts with a
full ttl. A request the broker held for at least ``LONG_POLL_S`` (outside a grace period) was paced by that wait
already, and a grant may land any moment: it gets ``Retry-After: 0`` (come back now and go on
waiting), so a long-polling client is never away while its grant sits unused.

Leases are renewed and released only by the token that acquired them: the broker records the
token's identity (a hash prefix, see ``auth.py``) with the lease, in memory and in the holder
metadata in Redis (``owner``), so a restarted broker can still check it.

:class:`Broker` composes the parts, one module each: :mod:`.outcomes` (results and errors),
:mod:`.tasks` (background tasks, the bound on a wait for Redis), :mod:`.pools` (the pool
objects and pool-wide operations), :mod:`.leases` (lease records, renew, release),
:mod:`.parking` (the parked places, their keepers, cancel), :mod:`.acquire` (one request) and
:mod:`.growths` (a lease's resize, and a growth that waits across requests as an acquire does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterable, Mapping

from gpulock_common.aio import stop_tasks
from gpulock_common.options import AcquireOptions, PoolSettings

from gpulock.admin.pools import DeleteResult
from gpulock.dashboard.view import dashboard_view
from gpulock.admin.listing import Listing
from gpulock.admin.samples import Sampler, count_event
from gpulock.protocol.replies import Renewal

from .acquire import LONG_POLL_S, Acquirer
from .auth import Principal
from .growths import Growing, Growths, Resized
from .leases import LeaseRecord, Leases
from .outcomes import ClientGone, Granted, LeaseGone, NotYours, PoolBeingDeleted, Queued
from .parking import Parking
from .pools import Holders, Pools
from .tasks import Tasks

log = logging.getLogger("gpulock.broker")

#: How often the sweeper forgets the records of long-expired leases, seconds.
SWEEP_INTERVAL_S = 0.25

__all__ = [
    "LONG_POLL_S",
    "Broker",
    "ClientGone",
    "Granted",
    "Growing",
    "LeaseGone",
    "NotYours",
    "PoolBeingDeleted",
    "Queued",
    "Resized",
]


class Broker:
    """The HTTP lease API's engine, independent of HTTP (the router in ``api.py`` maps its
    results and errors to status codes).

    Args:
        redis_url: the Redis holding the pools: any URL of :mod:`gpulock.transport.connect`
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
        self._tasks = Tasks(backend_timeout)
        self._poolset = Pools(
            redis_url,
            self._tasks,
            waiter_ttl=waiter_ttl,
            poll_interval=poll_interval,
            backend_timeout=backend_timeout,
            max_connections=redis_max_connections,
            in_use=lambda name: self._parking.holds(name) or self._leases.holds(name),
            on_retire=self._retire,
            on_deleted=lambda name: self._leases.forget_pool(name),
        )
        self._leases = Leases(self._poolset, self._tasks, clock)
        self._parking = Parking(
            self._poolset,
            self._leases,
            self._tasks,
            waiter_ttl=waiter_ttl,
            park_max=park_max,
            clock=clock,
        )
        self._acquirer = Acquirer(
            self._poolset,
            self._parking,
            self._leases,
            self._tasks,
            max_wait=max_wait,
            retry_after_max=retry_after_max,
            clock=clock,
        )
        self._growths = Growths(
            self._poolset,
            self._leases,
            self._tasks,
            waiter_ttl=waiter_ttl,
            park_max=park_max,
            max_wait=max_wait,
            retry_after_max=retry_after_max,
            clock=clock,
        )
        self._sweeper: asyncio.Task | None = None
        self._sampler: asyncio.Task | None = None

    @property
    def tomb_ttl(self) -> float:
        """How long an ended lease is remembered, seconds."""
        return self._leases.tomb_ttl

    @tomb_ttl.setter
    def tomb_ttl(self, value: float) -> None:
        self._leases.tomb_ttl = value

    @property
    def max_tombs(self) -> int:
        """The most ended leases remembered."""
        return self._leases.max_tombs

    @max_tombs.setter
    def max_tombs(self, value: int) -> None:
        self._leases.max_tombs = value

    @property
    def _pools(self) -> Mapping[str, Holders]:
        """The open pool objects' remote holders by name (read-only view)."""
        return self._poolset.objects

    @property
    def _deleting(self) -> Mapping[str, int]:
        """The pools a forced delete is under way for (read-only view)."""
        return self._poolset.deleting

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        self._poolset.connect()
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep_loop(), name="gpulock-broker-sweeper"
            )
        if self._sampler is None:
            # the pools' history for the dashboard (gpulock.admin.samples): every broker and service
            # worker runs one; each pool's sampler lease lets one of them write
            sampler = Sampler(self._poolset.client(), self.pool_names, self.status)
            self._sampler = asyncio.get_running_loop().create_task(
                sampler.run(), name="gpulock-broker-sampler"
            )

    async def aclose(self) -> None:
        """Stop; queued places are withdrawn (best effort), granted leases stay (they expire)."""
        await stop_tasks(t for t in (self._sampler, self._sweeper) if t is not None)
        self._sampler = self._sweeper = None
        await self._parking.aclose()
        await self._growths.aclose()
        await self._poolset.close_pools()
        await self._tasks.aclose()  # keepers, and Redis calls that outlived a request
        await self._poolset.disconnect()

    # ---- requests ----------------------------------------------------------------------------
    async def acquire(
        self,
        who: Principal,
        pool: str,
        amount: int,
        options: AcquireOptions,
        *,
        wait: float,
        queue: bool = True,
        gone: asyncio.Future | None = None,
    ) -> Granted | Queued:
        """Grant now, or within ``wait`` seconds, or report the place (kept for a retry); a
        grant made after this request queued says the place it took (:class:`Granted`'s
        ``queued``; None: granted at once). ``options``: the acquire's (:meth:`gpulock.AsyncPool.acquire`; its ``ttl`` given, its
        ``timeout`` and ``tenant`` unused: the tenant is the token's); a retry of a queued
        request keeps its first place. ``gone``: a future that turns true when the HTTP client
        hung up (see ``gpulock.http.disconnect.watch_disconnect``); the long poll then ends at
        once and the request is withdrawn (unless another retry of it is attached), so it is
        never granted.

        Raises: CapacityExceeded, PoolNotFound, QueueFull, InvalidArgument, BackendUnavailable,
        ClientGone."""
        return await self._acquirer.acquire(
            who, pool, amount, options, wait=wait, queue=queue, gone=gone
        )

    async def cancel(self, who: Principal, pool: str, request_id: str) -> int:
        """Withdraw a request: 0 nothing, 1 left the queue, 2 its grant was released."""
        return await self._parking.cancel(who, pool, request_id)

    async def renew(
        self, who: Principal, pool: str, lease_id: str, ttl: float | None
    ) -> tuple[LeaseRecord, Renewal]:
        """Returns (record, the server's :class:`Renewal`: expires_ms, server_now_ms,
        yield_deadline_ms). Raises LeaseGone, NotYours, BackendUnavailable."""
        return await self._leases.renew(who, pool, lease_id, ttl)

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
        """Resize ``who``'s lease to ``amount`` bytes: the lease as it is now, or a growth that
        still waits after ``wait`` seconds (kept for a retry; :meth:`.growths.Growths.resize`).

        Raises: LeaseGone, NotYours, InvalidArgument, CapacityExceeded, ResizeRefused,
        QueueFull, AcquireTimeout, PoolNotFound, BackendUnavailable, ClientGone."""
        return await self._growths.resize(
            who, pool, lease_id, amount, timeout, wait=wait, gone=gone
        )

    async def release(self, who: Principal, pool: str, lease_id: str) -> int | None:
        """Release; returns the server time (ms) of the release, None when it was released
        before (idempotent). Raises LeaseGone (lost), NotYours, BackendUnavailable."""
        return await self._leases.release(who, pool, lease_id)

    # ---- pools -------------------------------------------------------------------------------
    async def status(self, pool: str, limit: int = 1000):
        """The pool's status (:meth:`gpulock.AsyncPool.status`), at most ``limit`` leases."""
        return await self._poolset.status(pool, limit)

    async def pool_names(self) -> list[str]:
        """Every pool configured in Redis that could be read, sorted."""
        return await self._poolset.names()

    async def pool_listing(self) -> Listing:
        """Every pool configured in Redis, and the shards of a Redis Cluster that could not be
        read (their pools left out; :meth:`.pools.Pools.listing`)."""
        return await self._poolset.listing()

    async def dashboard(self) -> dict[str, Any]:
        """The live view of every pool (:func:`gpulock.dashboard.view.dashboard_view`), naming the
        shards of a Redis Cluster that could not be read."""
        listing = await self.pool_listing()
        return await self._tasks.guard(
            dashboard_view(
                self._poolset.client(),
                listing.names,
                self.status,
                unreachable=listing.unreachable,
                # a pool that does not answer is an error of its own, not a 503 of the view
                read_timeout=self.backend_timeout / 2,
            )
        )

    def count_event(self, pool: str, event: str) -> None:
        """Add one to the pool's ``event`` counter (``rejected``: a 503) for the dashboard, in
        the background (the answer does not wait for it; a failure only loses the count)."""
        try:
            self._tasks.spawn(count_event(self._poolset.client(), pool, event))
        except Exception as e:  # noqa: BLE001 - not connected: a count is not worth an error
            log.debug("gpulock broker: counting %s for %s failed: %s", event, pool, e)

    async def configure(self, pool: str, settings: PoolSettings) -> dict[str, Any]:
        """Create or change a pool (see :meth:`.pools.Pools.configure`)."""
        return await self._poolset.configure(pool, settings)

    async def delete_pool(self, pool: str, *, force: bool = False) -> DeleteResult:
        """Delete a pool in Redis and forget what this broker kept for it (see
        :meth:`.pools.Pools.delete`). Raises: InvalidArgument, BackendUnavailable."""
        return await self._poolset.delete(pool, force=force)

    def _retire(self, name: str) -> None:
        """Drop what is kept for the requests on pool ``name`` (its pool object is closed)."""
        self._parking.drop_pool(name)
        self._growths.drop_pool(name)

    # ---- housekeeping ------------------------------------------------------------------------
    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                self.sweep()
            except Exception:
                log.exception("gpulock broker: sweep failed")

    def sweep(self) -> None:
        """Forget records of long-expired leases (places nobody came back for are withdrawn by
        their own timers, :class:`gpulock.http.places.KeptPlaces`)."""
        self._leases.sweep(self.clock())
