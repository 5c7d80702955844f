"""The asyncio client: :class:`AsyncPool` and :class:`AsyncLease`. Logic lives in
``_core.py``; this file carries out its steps with ``httpx.AsyncClient``, ``asyncio.sleep``
and futures. One heartbeat task per pool object, started with its first lease. Three
connection pools per pool object (see ``_core``): the long-polled waits, the control calls, the
heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Set, Union

import httpx
from gpulock_common.aio import plain_or_coroutine, stop_tasks, wait_for
from gpulock_common.driver import adrive

from gpulock_common.lease import stop_renewal
from gpulock_common.options import Preemption

from . import _core as core
from . import _holding as holding
from . import _resize, _trace
from ._sync import _headers, _limits, _reply, _timeout
from .errors import BackendUnavailable, LeaseLost, PoolClosed, PoolNotFound


class _Waker:
    """A task waiting at the core's Gate for a wait connection."""

    __slots__ = ("fut",)

    def __init__(self, fut: "asyncio.Future[None]"):
        self.fut = fut

    def wake(self) -> bool:
        if self.fut.done():  # it stopped waiting (timed out, cancelled)
            return False
        self.fut.set_result(None)
        return True

    @property
    def woken(self) -> bool:
        return self.fut.done() and not self.fut.cancelled()


class AsyncLease(core.LeaseBase):
    """A lease held through the broker (asyncio). Use as ``async with``; see
    :class:`~gpulock_client._core.LeaseBase`. The pool's heartbeat task renews it at ttl/3."""

    async def renew(self, ttl: Optional[float] = None) -> None:
        """Renew now, optionally with a new ``ttl`` (seconds). Raises LeaseLost,
        BackendUnavailable."""
        s = self._state
        s.check()
        ok = await self._pool._run(
            holding.renew_steps(self._pool._cfg, s, core.CONNECT_TIMEOUT_S, ttl)
        )
        if ok is None:
            raise BackendUnavailable(
                f"pool {s.pool!r}: renewal of lease {s.lease_id[:8]}… did not get through"
            )
        s.check()

    def on_yield(self, callback: Callable[[Any], Any]) -> None:
        """Call ``callback(lease)`` once when the holder learns that the server asked it to
        yield this lease (a renewal's answer says so;
        :meth:`gpulock_common.lease.LeaseView.on_yield`); at once if it learnt that already.
        ``callback`` may be a plain function or a coroutine function, whose coroutine then runs
        as a task of the event loop. An exception from either is logged, not raised."""
        tasks = self._pool._callback_tasks

        def spawn(c: Any) -> None:
            t = asyncio.ensure_future(c)
            tasks.add(t)  # kept until it ends (the loop keeps only a weak reference)
            t.add_done_callback(tasks.discard)

        call = plain_or_coroutine(callback, spawn, "on_yield", core.LeaseState.log)
        self._state.add_yield_callback(call, self)

    async def resize(self, amount: Union[int, str], *, timeout: Optional[float] = None) -> None:
        """Change the lease's amount: the arguments, behaviour and errors of
        :meth:`gpulock_client.Lease.resize`. On cancellation a growth is withdrawn (a grant
        that raced in is undone) before the cancellation propagates."""
        s, p = self._state, self._pool
        before = s.amount
        try:
            await p._run(_resize.resize_steps(p._cfg, s, amount, timeout))
        except asyncio.CancelledError:
            if _resize.grows(amount, before) and s.amount == before:
                t = asyncio.ensure_future(p._run(_resize.withdraw_growth_steps(p._cfg, s)))
                try:
                    await asyncio.shield(t)
                except BaseException:
                    pass
            raise
        finally:
            if s.active and p._leases.get(s.lease_id) is s:
                p._arm_deadline(s)  # its validity deadline moved with the answer
            if p._wake is not None:
                p._wake.set()  # its next renewal may be due at another time now

    async def release(self) -> None:
        """Give the bytes back. Idempotent. Raises LeaseLost (it had been lost),
        BackendUnavailable (not confirmed within 5 s; it expires after its ttl)."""
        s = self._state
        if s.released:
            return
        was_lost = s.lost_reason or (s.deadline_passed_reason() if s.expired_locally() else None)
        s.released = True
        self._pool._leases.pop(s.lease_id, None)
        await self._pool._run(holding.release_steps(self._pool._cfg, s, was_lost))

    async def __aenter__(self) -> "AsyncLease":
        return self

    async def __aexit__(self, et, ev, tb) -> None:
        try:
            await asyncio.shield(self.release())
        except LeaseLost:
            if et is None:
                raise


class _LeaseCM:
    def __init__(self, pool: "AsyncPool", amount: Union[int, str], kw: Dict[str, Any]):
        self._pool, self._amount, self._kw = pool, amount, kw
        self._lease: Optional[AsyncLease] = None

    async def __aenter__(self) -> AsyncLease:
        self._lease = await self._pool.acquire(self._amount, **self._kw)
        return self._lease

    async def __aexit__(self, et, ev, tb) -> None:
        assert self._lease is not None
        await self._lease.__aexit__(et, ev, tb)


class AsyncPool:
    """One gpulock pool, reached through a broker (asyncio). Same arguments as
    :class:`gpulock_client.Pool` (``max_connections``: connections for the long-polled waits,
    64; later waits wait in this process, in FIFO order, within their own timeout)."""

    def __init__(
        self,
        url: Optional[str] = None,
        name: str = "gpu0",
        *,
        token: Optional[str] = None,
        default_ttl: float = core.DEFAULT_TTL_S,
        max_wait: float = core.DEFAULT_MAX_WAIT_S,
        backend_timeout: float = core.DEFAULT_BACKEND_TIMEOUT_S,
        max_connections: int = core.DEFAULT_MAX_CONNECTIONS,
        transport: Optional[httpx.AsyncBaseTransport] = None,
        clock: core.Clock = time.monotonic,
    ):
        self.url = core.env_url(url)
        self.name = name
        gate = core.Gate(max_connections)
        self.max_connections = max_connections
        self._cfg = core.PoolConfig(name, default_ttl, max_wait, backend_timeout, clock, gate=gate)
        kw: Dict[str, Any] = {"base_url": self.url, "headers": _headers(core.env_token(token))}
        if transport is not None:
            kw["transport"] = transport
        self._client_kw = kw  # for the withdrawal of a grant that raced aclose()
        self._http = httpx.AsyncClient(
            limits=_limits(max_connections), **kw
        )  # the long-polled waits
        self._ctl_http = httpx.AsyncClient(limits=_limits(core.CONTROL_CONNECTIONS), **kw)
        self._hb_http = httpx.AsyncClient(
            limits=_limits(core.HEARTBEAT_CONNECTIONS), **kw
        )  # the heartbeat's own
        self._leases: Dict[str, core.LeaseState] = {}
        self._task: Optional[asyncio.Task] = None
        self._wake: Optional[asyncio.Event] = None
        self._timers: Dict[str, asyncio.TimerHandle] = {}
        self._closed = False
        self._calls: Set[asyncio.Task] = set()  # tasks with an HTTP call of this pool in flight
        self._cancelled_by_close: Set[asyncio.Task] = set()
        self._callback_tasks: Set[asyncio.Future] = set()  # on_yield coroutines running

    @classmethod
    def from_url(cls, url: str, name: str, **kw: Any) -> "AsyncPool":
        return cls(url, name, **kw)

    async def _run(self, gen: core.Steps, control: Optional[httpx.AsyncClient] = None) -> Any:
        """Carry out the steps; ``control``: the client for CONTROL steps (the heartbeat's).
        A transport error is a step's result, not thrown in (``catch=()``); any other error,
        a cancellation too, propagates, and ``adrive`` closes the procedure: a cancelled one
        leaves the gate."""
        return await adrive(gen, lambda step: self._step(step, control), catch=())

    async def _step(self, step: core.Step, control: Optional[httpx.AsyncClient]) -> Any:
        """One step's I/O: a sleep, a wait for the gate, or an HTTP call (its :class:`core.Reply`,
        or the ``httpx.TransportError`` it raised, as a value)."""
        if isinstance(step, core.Sleep):
            await asyncio.sleep(step.seconds)
            return None
        if isinstance(step, core.Enter):
            return await self._enter(step)
        if self._closed and control is None:
            raise PoolClosed(self.name, queued=False)
        http = self._http if step.lane == core.WAIT else (control or self._ctl_http)
        sent = self._cfg.clock()
        me = asyncio.current_task()
        if me is not None:
            self._calls.add(me)
        try:
            return _reply(
                await http.request(
                    step.method,
                    step.path,
                    json=step.json,
                    headers=_trace.request_headers(),  # the caller's traceparent
                    timeout=_timeout(step.timeout),
                ),
                sent,
            )
        except httpx.TransportError as e:
            if self._closed:
                raise PoolClosed(self.name) from e
            return e
        except RuntimeError as e:  # httpx: "the client has been closed"
            if self._closed:
                raise PoolClosed(self.name) from e
            raise
        except asyncio.CancelledError:
            if me is not None and me in self._cancelled_by_close:
                # aclose() stopped this call, not the caller: say so
                self._cancelled_by_close.discard(me)
                uncancel = getattr(me, "uncancel", None)
                if uncancel is not None:
                    uncancel()
                raise PoolClosed(self.name) from None
            raise
        finally:
            if me is not None:
                self._calls.discard(me)

    async def _enter(self, step: core.Enter) -> bool:
        w = _Waker(asyncio.get_running_loop().create_future())
        if step.gate.enter(w):
            return True
        try:
            await wait_for(w.fut, core.seconds_until(step.deadline, self._cfg.clock))
        except asyncio.TimeoutError:
            pass
        except BaseException:  # cancelled: stop waiting; a slot handed meanwhile is passed on
            step.gate.withdraw(w)
            if w.woken:
                step.gate.leave()
            raise
        step.gate.withdraw(w)  # after it, it holds a slot exactly if it was woken
        return w.woken

    async def acquire(
        self,
        amount: Union[int, str],
        *,
        ttl: Optional[float] = None,
        timeout: Optional[float] = None,
        holder: Optional[Dict[str, Any]] = None,
        request_id: Optional[str] = None,
        on_queued: Optional[Callable[[int], Any]] = None,
        priority: int = 0,
        device: Optional[int] = None,
        preemptible: bool = True,
    ) -> AsyncLease:
        """Same arguments, return and errors as :meth:`gpulock_client.Pool.acquire`
        (``priority``: an integer in [-100, 100], higher goes first, default 0; a queued request
        gains one level per second waited; ``device``: the index of the device the lease must
        be on, None for any; ``preemptible``: False, never asked to yield). On cancellation the place is withdrawn (and a grant that raced
        in released)."""
        rid = request_id or core.new_request_id()
        opts = core.AcquireOptions(
            ttl=ttl,
            timeout=timeout,
            holder=holder,
            request_id=rid,
            priority=priority,
            device=device,
            preemptible=preemptible,
        )
        with _trace.acquire_span(self.name, amount, opts, self._cfg.clock, on_queued) as tr:
            gen = core.acquire_steps(self._cfg, amount, opts, tr.on_queued, tr.on_granted_place)
            lease = await self._acquire(gen, rid)
            tr.granted(lease._state)  # its span: from the grant to the release
        return lease

    async def _acquire(self, gen: core.Steps, rid: str):
        """Carry out an acquire's steps (:meth:`acquire`): its lease, or its error after its
        place was withdrawn."""
        if self._closed:
            raise PoolClosed(self.name, queued=False)
        try:
            body, sent = await self._run(gen)
        except PoolClosed:
            await self._withdraw_after_close(rid)  # aclose() cut the wait short
            raise PoolClosed(self.name) from None
        except asyncio.CancelledError:
            t = asyncio.ensure_future(self._run(core._cancel_steps(self._cfg, rid)))
            try:
                await asyncio.shield(t)
            except BaseException:
                pass
            raise
        if self._closed:  # granted as aclose() ran: nobody would renew it
            await self._withdraw_after_close(rid)
            raise PoolClosed(self.name)
        s = core.LeaseState(self.name, body, sent, self._cfg.clock)
        self._track(s)
        return AsyncLease(s, self)

    async def _withdraw_after_close(self, rid: str) -> None:
        """Take back the place (or the grant that raced in) of an acquire that aclose() ended,
        on a client of its own (the pool object's are closed), best effort: else the broker
        withdraws it when nobody comes back for it."""
        c = httpx.AsyncClient(limits=_limits(1), **self._client_kw)
        try:
            with contextlib.suppress(Exception):
                await self._run(core._cancel_steps(self._cfg, rid), control=c)
        finally:
            if "transport" not in self._client_kw:  # a caller's transport stays open
                await c.aclose()

    def lease(self, amount: Union[int, str], **kw: Any) -> _LeaseCM:
        """``async with pool.lease("2GiB", timeout=10, priority=5, device=1) as lease:``; takes
        the arguments of :meth:`acquire` (``priority`` and ``device`` among them)."""
        return _LeaseCM(self, amount, kw)

    async def _get(self, method: str, path: str, json: Any = None) -> Any:
        from ._sync import _one

        r = await self._run(_one(core.Http(method, path, json, timeout=10.0)))
        if isinstance(r, Exception):
            raise BackendUnavailable(f"broker unreachable: {r!r}")
        if r.status >= 300:
            raise core.error_for(r, self.name)
        return r.body

    def grace_left(self) -> float:
        """Seconds left in the pool's restart grace period as this pool object last saw it (in
        the broker's answer to its last acquire; no I/O): nothing new is granted until it
        ends. 0 outside one."""
        return self._cfg.grace_left()

    async def status(self) -> Dict[str, Any]:
        """The pool's status (bytes, seconds; its devices too), as :meth:`gpulock_client.Pool.status`.
        Raises PoolNotFound, AuthError, BackendUnavailable."""
        return await self._get("GET", self._cfg.base)

    async def configure(
        self,
        capacity: Union[int, str, None] = None,
        *,
        max_waiters: Optional[int] = None,
        max_ttl: Optional[float] = None,
        policy: Optional[str] = None,
        backfill_window: Optional[float] = None,
        quotas: Optional[Mapping[str, Union[int, str, None]]] = None,
        devices: Optional[Sequence[Union[int, str]]] = None,
        placement: Optional[str] = None,
        preemption: Union[Preemption, bool, None] = None,
    ) -> Dict[str, Any]:
        """Create the pool or change it (admin token); the arguments, reply and errors of
        :meth:`gpulock_client.Pool.configure`."""
        settings = core.checked_settings(
            core.PoolSettings(
                capacity,
                max_waiters,
                max_ttl,
                policy,
                backfill_window,
                quotas,
                devices,
                placement,
                preemption,
            )
        )
        current = None
        if capacity is None and devices is None:  # keep the pool's own sizes
            try:
                current = await self.status()
            except PoolNotFound:
                pass  # a new pool: configure_body says what it needs
        body = core.configure_body(settings, current)
        return await self._get("PUT", self._cfg.base, body)

    # ---- heartbeat -------------------------------------------------------------------------
    def _track(self, s: core.LeaseState) -> None:
        self._leases[s.lease_id] = s
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._heartbeat(), name=f"gpulock-client-{self.name}"
            )
        self._arm_deadline(s)
        self._wake.set()

    def _arm_deadline(self, s: core.LeaseState) -> None:
        """Fire on_lost at the validity deadline even while the heartbeat awaits a reply."""
        h = self._timers.pop(s.lease_id, None)
        if h is not None:
            h.cancel()
        if not s.active or self._leases.get(s.lease_id) is not s:
            return
        delay = s.valid_until - self._cfg.clock()
        if delay > 0:
            self._timers[s.lease_id] = asyncio.get_running_loop().call_later(
                delay, self._arm_deadline, s
            )
        else:
            s.mark_lost(s.deadline_passed_reason("broker unreachable or too slow"))

    async def _heartbeat(self) -> None:
        clock = self._cfg.clock
        assert self._wake is not None
        while True:
            leases = list(self._leases.values())
            for s in leases:
                if not s.active:
                    self._leases.pop(s.lease_id, None)
            leases = [s for s in leases if s.active]
            if not leases:
                return
            due, wake = holding.heartbeat_plan(leases, clock())
            for s in due:
                ok = await self._run(
                    holding.renew_steps(self._cfg, s, holding.request_budget(leases, clock())),
                    self._hb_http,
                )
                if ok is None:
                    holding.retry_later(s, clock(), self._cfg.rng)
                elif ok:
                    self._arm_deadline(s)
            if due:
                continue
            self._wake.clear()
            try:
                await wait_for(self._wake.wait(), max(0.0, wake - clock()))
            except asyncio.TimeoutError:
                pass

    async def aclose(self) -> None:
        """Stop the heartbeat and close connections (held leases expire after their ttl).
        Calls in flight in other tasks (a waiting acquire's long poll) end at once with
        PoolClosed, as do later calls; a waiting acquire withdraws its place first (or
        releases a grant that raced in)."""
        self._closed = True
        stop_renewal(list(self._leases.values()), self.name)
        me = asyncio.current_task()
        for t in list(self._calls):
            if t is not me and t is not self._task and not t.done():  # the heartbeat: below
                self._cancelled_by_close.add(t)
                t.cancel()
        if self._task is not None:
            await stop_tasks([self._task])
        await self._http.aclose()
        await self._ctl_http.aclose()
        await self._hb_http.aclose()

    async def __aenter__(self) -> "AsyncPool":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
