"""The asyncio shell: :class:`AsyncPool` and :class:`AsyncLease`. The protocol is written once
in ``protocol/flow.py`` (over the core's I/O-free modules: ``protocol/args.py``, ``protocol/replies.py``,
``protocol/request.py`` and the others), the background work in ``runtime/runtime.py``; this file is their
asyncio driver: it carries out the steps of a flow and adds only the I/O."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType
from typing import Any, Callable, Generator, Mapping, Sequence, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, RedisError

from gpulock_common.aio import pending_cancels, plain_or_coroutine
from gpulock_common.driver import adrive
from gpulock_common.options import PoolSettings, Preemption

from gpulock.protocol import flow
from gpulock.protocol.args import (
    DEFAULT_MAX_WAITERS,
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_TTL_S,
    DEFAULT_WAITER_TTL_S,
    PoolOptions,
)
from gpulock.protocol.keep import back_for_growth, take_for
from gpulock.protocol.lease import LeaseBase, default_clock
from gpulock.protocol.request import AcquireOptions, AcquireRequest
from gpulock.protocol.resize import resize_lease
from gpulock.protocol.replies import DeviceReply, PoolStatus
from gpulock.transport.retry import RETRYABLE, retrying
from gpulock.transport.translate import translate, translated
from gpulock.transport.batch import Batcher, inflight_for
from gpulock.transport.connect import DEFAULT_MAX_CONNECTIONS, async_client
from gpulock.protocol.keys import pool_keys
from gpulock.runtime.async_steps import carry_out
from gpulock.runtime.runtime import Runtime
from gpulock.transport.script_calls import AsyncScripts
from gpulock.errors import LeaseLost, PoolClosed

log = logging.getLogger("gpulock")

_T = TypeVar("_T")

DEFAULT_BACKEND_TIMEOUT_S = 5.0
_CLIENT_DEFAULTS = {
    "socket_timeout": 5.0,
    "socket_connect_timeout": 2.0,
    "health_check_interval": 10,
}


class AsyncLease(LeaseBase):
    """A lease held by this process (asyncio). Use as ``async with``; see :class:`LeaseBase`
    for the attributes. The pool's heartbeat renews it at ttl/3 until released."""

    __slots__ = ()

    async def release(self) -> None:
        """Give the bytes back. Idempotent: later calls do nothing.

        Raises:
            LeaseLost: the server no longer had this lease (it expired or was reaped, so
                someone else may have used the bytes meanwhile). Nothing of others is freed.
            BackendUnavailable: Redis could not be reached while the lease was valid (the
                release is retried until its local deadline); it expires on the server.
        """
        s = self._state
        if s.kept and s.keeper.put_back(s) is not None:
            return  # kept bytes, nobody waiting: no round trip (gpulock.protocol.keep)
        await self._pool._run(flow.release_lease(s, self._pool._runtime))

    async def resize(self, amount: int | str, *, timeout: float | None = None) -> None:
        """Change the lease's amount to ``amount`` (bytes or a size string, as ``acquire``'s);
        afterwards :attr:`amount` is the new amount; id and token do not change
        (docs/SEMANTICS.md, "Resizing a lease"). A shrink is immediate and its bytes go to
        the queue; the same amount does nothing (no call); a growth takes the difference as a
        request of that size of the lease's tenant, on its device, ordered at the lease's place
        in the queue (ahead of the new requests its request was ahead of): at once,
        or queued, waiting up to ``timeout`` seconds (``None``: forever; ``0``: never queued)
        while the lease keeps its bytes and its heartbeat.

        Raises:
            InvalidArgument (a bad amount or timeout, or a resident lease), LeaseLost (lost,
            expired or released), CapacityExceeded / QuotaExceeded / RoomExceeded (the new
            amount can never fit: at once), ResizeRefused (at once: waiting could only
            deadlock), QueueFull, AcquireTimeout (the lease keeps its amount),
            BackendUnavailable, PoolClosed. On cancellation the growth leaves the queue (a
            grant that raced in is undone) and the lease keeps its amount.
        """
        p = self._pool
        rt = p._runtime
        if rt.closed:
            raise PoolClosed(p.name, queued=False)
        back = back_for_growth(rt.kept, self._state, amount)
        if back:  # a growth: the idle kept bytes go back first (gpulock.protocol.keep)
            await rt.kept_back.release_now(back)
        steps = resize_lease(
            p, rt, self._state, amount, timeout, p.clock(), waiter_ttl_s=p.waiter_ttl
        )
        await p._run(steps, pending_cancels())

    def on_yield(self, callback: Callable[[Any], Any]) -> None:
        """Call ``callback(lease)`` once when the holder learns that the server asked it to
        yield this lease (:meth:`gpulock_common.lease.LeaseView.on_yield`); ``callback`` may
        be a plain function or a coroutine function, whose coroutine then runs as a task of
        the pool's event loop. An exception from either is logged, not raised. Raises
        TypeError when ``callback`` is not callable."""
        rt = self._pool._runtime
        call = plain_or_coroutine(
            callback, lambda c: rt.tasks.in_loop(lambda: rt.spawn(c)), "on_yield", log
        )
        self._state.add_yield_callback(call, self)

    async def __aenter__(self) -> "AsyncLease":
        return self

    async def __aexit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await asyncio.shield(self.release())
        except LeaseLost:
            if et is None:
                raise
        except asyncio.CancelledError:
            raise


class _AcquireCM:
    def __init__(self, pool: "AsyncPool", args: tuple[Any, ...], kw: dict[str, Any]):
        self._pool, self._args, self._kw = pool, args, kw
        self._lease: AsyncLease | None = None

    async def __aenter__(self) -> AsyncLease:
        self._lease = await self._pool.acquire(*self._args, **self._kw)
        return self._lease

    async def __aexit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._lease is not None  # __aexit__ runs only after __aenter__ returned
        await self._lease.__aexit__(et, ev, tb)

    def __await__(self) -> Generator[Any, None, AsyncLease]:
        return self._pool.acquire(*self._args, **self._kw).__await__()


class AsyncPool(PoolOptions):
    """One GPU-memory budget in Redis, used from asyncio code.

    ``AsyncPool(redis, "gpu0", capacity="24GiB")`` or ``AsyncPool.from_url(url, "gpu0")``.

    Args:
        redis: a ``redis.asyncio.Redis`` client (decode_responses may be on or off). The pool
            object keeps at most ``min(its max_connections, 16) - 2`` of its calls in flight on
            it; calls made meanwhile wait and go out together as one pipeline. Give it a
            ``BlockingConnectionPool`` to bound the connections of everything else on it too
            (``from_url`` does: ``max_connections``).
        name: the pool name, 1-64 of ``[A-Za-z0-9._-]``.
        capacity: bytes (or "24GiB"). When given, the pool is created with it if it does not
            exist yet; an existing capacity is not changed (use :meth:`configure` for that).
            After Redis lost a pool this object had seen, it is made again with the capacity,
            max_waiters and max_ttl last seen on the server (an operator's ``pool set`` wins),
            given or not: without it, an acquire of a pool this object never saw and Redis
            does not have raises PoolNotFound.
        default_ttl: lease ttl in seconds when ``acquire`` gets none (30 s).
        waiter_ttl: seconds a queued request survives without a refresh (5 s).
        poll_interval: seconds between waiter refreshes, which double as the backstop poll.
        backend_timeout: seconds of retrying a call with no deadline of its own (a timed
            acquire retries until its timeout, a release while valid) before BackendUnavailable.
        max_ttl: the longest ttl a lease may have in a pool this object creates (seconds;
            default the larger of 60 s and ``default_ttl``). It is also the length of the grace
            period after Redis lost the pool: nothing new is granted for one max_ttl while
            holders put their leases back (see docs/RELIABILITY.md).
        sync_replicas: with Redis replicas, return a grant (and count a renewal) only once this
            many replicas acknowledged it (``WAIT``), so that a failover to a replica cannot
            give the same bytes to someone else. 0 (the default): off. Costs one round trip
            plus the replication delay per grant (see docs/RELIABILITY.md).
        sync_timeout: seconds ``WAIT`` waits for the replicas; a grant not acknowledged by
            then is given back and the acquire raises BackendUnavailable.
        keep: seconds (0.1-3600) this pool object may keep a released lease's bytes, idle,
            to grant its own next request of the same kind from them without a round trip,
            while nobody waits; 0 (the default): off (docs/SEMANTICS.md, "Kept bytes").
        clock: a monotonic clock (seconds); tests inject one.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        name: str,
        *,
        capacity: int | str | None = None,
        default_ttl: float = DEFAULT_TTL_S,
        waiter_ttl: float = DEFAULT_WAITER_TTL_S,
        poll_interval: float = DEFAULT_POLL_INTERVAL_S,
        max_waiters: int = DEFAULT_MAX_WAITERS,
        backend_timeout: float = DEFAULT_BACKEND_TIMEOUT_S,
        max_ttl: float | None = None,
        sync_replicas: int = 0,
        sync_timeout: float = 1.0,
        keep: float = 0.0,
        clock: Callable[[], float] = default_clock,
        _owns_client: bool = False,
    ):
        self._set_options(
            name,
            capacity=capacity,
            default_ttl=default_ttl,
            waiter_ttl=waiter_ttl,
            poll_interval=poll_interval,
            max_waiters=max_waiters,
            backend_timeout=backend_timeout,
            max_ttl=max_ttl,
            sync_replicas=sync_replicas,
            sync_timeout=sync_timeout,
            keep=keep,
        )
        self.redis = redis
        self.clock = clock
        self._keys = pool_keys(self.name)
        self._runtime = Runtime(redis, self.name, self._keys, clock, poll_interval)
        self._runtime.kept.keep_s = self.keep
        # concurrent calls share round trips: the batcher sends each call's first try
        self._batch = Batcher(inflight_for(redis))
        self._scripts = AsyncScripts(redis, self._keys, first=self._batch.first)
        flow.push_settings(self, self._runtime)
        self._owns_client = _owns_client

    @classmethod
    def from_url(
        cls, url: str, name: str, *, max_connections: int = DEFAULT_MAX_CONNECTIONS, **kw: Any
    ) -> "AsyncPool":
        """Connect to a ``redis://``, ``rediss://``, ``unix://``, ``redis+sentinel://`` or
        ``redis+cluster://`` URL (no I/O until first use, but for the one ``INFO cluster`` a
        plain URL's first use in the process costs; Sentinel URLs: :mod:`gpulock.transport.connect`,
        cluster URLs: :mod:`gpulock.transport.cluster`).
        Socket timeouts default to 5 s (reads) and 2 s (connect) so a hung Redis surfaces as
        BackendUnavailable instead of a hang.

        ``max_connections`` (default 16, at least 2) caps the connections this pool object
        opens, its hand-off subscription included, however many acquires wait: a waiting
        acquire holds none, and calls that find every connection busy wait for one (up to the
        5 s socket timeout, within ``backend_timeout``'s retries). A ``?max_connections=N`` in
        the URL wins. Other arguments: as the constructor.

        Raises: InvalidArgument (a URL gpulock cannot use, naming it and the accepted schemes;
        a bad ``max_connections``; any bad argument of the constructor)."""
        client = async_client(url, max_connections=max_connections, **_CLIENT_DEFAULTS)
        return cls(client, name, _owns_client=True, **kw)

    # ---- the driver -------------------------------------------------------------------------
    async def _run(self, steps: flow.Flow[_T], cancels_before: int = 0) -> _T:
        """Carry out a flow of :mod:`gpulock.protocol.flow` (its steps' replies: there) and return its
        result. ``cancels_before``: the caller task's pending cancellations when it began. A
        step's error, a cancellation too, goes into the flow as gpulock's own (redis-py's
        translated): the flow decides (and re-raises)."""
        return await adrive(
            steps,
            lambda step: self._step(step, cancels_before),
            into=lambda e: translated(e, self.name),
        )

    async def _step(self, step: flow.Step, cancels_before: int) -> Any:
        rt = self._runtime
        if isinstance(step, flow.Eval):
            return await self._eval(step.script, step.args, bound=step.bound)
        if isinstance(step, flow.MakeLease):
            state = flow.lease_state(rt, step.grant, step.req, step.valid_until)
            return AsyncLease(state, self), state
        if isinstance(step, flow.GiveBack):
            try:
                await asyncio.shield(rt.spawn(step.lease.release()))
            except BaseException:  # noqa: BLE001 - lost or unreachable: it expires after its ttl
                pass
            return None
        return await carry_out(rt, step, cancels_before, self._cancel)

    async def _eval_once(self, name: str, args: list[str]) -> Any:
        try:
            return await self._scripts.call(name, args)
        except AuthenticationError as e:
            # redis-py makes it a ConnectionError; retrying bad credentials only delays the
            # message (by backend_timeout), so it leaves the retry loops here.
            raise translate(e, self.name) from e

    async def _eval(self, name: str, args: list[str], *, bound: float | None = None) -> Any:
        """EVALSHA with NOSCRIPT reload; retries connection errors (for idempotent scripts
        only: every gpulock script is idempotent by ticket or lease id) with jittered backoff
        for at most ``bound`` (default ``backend_timeout``) seconds, then raises
        BackendUnavailable. ``bound=0``: one try, a connection error or timeout raised as
        :class:`~gpulock.protocol.steps.Unanswered`. Other errors: translated."""
        if bound == 0:
            try:
                return await self._eval_once(name, args)
            except RETRYABLE as e:
                raise flow.Unanswered(str(translate(e, self.name))) from e
            except Exception as e:
                raise translate(e, self.name) from e
        try:
            try:
                return await self._eval_once(name, args)
            except RETRYABLE:
                pass
            # The retrier is built only after a failure: it costs ~10% of an uncontended call.
            async for attempt in retrying(
                self.backend_timeout if bound is None else bound, asynchronous=True
            ):
                with attempt:
                    return await self._eval_once(name, args)
        except Exception as e:
            raise translate(e, self.name) from e

    async def _cancel(self, script: str, args: list[str]) -> None:
        try:
            await self._eval(script, args)
        except Exception:
            pass  # unreachable Redis: the waiter expires after waiter_ttl, a grant after ttl

    # ---- operations -------------------------------------------------------------------------
    async def configure(
        self,
        capacity: int | str | None = None,
        *,
        max_waiters: int | None = None,
        max_ttl: float | None = None,
        create_only: bool = False,
        policy: str | None = None,
        backfill_window: float | None = None,
        quotas: Mapping[str, int | str | None] | None = None,
        devices: int | Sequence[int | str] | None = None,
        placement: str | None = None,
        preemption: Preemption | bool | None = None,
        _grace: bool = False,
    ) -> dict[str, Any]:
        """Create the pool or set its capacity (bytes or "8GiB"), queue bound, max_ttl
        (seconds; the longest ttl a lease may have, and the length of a grace period) and
        queue policy: ``policy`` "fifo" (a new pool's) or "backfill", ``backfill_window``
        (seconds, default 2 s: how long a head that does not fit may be passed by later
        requests that do; docs/SEMANTICS.md, "Backfill") and tenant quotas: ``quotas``
        maps a tenant to the bytes (or a size) its leases may hold together, 0 or None
        removing its quota; tenants not named keep theirs (docs/SEMANTICS.md, "Tenant
        quotas"). ``devices``: a count N (N devices of ``capacity`` each) or each device's
        capacity (a list; ``capacity`` then defaults to their sum), and ``placement``
        "bestfit" (a new pool's) or "spread": how a request without a device is placed
        (docs/SEMANTICS.md, "Devices and placement"). ``preemption``: a ``Preemption(gap,
        yield_grace_s)`` turns it on, False off (docs/SEMANTICS.md, "Preemption"). None
        leaves a setting as it is.
        Returns ``{"created", "capacity", "epoch", "used", "max_waiters", "policy",
        "backfill_window", "quotas", "devices", "placement", "preemption"}`` (preemption:
        ``{"gap", "yield_grace_s"}``, None when off; ``status()`` shows ``max_ttl`` and
        ``grace_left``). ``create_only`` on a pool object that had seen the pool
        (so Redis lost it) makes it again as last seen on the server, with a grace period; the
        values given count only for a pool it never saw.

        Raises: InvalidArgument (bad capacity), BackendUnavailable."""
        return await self._run(
            flow.configure(
                self,
                self._runtime,
                PoolSettings(
                    capacity,
                    max_waiters,
                    max_ttl,
                    policy,
                    backfill_window,
                    quotas,
                    devices,
                    placement,
                    preemption,
                ),
                create_only=create_only,
                grace=_grace,
            )
        )

    async def status(self, *, limit: int = 1000) -> PoolStatus:
        """A snapshot: capacity, used, leases and waiters (at most ``limit`` of each listed).

        Raises: PoolNotFound, BackendUnavailable."""
        return await self._run(flow.status(self, self._runtime, limit))

    async def device_report(
        self,
        sampler_id: str,
        claim_ms: int,
        external: int | None = None,
        report_ms: int = 0,
        overuse: str = "",
    ) -> DeviceReply:
        """The device sampler's call (:mod:`gpulock.devices.sampler`; ``lua/external.lua``):
        take or extend the pool's sampler claim for ``claim_ms`` ms and, with ``external``
        (bytes, 0 .. capacity), publish the report for ``report_ms`` ms with the over-users
        (``overuse``: JSON text). Raises InvalidArgument (naming a bad value; nothing written),
        PoolNotFound, BackendUnavailable."""
        return await self._run(
            flow.device_report(sampler_id, claim_ms, external, report_ms, overuse)
        )

    async def reap(self) -> int:
        """Reap expired leases and dead waiters now; returns how many leases were reaped."""
        return await self._run(flow.reap())

    def lease(self, amount: int | str, **kw: Any) -> _AcquireCM:
        """``async with pool.lease("2GiB", timeout=10) as lease:`` — acquire, and release on
        exit. Takes the arguments of :meth:`acquire`."""
        return _AcquireCM(self, (amount,), kw)

    async def acquire(
        self,
        amount: int | str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        holder: dict[str, Any] | None = None,
        request_id: str | None = None,
        on_queued: Callable[[int], Any] | None = None,
        priority: int = 0,
        tenant: str | None = None,
        device: int | None = None,
        resident: bool = False,
        preemptible: bool = True,
    ) -> AsyncLease:
        """Take ``amount`` bytes from the pool, waiting in the pool's queue (by priority, then
        first come first served: docs/SEMANTICS.md, "Priorities").

        Args:
            amount: bytes (int) or a size string ("4GiB").
            ttl: lease time to live in seconds (default ``default_ttl``); the heartbeat renews
                it every ttl/3 while the lease is held.
            timeout: seconds to wait; ``None`` waits forever, ``0`` tries once without queueing
                (granted only if it fits and would be ahead of every waiter, or, under the
                backfill policy, while the head's window is open).
            holder: metadata shown in status (host and pid are added).
            request_id: idempotency key (1-128 of ``[A-Za-z0-9._:-]``): a retry with the same id
                joins its earlier place in the queue or gets its earlier grant.
            on_queued: ``callback(position)`` when queued and at each refresh (every
                ``poll_interval``) where the position changed
                (it can grow when a request of higher effective priority arrives).
                ``position`` is a :class:`gpulock_common.queue.QueuePlace`: the 1-based int,
                with ``.estimated_wait`` (seconds, None while the pool's drain rate is not
                measured; docs/SEMANTICS.md, "Wait estimate") and ``.queue_length``.
            priority: an integer in [-100, 100], higher goes first (default 0); a queued
                request gains one level per second waited (aging), so none starves.
            tenant: who the lease's bytes count under (1-64 of ``[A-Za-z0-9._:-]``; default
                none): where the pool has a quota for it (``configure(quotas=...)``), the
                tenant's leases together never exceed it, and a request waits while they
                would (docs/SEMANTICS.md, "Tenant quotas").
            device: on a pool of several devices, the index of the device the lease must be
                on; default None: the pool places it (``lease.device`` says where).
            resident: True for a lease held for the holder's whole life (a model's weights):
                a request that is not resident and can never fit next to the resident leases
                held and queued is refused at once (RoomExceeded); a resident request that
                does not fit next to them is not queued, whatever the timeout (AcquireTimeout
                at once: try again later). docs/SEMANTICS.md, "Resident leases".
            preemptible: False: never asked to yield; True (default): with the pool's
                preemption on, a higher-priority request may ask (``lease.on_yield``;
                docs/SEMANTICS.md, "Preemption").

        Returns: an :class:`AsyncLease` (also an async context manager).

        Raises:
            InvalidArgument, CapacityExceeded (at once; QuotaExceeded, its subclass, when the
            amount exceeds the tenant's quota or what its resident leases leave of it;
            RoomExceeded, its subclass, when it exceeds what the pool's resident leases leave),
            PoolNotFound, QueueFull,
            AcquireTimeout (nothing is held afterwards), BackendUnavailable (until the timeout;
            it names a cluster's shard), PoolClosed (the
            pool object was closed before the call, which then never queued, or during the
            wait, and the request left the queue; its message says which).
            On cancellation (``CancelledError``) the request leaves the queue and any grant
            that raced in is released before the error propagates (invariant 2 in docs/SEMANTICS.md).
        """
        rt = self._runtime
        if rt.kept.idle_count and request_id is None and not resident and not rt.closed:
            state = take_for(
                rt.kept, self.default_ttl, amount, ttl, timeout, holder, on_queued,
                priority, tenant, device, preemptible,
            )  # fmt: skip
            if state is not None:
                return AsyncLease(state, self)  # granted from kept bytes: no round trip
        opts = AcquireOptions(
            ttl=ttl,
            timeout=timeout,
            holder=holder,
            request_id=request_id,
            priority=priority,
            tenant=tenant,
            device=device,
            resident=resident,
            preemptible=preemptible,
        )
        req = AcquireRequest.build(
            self.name, amount, opts, waiter_ttl=self.waiter_ttl, default_ttl=self.default_ttl
        )
        start = self.clock()
        if rt.closed:  # no heartbeat or listener would serve the lease
            raise PoolClosed(self.name, queued=False)
        if rt.kept.idle_count:
            # it does not fit the kept bytes (nor may a request id's or a resident request
            # take them): they go back first, then it asks as usual
            await rt.kept_back.release_now(rt.kept.give_back(drain=False))
        steps = flow.acquire(self, rt, req, start, on_queued)
        # The lease its MakeLease step made.
        lease: AsyncLease = await self._run(steps, pending_cancels())
        return lease

    def grace_left(self) -> float:
        """Seconds left in the pool's restart grace period as this pool object last saw it
        (in a reply to its acquire, status or configure, or in its recovery after Redis lost
        the pool; no I/O): nothing new is granted until it ends. 0 outside one."""
        return self._runtime.grace_left()

    def kept(self) -> dict[str, Any]:
        """This pool object's kept bytes (``keep=``; docs/SEMANTICS.md, "Kept bytes"), no I/O:
        ``{"idle", "idle_bytes", "grants", "kept", "given_back", "draining"}``: the idle kept
        leases now and their bytes; since it was made, the grants made from kept bytes (no
        round trip), the releases the server answered "kept", the kept leases given back; and
        whether it is giving them back now (someone waits)."""
        return self._runtime.kept.counts()

    @property
    def waiting(self) -> int:
        """How many requests this pool object has queued and waits for now (its own acquires,
        and the places it keeps for remote holders: :mod:`gpulock.runtime.remote`)."""
        return len(self._runtime.waiters)

    async def aclose(self) -> None:
        """Stop the heartbeat and listener (held leases are not released: they expire; idle
        kept leases are given back first)."""
        rt = self._runtime
        idle = rt.kept.stop()  # nothing is kept from now on
        if idle and not rt.closed:
            with contextlib.suppress(Exception):
                await rt.kept_back.release_now(idle)
        await self._runtime.close()
        if self._owns_client:
            # Best effort, as Pool.close's: redis-py raises TimeoutError when a socket's close
            # is not confirmed within socket_connect_timeout (seen on a loaded machine, from a
            # soak's worker); the sockets are closed either way, and the pool object is.
            with contextlib.suppress(RedisError, OSError):
                await self.redis.aclose()

    async def __aenter__(self) -> "AsyncPool":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
