"""The blocking shell: :class:`Pool` and :class:`Lease`, a driver of the steps in ``protocol/flow.py``.

Acquire, release, status and configure go straight to Redis on the caller's thread through a
synchronous redis-py client (one round trip each, no thread hop). A waiting acquire reads the
pool object's hand-off subscription on its own thread (:mod:`gpulock.runtime.sync_listener`: one
waiting thread reads at a time and hands other threads their grants), so a hand-off crosses
no thread. What must happen in the background — the heartbeat, the waiters' refresh, the reap
timer — is the same :class:`~gpulock.runtime.runtime.Runtime` the asyncio shell uses, run on one
daemon thread per pool object with its own event loop (started on first use, not at
creation); a waiter is queued and left on the caller's thread, and that thread is woken only
when the heartbeat must run sooner than it planned.
"""

from __future__ import annotations

import os
import contextlib
import threading
import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, Mapping, Sequence, TypeVar

import redis
from redis.exceptions import AuthenticationError

from gpulock_common.driver import drive
from gpulock_common.options import PoolSettings, Preemption

from gpulock.protocol import flow
from gpulock._async import _CLIENT_DEFAULTS, DEFAULT_BACKEND_TIMEOUT_S
from gpulock.protocol.args import (
    DEFAULT_MAX_WAITERS,
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_TTL_S,
    DEFAULT_WAITER_TTL_S,
    PoolOptions,
)
from gpulock.protocol.keep import KeptLeases, back_for_growth, take_for
from gpulock.protocol.lease import LeaseBase, default_clock
from gpulock.protocol.request import AcquireOptions, AcquireRequest
from gpulock.protocol.resize import resize_lease
from gpulock.protocol.replies import DeviceReply, PoolStatus
from gpulock.transport.retry import RETRYABLE, retrying
from gpulock.transport.translate import translate, translated
from gpulock.transport.connect import (
    DEFAULT_MAX_CONNECTIONS,
    async_client,
    async_client_like,
    check_supported_client,
    sync_client,
)
from gpulock.protocol.keys import pool_key, pool_keys
from gpulock.runtime.runtime import Runtime
from gpulock.transport.script_calls import SyncScripts
from gpulock.runtime.sync_listener import ThreadSubscription
from gpulock.runtime.sync_steps import carry_out
from gpulock.runtime.loop_thread import LoopThread as _LoopThread
from gpulock.errors import InvalidArgument, LeaseLost, PoolClosed

_T = TypeVar("_T")

# Every Pool of this process, to mark those whose background thread a fork() left behind.
_POOLS: weakref.WeakSet[Pool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for p in list(_POOLS):
        if p._bg is not None:  # its heartbeat and hand-offs ran on a thread the child has not
            p._forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _background_cap(max_connections: int) -> int:
    """Connections of a Pool's background client (its loop thread: the batched heartbeat,
    re-queues, withdrawals), next to the hand-off subscription's one: together at most 4, at
    least 3 (the client has at least 2), at most the caller side's cap plus one."""
    return max(2, min(max_connections, 4) - 1)


@dataclass(frozen=True)
class _Background:
    """What a Pool runs besides the callers' calls: the loop thread, the runtime in it, and
    the hand-off subscription its waiting threads read (made and dropped together)."""

    portal: _LoopThread
    rt: Runtime
    sub: ThreadSubscription


def _make_background(pool: Pool) -> _Background:
    """Start ``pool``'s loop thread with its runtime (on a redis.asyncio client of its own, of
    at most :func:`_background_cap` connections) and make its hand-off subscription."""
    portal = _LoopThread(f"gpulock-{pool.name}", closed=lambda: PoolClosed(pool.name))
    try:
        conns = getattr(pool.redis, "connection_pool", None)  # None: a cluster client
        cap = _background_cap(getattr(conns, "max_connections", 4))
        client = (
            async_client(pool._url, max_connections=cap, **_CLIENT_DEFAULTS)
            if pool._url
            else async_client_like(pool.redis, max_connections=cap)
        )
        rt = Runtime(client, pool.name, pool._keys, pool.clock, pool.poll_interval, portal.loop)
    except BaseException:
        portal.stop()  # no runtime: leave no loop thread (a later call starts again)
        raise
    rt.kept.keep_s = pool.keep
    sub = ThreadSubscription(
        pool.redis,
        rt.channel,
        pool.name,
        rt.deliver,
        rt.poll_waiters_now,
        rt.yielded,
        rt.kept_back.wanted_back,
    )
    rt.read_elsewhere(lambda: sub.ready)
    flow.push_settings(pool, rt)
    if pool._status_seen is not None:  # the pool object knew the pool before its runtime ran
        flow.adopt_status(rt, pool._status_seen)
    return _Background(portal, rt, sub)


class Lease(LeaseBase):
    """A lease held by this process (blocking API). Use as ``with``; see :class:`LeaseBase`
    for the attributes. The pool's heartbeat thread renews it at ttl/3 until released."""

    __slots__ = ()

    def release(self) -> None:
        """Give the bytes back. Idempotent: later calls do nothing.

        Raises:
            LeaseLost: the server no longer had this lease (it expired or was reaped, so
                someone else may have used the bytes meanwhile). Nothing of others is freed.
            BackendUnavailable: Redis unreachable while the lease was valid (the release is
                retried until its local deadline); it expires on the server.
        """
        s = self._state
        if s.kept and s.keeper.put_back(s) is not None:
            return  # kept bytes, nobody waiting: no round trip (gpulock.protocol.keep)
        p = self._pool
        bg = p._bg  # its LISTEN (kept bytes) runs on the background it finds
        p._run(flow.release_lease(s, bg.rt if bg is not None else None), bg)

    def resize(self, amount: int | str, *, timeout: float | None = None) -> None:
        """Change the lease's amount: :meth:`gpulock.AsyncLease.resize` (blocking; a
        KeyboardInterrupt while a growth waits withdraws it, as a cancellation does there)."""
        p = self._pool
        bg = p._background(queued=False)
        back = back_for_growth(bg.rt.kept, self._state, amount)
        if back:  # a growth: the idle kept bytes go back first (gpulock.protocol.keep)
            bg.portal.call(bg.rt.kept_back.release_now(back))
        steps = resize_lease(
            p, bg.rt, self._state, amount, timeout, p.clock(), waiter_ttl_s=p.waiter_ttl
        )
        p._run(steps, bg)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.release()
        except LeaseLost:
            if et is None:
                raise


class _AcquireCM:
    def __init__(self, pool: "Pool", args: tuple[Any, ...], kw: dict[str, Any]):
        self._pool, self._args, self._kw = pool, args, kw
        self._lease: Lease | None = None

    def __enter__(self) -> Lease:
        self._lease = self._pool.acquire(*self._args, **self._kw)
        return self._lease

    def __exit__(
        self,
        et: type[BaseException] | None,
        ev: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._lease is not None  # __exit__ runs only after __enter__ returned
        self._lease.__exit__(et, ev, tb)


class Pool(PoolOptions):
    """One GPU-memory budget in Redis, used from blocking code (threads, scripts, CLI).

    Same arguments and semantics as :class:`~gpulock.AsyncPool`, with a ``redis.Redis``
    client. Create it after ``fork()``: its background thread does not survive a fork, so in a
    child a pool object used before the fork refuses acquires (InvalidArgument, saying so).

    Raises: InvalidArgument (a bad setting; a client that is neither a ``redis.Redis`` of one
    server or Sentinel nor a ``redis.cluster.RedisCluster``).
    """

    def __init__(
        self,
        redis_client: redis.Redis,
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
        _url: str | None = None,
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
        check_supported_client(redis_client)
        self.redis = redis_client
        self.clock = clock
        self._keys = pool_keys(self.name)
        self._scripts = SyncScripts(redis_client, self._keys)
        self._sync_key = pool_key(self.name, "sync")  # INCRed before each WAIT (sync_replicas)
        self._url = _url
        self._owns_client = _owns_client
        self._lock = threading.Lock()
        self._bg: _Background | None = None
        self._kept: KeptLeases | None = None  # the runtime's, once it ran (kept())
        # The last status read before the background ran: its runtime takes it in when it
        # starts, so that the pool object knows the pool it has seen (_make_background).
        self._status_seen: PoolStatus | None = None
        self._closed = False  # close() was called: acquires raise PoolClosed
        self._forked = False  # used before this process forked: its background is the parent's
        _POOLS.add(self)
        self._active = 0  # acquires in progress (close() lets them withdraw first)
        self._active_cv = threading.Condition(threading.Lock())

    @classmethod
    def from_url(
        cls, url: str, name: str, *, max_connections: int = DEFAULT_MAX_CONNECTIONS, **kw: Any
    ) -> "Pool":
        """Connect to a ``redis://``, ``rediss://``, ``unix://`` or ``redis+sentinel://`` URL
        (no I/O until first use; Sentinel URLs: :mod:`gpulock.transport.connect`).

        ``max_connections`` (default 16, at least 2; a ``?max_connections=N`` in the URL wins)
        caps the connections of the calling threads' client: threads that find them all busy
        wait for one. The hand-off subscription has one connection of its own, and the pool's
        background thread (heartbeat, re-queues) a client of at most
        ``max(2, min(max_connections, 4) - 1)``, so the pool object opens at most
        ``max_connections + 4``, however many threads wait.

        Raises: InvalidArgument (as :meth:`gpulock.AsyncPool.from_url`); BackendUnavailable
        for a cluster none of whose seed nodes answers (redis-py's sync cluster client reads
        the slot map when it is made)."""
        client = sync_client(url, max_connections=max_connections, **_CLIENT_DEFAULTS)
        return cls(client, name, _url=url, _owns_client=True, **kw)

    # ---- background runtime --------------------------------------------------------------
    def _background(self, *, queued: bool = False) -> _Background:
        if self._forked:
            raise InvalidArgument(
                f"pool object {self.name!r} was used before this process was forked: its "
                "background thread (the heartbeat that renews leases, the hand-offs) runs in "
                "the parent only, so a lease taken here would never be renewed; make a new "
                "Pool in this process (after the fork)"
            )
        with self._lock:
            if self._closed:
                raise PoolClosed(
                    self.name, queued=queued
                )  # no heartbeat or listener would serve a lease
            if self._bg is None:
                self._bg = _make_background(self)
            return self._bg

    @property
    def _runtime(self) -> Runtime | None:
        """The runtime, once the background runs (None before, and after close())."""
        bg = self._bg
        return bg.rt if bg is not None else None

    @property
    def _portal(self) -> _LoopThread | None:
        """The loop thread, once the background runs (None before, and after close())."""
        bg = self._bg
        return bg.portal if bg is not None else None

    def _untrack(self, lease_id: str) -> None:
        """Stop heartbeating a lease (tests use it to let one expire)."""
        if self._runtime is not None:
            self._runtime.untrack(lease_id)  # a dict pop: safe from any thread

    # ---- the driver -------------------------------------------------------------------------
    def _run(self, steps: flow.Flow[_T], bg: _Background | None = None) -> _T:
        """Carry out a flow of :mod:`gpulock.protocol.flow` (its steps' replies: there) on the caller's
        thread, and return its result. An acquire's flow runs with the background it began
        with (``bg``), also while close() drops it. A step's error goes into the flow as
        gpulock's own (redis-py's translated), a KeyboardInterrupt too: the flow decides."""
        return drive(
            steps, lambda step: self._step(step, bg), into=lambda e: translated(e, self.name)
        )

    def _step(self, step: flow.Step, bg: _Background | None) -> Any:
        if isinstance(step, flow.Eval):
            return self._eval(step.script, step.args, bound=step.bound)
        if isinstance(step, flow.Checkpoint):
            return None
        if isinstance(step, flow.MakeLease):
            rt = self._background(queued=True).rt  # closed while the request was on its way
            state = flow.lease_state(rt, step.grant, step.req, step.valid_until)
            return Lease(state, self), state
        if isinstance(step, flow.GiveBack):
            try:
                step.lease.release()
            except BaseException:  # noqa: BLE001 - lost or unreachable: it expires after its ttl
                pass
            return None
        assert bg is not None  # the acquire's (see _run)
        portal, rt = bg.portal, bg.rt
        if isinstance(step, flow.SyncedRenew):
            # On the caller's client, as the call layer runs it for the runtime too; with
            # the settings the runtime's heartbeat follows
            st = rt.settings
            return self._scripts.renew_synced(
                step.args, st.sync_replicas, st.sync_timeout_ms, self._sync_key, step.bound
            )
        if isinstance(step, flow.Withdraw):
            if step.background:  # from the loop thread: the caller does not wait a second bound
                portal.soon(
                    lambda: rt.spawn(rt.cancel_quietly(step.ticket, step.call[1], step.call[0]))
                )
                return None
            try:
                self._eval(*step.call)
            except Exception:  # noqa: BLE001 - never mask the error being raised
                pass  # unreachable: the waiter expires after waiter_ttl, a grant after ttl
            return None
        return carry_out(self.name, step, portal, rt, bg.sub)

    def _eval_once(self, name: str, args: list[str]) -> Any:
        try:
            return self._scripts.call(name, args)
        except AuthenticationError as e:
            # redis-py makes it a ConnectionError; retrying bad credentials only delays the
            # message (by backend_timeout), so it leaves the retry loops here.
            raise translate(e, self.name) from e

    def _eval(self, name: str, args: list[str], *, bound: float | None = None) -> Any:
        """EVALSHA with NOSCRIPT reload and jittered retries of connection errors for at most
        ``bound`` (default ``backend_timeout``) seconds, then raises BackendUnavailable.
        ``bound=0``: one try, a connection error or timeout raised as
        :class:`~gpulock.protocol.steps.Unanswered`. Other errors: translated."""
        if bound == 0:
            try:
                return self._eval_once(name, args)
            except RETRYABLE as e:
                raise flow.Unanswered(str(translate(e, self.name))) from e
            except Exception as e:
                raise translate(e, self.name) from e
        try:
            try:
                return self._eval_once(name, args)
            except RETRYABLE:
                pass
            # The retrier is built only after a failure: it costs ~10% of an uncontended call.
            for attempt in retrying(
                self.backend_timeout if bound is None else bound, asynchronous=False
            ):
                with attempt:
                    return self._eval_once(name, args)
        except Exception as e:
            raise translate(e, self.name) from e

    # ---- operations -------------------------------------------------------------------------
    def configure(
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
        """Create the pool or set its capacity (bytes or "8GiB"), queue bound and max_ttl; see
        :meth:`gpulock.AsyncPool.configure`."""
        return self._run(
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

    def status(self, *, limit: int = 1000) -> PoolStatus:
        """A snapshot: capacity, used, leases and waiters. Raises PoolNotFound."""
        rt = self._runtime
        st = self._run(flow.status(self, rt, limit))
        if rt is None:
            self._status_seen = st
        return st

    def grace_left(self) -> float:
        """Seconds left in the pool's restart grace period as this pool object last saw it
        (in a reply to its acquire, status or configure, or in its recovery after Redis lost
        the pool; no I/O): nothing new is granted until it ends. 0 outside one."""
        rt = self._runtime
        return rt.grace_left() if rt is not None else 0.0

    def reap(self) -> int:
        """Reap expired leases and dead waiters now; returns how many leases were reaped."""
        return self._run(flow.reap())

    def device_report(
        self,
        sampler_id: str,
        claim_ms: int,
        external: int | None = None,
        report_ms: int = 0,
        overuse: str = "",
    ) -> DeviceReply:
        """The device sampler's call; see :meth:`gpulock.AsyncPool.device_report`."""
        return self._run(flow.device_report(sampler_id, claim_ms, external, report_ms, overuse))

    def kept(self) -> dict[str, Any]:
        """This pool object's kept bytes: :meth:`gpulock.AsyncPool.kept` (zeros before its
        first acquire)."""
        rt = self._runtime
        kept = rt.kept if rt is not None else self._kept
        return (kept or KeptLeases(0.0, self.clock)).counts()

    @property
    def waiting(self) -> int:
        """How many requests this pool object has queued and waits for now."""
        rt = self._runtime
        return len(rt.waiters) if rt is not None else 0

    def lease(self, amount: int | str, **kw: Any) -> _AcquireCM:
        """``with pool.lease("2GiB", timeout=10) as lease:`` — acquire, release on exit."""
        return _AcquireCM(self, (amount,), kw)

    def acquire(
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
    ) -> Lease:
        """Take ``amount`` bytes, waiting in the pool's queue. Same arguments, return and errors as
        :meth:`gpulock.AsyncPool.acquire`. ``on_queued`` runs on the pool's background thread
        (except its first call). On ``KeyboardInterrupt`` or any other exception during the
        wait, the request leaves the queue and a grant that raced in is released."""
        bg = self._bg
        if (
            bg is not None
            and bg.rt.kept.idle_count
            and request_id is None
            and not resident
            and not self._closed
            and not self._forked
        ):
            state = take_for(
                bg.rt.kept, self.default_ttl, amount, ttl, timeout, holder, on_queued,
                priority, tenant, device, preemptible,
            )  # fmt: skip
            if state is not None:
                return Lease(state, self)  # granted from kept bytes: no round trip
        with self._active_cv:
            self._active += 1
        try:
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
            bg = self._background()
            kept = bg.rt.kept
            if kept.idle_count:
                # it does not fit the kept bytes (nor may a request id's or a resident
                # request take them): they go back first, then it asks as usual
                bg.portal.call(bg.rt.kept_back.release_now(kept.give_back(drain=False)))
            lease: Lease = self._run(flow.acquire(self, bg.rt, req, start, on_queued), bg)
            return lease  # the lease its MakeLease step made
        finally:
            with self._active_cv:
                self._active -= 1
                if self._closed:  # only close() waits on it (and it sets _closed first)
                    self._active_cv.notify_all()

    def close(self) -> None:
        """Stop the background thread (held leases are not released: they expire). Acquires
        waiting in other threads end with PoolClosed; close() gives them up to 2 s to withdraw
        their requests before it closes the connections. Later acquires raise PoolClosed at
        once (as :class:`~gpulock.AsyncPool`'s do); releasing a lease still works. Idempotent."""
        with self._lock:
            self._closed = True
            bg, self._bg = self._bg, None
        if bg is not None:
            self._kept = bg.rt.kept  # its counters stay readable (kept())
        if bg is not None and self._forked:
            bg = None  # the parent's thread: nothing of it runs here to stop or wait for
        if bg is not None:
            portal, rt = bg.portal, bg.rt
            idle = rt.kept.stop()  # nothing is kept from now on; idle kept leases go back
            if idle:
                with contextlib.suppress(Exception):
                    portal.call(rt.kept_back.release_now(idle), timeout=5)
            try:
                portal.call(rt.close(), timeout=5)
            except Exception:
                pass
            with self._active_cv:
                self._active_cv.wait_for(lambda: self._active == 0, timeout=2.0)
            bg.sub.close()
            try:
                portal.call(rt.redis.aclose(), timeout=5)
            except Exception:
                pass
            portal.stop()
        if self._owns_client:
            self.redis.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
