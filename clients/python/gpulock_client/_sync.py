"""The blocking client: :class:`Pool` and :class:`Lease`. Logic lives in ``_core.py``; this
file carries out its steps with ``httpx.Client``, ``time.sleep`` and ``threading.Event``. One
daemon heartbeat thread per pool object, started with its first lease. Three connection pools
per pool object (see ``_core``): the long-polled waits, the control calls, the heartbeat."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import httpx

from gpulock_common.driver import drive
from gpulock_common.lease import stop_renewal
from gpulock_common.options import Preemption

from . import _core as core
from . import _holding as holding
from . import _resize, _trace
from .errors import BackendUnavailable, LeaseLost, PoolClosed, PoolNotFound


def _headers(token: Optional[str]) -> Dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _timeout(read: float) -> httpx.Timeout:
    return httpx.Timeout(
        connect=min(core.CONNECT_TIMEOUT_S, read), read=read, write=read, pool=read
    )


def _limits(n: int) -> httpx.Limits:
    return httpx.Limits(max_connections=n, max_keepalive_connections=n)


def _reply(r: httpx.Response, sent: float) -> core.Reply:
    try:
        body = r.json()
    except ValueError:
        body = None
    return core.Reply(r.status_code, {k.lower(): v for k, v in r.headers.items()}, body, sent)


class _Waker:
    """A thread waiting at the core's Gate for a wait connection."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()

    def wake(self) -> bool:
        self.event.set()
        return True


class Lease(core.LeaseBase):
    """A lease held through the broker (blocking API). Use as ``with``; see
    :class:`~gpulock_client._core.LeaseBase` for the attributes. The pool's heartbeat thread
    renews it every ttl/3 until it is released."""

    def renew(self, ttl: Optional[float] = None) -> None:
        """Renew now (the heartbeat does this on its own), optionally with a new ``ttl`` in
        seconds. Raises LeaseLost (the broker says it is gone), BackendUnavailable."""
        s = self._state
        s.check()
        ok = self._pool._run(holding.renew_steps(self._pool._cfg, s, core.CONNECT_TIMEOUT_S, ttl))
        if ok is None:
            raise BackendUnavailable(
                f"pool {s.pool!r}: renewal of lease {s.lease_id[:8]}… did not get through"
            )
        s.check()

    def resize(self, amount: Union[int, str], *, timeout: Optional[float] = None) -> None:
        """Change the lease's amount to ``amount`` (bytes or a size such as "6GiB"), keeping
        its id and fencing token (docs/SEMANTICS.md, "Resizing a lease"). A shrink hands the
        bytes on at once. A growth is granted now, or waits in the pool's queue (at the
        lease's place, ahead of the new requests its request was ahead of; on its device) up to ``timeout`` seconds (None: forever; 0: never
        waits) while the lease keeps its bytes and its heartbeat; long-polled as
        :meth:`Pool.acquire` is. Afterwards ``amount`` is the new amount and the lease's
        validity counts from the broker's answer. The same amount sends nothing. On
        KeyboardInterrupt a growth is withdrawn (a grant that raced in is undone) before it
        propagates.

        Raises: InvalidArgument (a bad amount or timeout, named, before anything is sent;
        a resident lease), LeaseLost (released or lost: nothing is sent; or the broker says
        it is gone), ResizeRefused (waiting could only deadlock: every other lease on its
        device is resident or waits to grow), CapacityExceeded (QuotaExceeded, RoomExceeded:
        the new amount can never fit), AcquireTimeout (not granted in time: the lease keeps
        its amount), QueueFull, BackendUnavailable, AuthError."""
        s, p = self._state, self._pool
        before = s.amount
        try:
            p._run(_resize.resize_steps(p._cfg, s, amount, timeout))
        except BaseException as e:
            if (
                not isinstance(e, Exception)
                and _resize.grows(amount, before)
                and s.amount == before
            ):
                try:  # interrupted: withdraw a growth, best effort
                    p._run(_resize.withdraw_growth_steps(p._cfg, s))
                except Exception:
                    pass
            raise
        finally:
            p._wake.set()  # its next renewal may be due at another time now

    def release(self) -> None:
        """Give the bytes back. Idempotent: later calls do nothing.

        Raises:
            LeaseLost: the lease had been lost (the broker answered 410, or the local deadline
                passed before): someone else may have used the bytes meanwhile.
            BackendUnavailable: the broker did not confirm within 5 s; the lease expires
                after its ttl.
        """
        s = self._state
        if s.released:
            return
        was_lost = s.lost_reason or (s.deadline_passed_reason() if s.expired_locally() else None)
        s.released = True
        self._pool._forget(s)
        self._pool._run(holding.release_steps(self._pool._cfg, s, was_lost))

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, et, ev, tb) -> None:
        try:
            self.release()
        except LeaseLost:
            if et is None:
                raise


class _LeaseCM:
    def __init__(self, pool: "Pool", amount: Union[int, str], kw: Dict[str, Any]):
        self._pool, self._amount, self._kw = pool, amount, kw
        self._lease: Optional[Lease] = None

    def __enter__(self) -> Lease:
        self._lease = self._pool.acquire(self._amount, **self._kw)
        return self._lease

    def __exit__(self, et, ev, tb) -> None:
        assert self._lease is not None
        self._lease.__exit__(et, ev, tb)


class Pool:
    """One gpulock pool, reached through a broker (blocking API).

    Args:
        url: the broker's base URL (default ``$GPULOCK_BROKER_URL``), e.g. ``http://host:8100``.
        name: the pool name.
        token: bearer token (default ``$GPULOCK_TOKEN``).
        default_ttl: lease ttl in seconds when ``acquire`` gets none (30).
        max_wait: the longest one long poll may last, seconds (20; the broker caps it too).
        backend_timeout: seconds an unreachable broker (or Redis behind it) is retried when
            ``acquire`` has no timeout, before BackendUnavailable (30).
        max_connections: connections for the long-polled waits of this pool object (64): at
            most this many of its ``acquire`` calls are in the broker's queue at once; later
            ones wait in this process, in FIFO order and within their own timeout, until an
            earlier one ends. Renewals, release, status and configure have their own
            connections (4, and 1 for the heartbeat) and never wait behind the waits.
        transport: an httpx transport (tests).
    """

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
        transport: Optional[httpx.BaseTransport] = None,
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
        self._client_kw = kw  # for the withdrawal of a wait that close() cut short
        self._http = httpx.Client(limits=_limits(max_connections), **kw)  # the long-polled waits
        self._ctl_http = httpx.Client(limits=_limits(core.CONTROL_CONNECTIONS), **kw)
        self._hb_http = httpx.Client(
            limits=_limits(core.HEARTBEAT_CONNECTIONS), **kw
        )  # the heartbeat's own
        self._leases: Dict[str, core.LeaseState] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    @classmethod
    def from_url(cls, url: str, name: str, **kw: Any) -> "Pool":
        return cls(url, name, **kw)

    # ---- carrying out core steps -----------------------------------------------------------
    def _run(self, gen: core.Steps, control: Optional[httpx.Client] = None) -> Any:
        """Carry out the steps; ``control``: the client for CONTROL steps (the heartbeat's).
        A transport error is a step's result, not thrown in (``catch=()``); any other error
        propagates, and ``drive`` closes the procedure: an interrupted one leaves the gate."""
        return drive(gen, lambda step: self._step(step, control), catch=())

    def _step(self, step: core.Step, control: Optional[httpx.Client]) -> Any:
        """One step's I/O: a sleep, a wait for the gate, or an HTTP call (its :class:`core.Reply`,
        or the ``httpx.TransportError`` it raised, as a value)."""
        if isinstance(step, core.Sleep):
            time.sleep(step.seconds)
            return None
        if isinstance(step, core.Enter):
            return self._enter(step)
        if self._closed and control is None:
            raise PoolClosed(self.name, queued=False)
        http = self._http if step.lane == core.WAIT else (control or self._ctl_http)
        sent = self._cfg.clock()
        try:
            return _reply(
                http.request(
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

    def _enter(self, step: core.Enter) -> bool:
        w = _Waker()
        if step.gate.enter(w):
            return True
        try:
            w.event.wait(core.seconds_until(step.deadline, self._cfg.clock))
        except BaseException:  # interrupted: stop waiting; a slot handed meanwhile is passed on
            step.gate.withdraw(w)
            if w.event.is_set():
                step.gate.leave()
            raise
        step.gate.withdraw(w)  # after it, it holds a slot exactly if it was woken
        return w.event.is_set()

    # ---- API -------------------------------------------------------------------------------
    def acquire(
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
    ) -> Lease:
        """Take ``amount`` bytes (an int, or "4GiB") from the pool, waiting in its queue (by
        priority, then first come first served).

        Args:
            ttl: lease time to live in seconds (default ``default_ttl``); renewed every ttl/3.
            timeout: total seconds to wait (``None``: forever; ``0``: try once, never queue).
            holder: metadata shown in pool status (host and pid are added).
            request_id: idempotency key (1-96 of ``[A-Za-z0-9._:-]``), reused on every retry.
            on_queued: ``callback(position)`` when queued and when the position changes (it
                can grow when a request of higher priority arrives). ``position`` is a
                :class:`gpulock_common.queue.QueuePlace`: the 1-based int, with
                ``.estimated_wait`` (the broker's estimate of the seconds until the grant;
                None while the pool's drain rate is not measured) and ``.queue_length``.
                Called from the broker's ``queued`` answers, one per long poll that ends
                without a grant, for a request that still waits; never after the grant, so a
                request granted within its first long poll (``max_wait``) is not called
                back (the 201 says its place to its traced acquire span; docs/TRACING.md).
            priority: an integer in [-100, 100], higher goes first (default 0); a queued
                request gains one level per second waited (aging), so none starves. Sent
                only when not 0 (a broker older than priorities refuses the field with 422).
            device: on a pool of several devices, the index of the device (0 .. 63) the lease
                must be on; default None: the pool places it (``lease.device`` says where).
                Sent only when not None.
            preemptible: False for a lease the server must never ask its holder to yield;
                default True: on a pool with preemption on, a queued request of a priority at
                least the pool's gap higher that cannot fit may ask for it. The holder learns
                it from the heartbeat's next renewal (``lease.on_yield``,
                ``lease.yield_requested``, ``lease.yield_deadline``) and should release by the
                deadline; after it the lease is lost. Sent only when False.

        Raises: InvalidArgument (a bad ``priority`` or ``device`` before anything is sent; a
        device the pool does not have, from the broker), AuthError,
        PoolNotFound, CapacityExceeded (at once); AcquireTimeout (the place was withdrawn);
        QueueFull or BackendUnavailable when the queue stayed full or the broker (or its Redis)
        unreachable until the timeout, or for ``backend_timeout`` seconds when there is none
        (retried meanwhile, honouring Retry-After). On KeyboardInterrupt the place is withdrawn (and a grant that raced in
        released) before it propagates.
        """
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
            lease = self._acquire(gen, rid)
            tr.granted(lease._state)  # its span: from the grant to the release
        return lease

    def _acquire(self, gen: core.Steps, rid: str):
        """Carry out an acquire's steps (:meth:`acquire`): its lease, or its error after its
        place was withdrawn."""
        if self._closed:
            raise PoolClosed(self.name, queued=False)
        try:
            body, sent = self._run(gen)
        except PoolClosed:
            self._withdraw_after_close(rid)  # close() cut the wait short
            raise PoolClosed(self.name) from None
        except BaseException as e:
            if not isinstance(e, Exception):  # interrupted: withdraw the place, best effort
                try:
                    self._run(core._cancel_steps(self._cfg, rid))
                except Exception:
                    pass
            raise
        if self._closed:  # granted as close() ran: nobody would renew it
            self._withdraw_after_close(rid)
            raise PoolClosed(self.name)
        s = core.LeaseState(self.name, body, sent, self._cfg.clock)
        self._track(s)
        return Lease(s, self)

    def _withdraw_after_close(self, rid: str) -> None:
        """Take back the place (or the grant that raced in) of an acquire that close() ended,
        on a client of its own (the pool object's are closed), best effort: else the broker
        withdraws it when nobody comes back for it."""
        c = httpx.Client(limits=_limits(1), **self._client_kw)
        try:
            self._run(core._cancel_steps(self._cfg, rid), control=c)
        except Exception:  # noqa: BLE001 - best effort, see above
            pass
        finally:
            if "transport" not in self._client_kw:  # a caller's transport stays open
                c.close()

    def lease(self, amount: Union[int, str], **kw: Any) -> _LeaseCM:
        """``with pool.lease("2GiB", timeout=10, priority=5, device=1) as lease:`` — acquire,
        release on exit. Takes the arguments of :meth:`acquire` (``priority`` and ``device``
        among them)."""
        return _LeaseCM(self, amount, kw)

    def _get(self, method: str, path: str, json: Any = None) -> Any:
        r = self._run(_one(core.Http(method, path, json, timeout=10.0)))
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

    def status(self) -> Dict[str, Any]:
        """The pool's status (capacity, used, free, devices, leases, waiters; bytes and
        seconds), the broker's JSON (GET /v1/pools/{pool}). Raises PoolNotFound, AuthError,
        BackendUnavailable."""
        return self._get("GET", self._cfg.base)

    def configure(
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
        """Create the pool or change it (admin token); what is left out keeps its value.
        ``capacity``: bytes or a size ("24GiB"); with ``devices``, their sum (the default);
        neither given: the pool's own (read first), so that ``configure(policy="backfill")``
        changes the policy alone. On a pool of several devices a new ``capacity`` needs
        ``devices`` (the broker says so); the CLI's ``--capacity`` alone sets each device's.
        ``max_waiters``: the queue bound. ``max_ttl``: the longest lease ttl, seconds.
        ``policy``: "fifo" or "backfill", with ``backfill_window`` seconds. ``quotas``: tenant
        to bytes or a size (0 or None removes that tenant's). ``devices``: each device's
        capacity, device 0 first (a pool of several GPUs). ``placement``: "bestfit" or
        "spread". ``preemption``: a ``Preemption(gap, yield_grace_s)`` turns preemption on,
        False off (docs/SEMANTICS.md, "Preemption"). Returns the broker's reply (the pool's
        settings and use). Raises
        AuthError, InvalidArgument (naming the bad value; nothing changed), BackendUnavailable."""
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
                current = self.status()
            except PoolNotFound:
                pass  # a new pool: configure_body says what it needs
        body = core.configure_body(settings, current)
        return self._get("PUT", self._cfg.base, body)

    # ---- heartbeat -------------------------------------------------------------------------
    def _track(self, s: core.LeaseState) -> None:
        with self._lock:
            self._leases[s.lease_id] = s
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._heartbeat, name=f"gpulock-client-{self.name}", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def _forget(self, s: core.LeaseState) -> None:
        with self._lock:
            self._leases.pop(s.lease_id, None)

    def _heartbeat(self) -> None:
        clock = self._cfg.clock
        while not self._closed:
            with self._lock:
                leases = list(self._leases.values())
            now = clock()
            for s in leases:
                if s.expired_locally():
                    s.mark_lost(s.deadline_passed_reason("broker unreachable or too slow"))
            due, wake = holding.heartbeat_plan(leases, now)
            for s in due:
                budget = holding.request_budget(leases, clock())
                ok = self._run(holding.renew_steps(self._cfg, s, budget), self._hb_http)
                if ok is None:
                    holding.retry_later(s, clock(), self._cfg.rng)
                _, wake = holding.heartbeat_plan(leases, clock())
            with self._lock:
                for s in leases:
                    if not s.active:
                        self._leases.pop(s.lease_id, None)
                if not self._leases:
                    self._thread = None
                    return
            self._wake.wait(max(0.0, wake - clock()))
            self._wake.clear()

    def close(self) -> None:
        """Stop the heartbeat and close connections (held leases are not released: they
        expire after their ttl). Later calls raise PoolClosed. An acquire waiting in another
        thread cannot be cut short: it raises PoolClosed when its current long poll's reply
        reaches it (at most ``max_wait`` plus a 10 s read slack: 30 s by default), after it
        withdrew its place; a grant made to it meanwhile holds those bytes until then, and is
        released. Give waits a ``timeout`` to bound them."""
        self._closed = True
        stop_renewal(list(self._leases.values()), self.name)
        self._wake.set()
        t = self._thread
        if t is not None:
            t.join(timeout=5)
        self._http.close()
        self._ctl_http.close()
        self._hb_http.close()

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _one(step: core.Http) -> core.Steps:
    out = yield step
    return out
