"""The lease protocol as I/O-free step machines, written once for both shells.

Each operation of a pool object (acquire with its wait and withdrawal, release, configure,
status, reap, cancel, renew, the ``sync_replicas`` grant check) is a generator here. It yields
the :class:`Step` it needs next (a script call, a wait for a waiter's grant, ...) and is sent
that step's result, or has the step's exception thrown in at the ``yield``; it returns the
operation's result or raises its error. A shell (``_sync.py``, ``_async.py``) is a driver: it
carries each step out with its own client and concurrency primitives and decides nothing.

The steps, and what a driver returns for each, are in :mod:`gpulock.protocol.steps`, with what
the flows read of the pool object (``PoolView``) and of its runtime (``RuntimeView``: the flows
depend on that interface, not on the runtime). A driver sends a flow gpulock's own errors,
never redis-py's.
"""

from __future__ import annotations

from typing import Any, Callable

from gpulock_common import traces, tracing
from gpulock_common.traces import AcquireSpan
from gpulock_common.grace import grace_note, grace_outlasts
from gpulock_common.options import PoolSettings

from gpulock.protocol.args import (
    MAX_TTL_S,
    MIN_TTL_S,
    configure_capacity,
    encode_devices,
    ttl_ms,
    validate_request_id,
    validate_token,
)
from gpulock.protocol.lease import LeaseState, validity_deadline
from gpulock.protocol.request import AcquireRequest
from gpulock.protocol.steps import (
    Step as Step,
    Eval as Eval,
    Subscribe as Subscribe,
    Checkpoint as Checkpoint,
    MakeLease as MakeLease,
    Join as Join,
    Wait as Wait,
    TimedOut as TimedOut,
    Leave as Leave,
    Withdraw as Withdraw,
    SyncedRenew as SyncedRenew,
    GiveBack as GiveBack,
    PoolView as PoolView,
    RuntimeView as RuntimeView,
    LeaseTracker as LeaseTracker,
    WaiterQueue as WaiterQueue,
    Unanswered as Unanswered,
    SUBSCRIBE as SUBSCRIBE,
    LISTEN as LISTEN,
    CHECKPOINT as CHECKPOINT,
    _T as _T,
    Flow as Flow,
)
from gpulock.protocol.replies import (
    DeviceReply,
    Grant,
    NotGranted,
    PoolStatus,
    QueueConfig,
    Renewal,
    decode_acquire,
    decode_cancel,
    decode_configure,
    decode_device,
    decode_reap,
    decode_renew,
    decode_status,
)
from gpulock.protocol.retry import retry_bound
from gpulock.protocol.release import (
    release as release,
    release_kept as release_kept,
    release_lease as release_lease,
)
from gpulock.errors import (
    AcquireTimeout,
    BackendUnavailable,
    GpuLockError,
    InvalidArgument,
    LeaseLost,
    PoolNotFound,
)
from gpulock.units import format_size, parse_seconds


# ---- settings ---------------------------------------------------------------------------------
def push_settings(pool: PoolView, rt: RuntimeView | None) -> None:
    """Give the runtime what its heartbeat needs to create the pool again after Redis lost
    it, and its sync_replicas and retry bound (nothing when there is no runtime yet)."""
    if rt is not None:
        rt.use_settings(
            capacity=pool.capacity,
            max_waiters=pool.max_waiters,
            max_ttl_ms=ttl_ms(pool.max_ttl),
            sync_replicas=pool.sync_replicas,
            sync_timeout_ms=max(1, int(pool.sync_timeout * 1000)),
            backend_timeout=pool.backend_timeout,
        )


def configure_args(
    capacity: int,
    max_waiters: int,
    max_ttl_ms: int,
    create_only: bool,
    grace: bool,
    policy: QueueConfig | None = None,
) -> list[str]:
    """ARGV of ``configure.lua``: capacity (bytes), max_waiters, "create" (only if absent) or
    "set", max_ttl (ms), whether a pool it creates starts with a grace period, and the pool's
    scheduling settings (:meth:`QueueConfig.argv`: the queue policy, backfill window in ms,
    tenant quotas, devices, placement and preemption; each None to leave it as it is)."""
    mode = "create" if create_only else "set"
    argv = [str(capacity), str(max_waiters), mode, str(max_ttl_ms), "1" if grace else "0"]
    if policy is not None:
        argv += policy.argv()
    return argv


def configure(
    pool: PoolView,
    rt: RuntimeView | None,
    settings: PoolSettings,
    *,
    create_only: bool,
    grace: bool,
) -> Flow[dict[str, Any]]:
    """``configure``: see :meth:`gpulock.AsyncPool.configure`; ``settings`` as its keywords
    gave them (each None: the pool keeps it). Returns the reply as ``{"created", "capacity",
    "epoch", "used", "max_waiters", "policy", "backfill_window", "quotas", "devices",
    "placement", "preemption"}`` (the window in seconds; quotas: tenant -> bytes, every quota
    the pool has; devices: each device's capacity in bytes, one for a pool of one device;
    preemption: ``{"gap", "yield_grace_s"}``, None when off); a set (not
    ``create_only``) also becomes the pool object's capacity and max_ttl. Raises
    InvalidArgument naming a bad value (nothing sent)."""
    s = settings.checked()
    capacity, devs = s.capacity, None
    if s.devices is not None:
        capacity, devs = encode_devices(s.devices, capacity)
    cap = configure_capacity(capacity, pool.capacity)
    qp = QueueConfig.asked(s, devs)
    mw = pool.max_waiters if s.max_waiters is None else s.max_waiters
    mt = pool.max_ttl if s.max_ttl is None else s.max_ttl
    argv = (
        rt.configure_argv(cap, mw, ttl_ms(mt), create_only, grace, qp)
        if rt is not None
        else configure_args(cap, mw, ttl_ms(mt), create_only, grace, qp)  # it saw no pool yet
    )
    sent = pool.clock()
    rep = decode_configure((yield Eval("configure", argv)))
    if rt is not None and rep.grace_left_ms is not None:
        rt.note_grace(sent, rep.grace_left_ms)
    if not create_only:
        pool.capacity = cap
        pool.max_ttl = mt
        push_settings(pool, rt)
    out: dict[str, Any] = {
        "created": rep.created,
        "capacity": rep.capacity,
        "epoch": rep.epoch,
        "used": rep.used,
        "max_waiters": rep.max_waiters,
    }
    q = rep.queue
    if q is not None:
        out.update(q.shown(rep.capacity))
    if rt is not None:
        rt.seen(rep.epoch, rep.capacity, rep.max_waiters, rep.max_ttl_ms, q)
    return out


def status(pool: PoolView, rt: RuntimeView | None, limit: int) -> Flow[PoolStatus]:
    """``status``: a :class:`~gpulock.protocol.replies.PoolStatus`. Raises PoolNotFound."""
    sent = pool.clock()
    st: PoolStatus | None = decode_status(pool.name, (yield Eval("status", [str(limit)])))
    if st is None:
        if rt is not None:
            rt.seen(0)  # gone: if this object knew the pool, its runtime recovers now
        raise PoolNotFound(pool.name)
    if rt is not None:
        adopt_status(rt, st)
        rt.note_grace(sent, round(st.grace_left * 1000))
    return st


def adopt_status(rt: RuntimeView, st: PoolStatus) -> None:
    """Let ``rt`` take in what a status reply showed of the pool: its epoch and settings
    (:meth:`RuntimeView.seen`). Also for a reply read before the runtime started (the blocking
    shell starts it with its first acquire): from then on it knows the pool, so it makes the
    pool again with a grace period if Redis loses it."""
    rt.seen(
        st.epoch,
        st.capacity,
        st.max_waiters,
        ttl_ms(st.max_ttl) if st.max_ttl else 0,
        st.queue_config(),
    )


def device_report(
    sampler_id: str,
    claim_ms: int,
    external: int | None = None,
    report_ms: int = 0,
    overuse: str = "",
) -> Flow[DeviceReply]:
    """``external.lua``: claim the pool's device sampler (``external`` None) or claim and
    report. Raises InvalidArgument (a bad value, named), PoolNotFound, BackendUnavailable."""
    if external is None:
        argv = [sampler_id, str(claim_ms), "claim"]
    else:
        argv = [sampler_id, str(claim_ms), "report", str(external), str(report_ms), overuse]
    return decode_device((yield Eval("external", argv)))


def reap() -> Flow[int]:
    """``reap``: how many leases were reaped."""
    return decode_reap((yield Eval("reap", []))).reaped_leases


def cancel(rt: RuntimeView | None, request_id: str) -> Flow[int]:
    """Withdraw a (remote holder's) request: 0 (nothing to do), 1 (left the queue) or 2 (its
    grant was released). Raises InvalidArgument, BackendUnavailable."""
    request_id = validate_request_id(request_id)
    if rt is not None:
        rt.remove_waiter(request_id)
    return decode_cancel((yield Eval("cancel", [request_id]))).outcome


def renew(lease_id: str, token: int, ttl: float) -> Flow[Renewal]:
    """Extend a (remote holder's) lease to ``ttl`` seconds from now (server clock); never
    re-acquires. Returns a :class:`Renewal`: ``(expires_ms, server_now_ms,
    yield_deadline_ms)`` (the last 0 unless the server asked the holder to yield it).

    Raises: LeaseLost (expired, released, unknown, or another token), InvalidArgument,
    BackendUnavailable."""
    ttl_s = parse_seconds(ttl, name="ttl", minimum=MIN_TTL_S, maximum=MAX_TTL_S)
    args = ["1", lease_id, str(validate_token(token)), str(ttl_ms(ttl_s)), "0"]
    rep = decode_renew((yield Eval("renew", args)))
    (expires_ms,) = rep.expiries
    (asked,) = rep.yields
    if expires_ms <= 0:
        raise LeaseLost(
            lease_id,
            "the pool's configuration is gone (Redis restarted without its data?)"
            if rep.epoch == 0
            else "the server no longer has it (it expired, or was released)",
        )
    return Renewal(expires_ms, rep.now_ms, asked)


# ---- acquire ----------------------------------------------------------------------------------
def lease_state(
    rt: LeaseTracker, grant: Grant, req: AcquireRequest, valid_until: float
) -> LeaseState:
    """The local state of a granted lease, heartbeated from now on (an existing one when this
    process already holds that lease: the same request id acquired again). For a driver's
    :class:`MakeLease`."""
    state, new = rt.state_for(grant, req.ttl_s, valid_until, req.meta, req.tenant, req.resident)
    if new:
        state.priority = req.priority
        state.preemptible = req.preemptible
        if req.keepable and rt.kept.on:
            state.keeper = rt.kept
        rt.track(state)
    return state


def acquire_call(
    pool: PoolView,
    rt: RuntimeView,
    req: AcquireRequest,
    argv: list[str],
    start: float | None = None,
    deadline: float | None = None,
) -> Flow[tuple[Grant | NotGranted, float]]:
    """One ``acquire.lua`` call, retried until the caller's deadline
    (:func:`~gpulock.protocol.retry.retry_bound`): ``deadline`` (local time) when given, else
    ``start`` (the local time of the acquire, default now) plus its timeout. A pool found gone
    is created again first: by an object that had seen it (Redis lost it) as the server last
    showed it, with a grace period, whether or not the object was given a capacity (it may
    rely on an operator's ``pool set``); by one that never saw it, with its own capacity.
    Returns ``(Grant | NotGranted, sent)``, ``sent`` the local time the successful call was
    sent.

    Raises PoolNotFound when the pool is gone and the object never saw it and has no capacity
    (nothing to make it again from)."""
    sent = pool.clock()
    left = None
    if deadline is not None:
        left = deadline - sent
    elif req.timeout_s is not None:
        left = req.timeout_s - (sent - (sent if start is None else start))
    try:
        r = yield Eval("acquire", argv, bound=retry_bound(pool.backend_timeout, left))
    except PoolNotFound:
        rt.seen(0)  # gone: if this object knew the pool, its runtime recovers now
        capacity = rt.remake_capacity() or pool.capacity
        if capacity is None:
            raise  # never seen, and no capacity of its own: nothing to make it again from
        # no grace asked here: the runtime's configure_argv asks for one when this object
        # knew the pool (so Redis lost it), and makes it again as last seen
        yield from configure(pool, rt, PoolSettings(capacity), create_only=True, grace=False)
        sent = pool.clock()
        r = yield Eval("acquire", argv)
    res = decode_acquire(req.ticket, r)
    rt.observe(sent, res.now_ms)
    rt.seen(res.epoch, res.capacity)
    rt.note_grace(sent, res.grace_left_ms if isinstance(res, NotGranted) else 0)
    return res, sent


def _retry_after(res: NotGranted) -> float | None:
    return res.retry_after_ms / 1000 if res.retry_after_ms >= 0 else None


def acquire(
    pool: PoolView,
    rt: RuntimeView,
    req: AcquireRequest,
    start: float,
    on_queued: Callable[[int], Any] | None,
) -> Flow[Any]:
    """``acquire``: see :meth:`gpulock.AsyncPool.acquire` (arguments in ``req`` and
    ``on_queued``; ``start``: the local time of the call). Returns the shell's lease object.

    Whatever ends it, nothing is left behind: from sending the acquire until a lease is
    returned, the server may hold a place or a grant for the ticket, and an error, a timeout
    or a cancellation withdraws it (unless another local acquire still uses the ticket). A
    refusal by the script (an error other than BackendUnavailable) wrote nothing, and is not
    withdrawn; when Redis did not answer, the withdrawal runs in the background.

    Traced (:class:`gpulock_common.traces.AcquireSpan`: the ``gpulock.acquire`` span, and
    the lease's span from its grant) while :func:`gpulock_common.tracing.recording`."""
    tr = (
        AcquireSpan.begin(pool.name, req.amount, req.priority, req.tenant, req.device, start)
        if tracing.recording()
        else None
    )
    steps = _acquire(pool, rt, req, start, on_queued, tr)
    return steps if tr is None else traces.traced(tr, steps, pool.clock)


def _acquire(
    pool: PoolView,
    rt: RuntimeView,
    req: AcquireRequest,
    start: float,
    on_queued: Callable[[int], Any] | None,
    tr: AcquireSpan | None,
) -> Flow[Any]:
    """:func:`acquire`'s flow; ``tr``: its trace (None: not traced)."""
    if on_queued is not None and not callable(on_queued):
        # Checked before anything is sent: it is called only once the request queues, so
        # a bad one would otherwise fail (a TypeError) only under contention.
        raise InvalidArgument(f"on_queued must be callable or None, got {on_queued!r:.80}")
    wait = req.timeout_s != 0
    if wait and not rt.subscribed:
        yield SUBSCRIBE
    if req.preemptible and not req.resident and not rt.listening:
        yield LISTEN  # an ask to yield may come right after the grant: listen before it
    argv = req.argv("wait" if wait else "try", rt.channel_id)
    needs_cancel = True
    unreachable = False  # Redis did not answer the acquire: its withdrawal goes to the background
    joined: Any = None
    join: Join | None = None
    try:
        try:
            res, sent = yield from acquire_call(pool, rt, req, argv, start)
        except GpuLockError as e:
            unreachable = isinstance(e, BackendUnavailable)
            needs_cancel = unreachable  # any other error: the script refused before writing
            raise
        yield CHECKPOINT
        if isinstance(res, Grant):
            needs_cancel = False
            lease, state = yield MakeLease(
                res, req, validity_deadline(sent, res.now_ms, res.expires_ms)
            )
            if tr is not None:
                tr.granted(state, pool.clock())
            if pool.sync_replicas:
                yield from sync_grant(pool, state, lease)
            return lease
        if res.resident is not None:
            needs_cancel = False
            raise AcquireTimeout(
                f"pool {pool.name!r}: a resident lease of {req.amount} bytes "
                f"({format_size(req.amount)}) does not fit the capacity, {res.capacity} bytes, "
                f"next to the resident leases held and queued, {res.resident} bytes: it is not "
                f"queued (it could stall the queue); try again when one of them has ended",
                queue_length=res.queue_length,
                retry_after=_retry_after(res),
                estimated_wait=res.estimated_wait,
            )
        if not res.queued:
            needs_cancel = False
            grace = res.grace_left_ms / 1000
            raise AcquireTimeout(
                f"pool {pool.name!r}: {req.amount} bytes not available now (timeout=0; "
                + (
                    f"{res.queue_length} waiting): {grace_note(pool.name, grace)}"
                    if grace > 0
                    else f"{res.queue_length} waiting, {res.used}/{res.capacity} bytes used"
                    + (
                        f", {res.held_back} held back for device memory in use outside the "
                        f"pool's leases)"
                        if res.held_back
                        else ")"
                    )
                ),
                queue_length=res.queue_length,
                retry_after=_retry_after(res),
                grace_left=grace,
                estimated_wait=res.estimated_wait,
            )
        if tr is not None:
            tr.queued(res.place)
            on_queued = tr.watching(on_queued)
        grace = res.grace_left_ms / 1000
        if req.timeout_s is not None and grace_outlasts(grace, start + req.timeout_s - sent):
            # nothing is granted before the grace period ends, and the timeout ends first:
            # leave the queue now (the finally withdraws the place) rather than wait for nothing
            raise AcquireTimeout(
                f"pool {pool.name!r}: no grant of {req.amount} bytes within {req.timeout_s}s "
                f"(position {res.position} of {res.queue_length}): the timeout ends before "
                f"the grace period does, so the request left the queue at once; "
                f"{grace_note(pool.name, grace)}",
                position=res.position,
                queue_length=res.queue_length,
                retry_after=grace,
                waited=pool.clock() - start,
                grace_left=grace,
            )
        if on_queued is not None:
            on_queued(res.place)  # first here, on the caller's side; later ones: the runtime
        join = Join(
            req.ticket,
            argv,
            ttl_ms(req.waiter_ttl_s),
            res.position,
            on_queued,
            res.retry_after_ms,
            None if req.timeout_s is None else start + req.timeout_s,
        )
        joined = yield join
        remaining = (
            None if req.timeout_s is None else max(0.0, req.timeout_s - (pool.clock() - start))
        )
        try:
            got = yield Wait(joined, remaining)
        except BackendUnavailable:
            unreachable = True  # withdraw in the background
            raise
        if isinstance(got, TimedOut):
            down = rt.unreachable()
            if down is not None:  # the deadline passed while Redis (the shard) was away
                unreachable = True  # withdraw in the background
                raise BackendUnavailable(
                    f"pool {pool.name!r}: no grant of {req.amount} bytes within "
                    f"{req.timeout_s}s, and Redis unreachable for {down[0]:.1f}s: {down[1]}"
                )
            where = (
                f"position {res.position} of {res.queue_length}+ when queued"
                if got.position is None
                else f"position {got.position} of {res.queue_length}+"
            )
            grace = rt.grace_left()
            raise AcquireTimeout(
                f"pool {pool.name!r}: no grant of {req.amount} bytes within {req.timeout_s}s "
                f"({where})" + (f": {grace_note(pool.name, grace)}" if grace > 0 else ""),
                position=res.position if got.position is None else got.position,
                queue_length=res.queue_length,
                retry_after=max(grace, _retry_after(res) or 0.0)
                if grace > 0
                else _retry_after(res),
                waited=pool.clock() - start,
                grace_left=grace,
            )
        lease, state = yield MakeLease(got, req, rt.deadline_for(got))
        needs_cancel = False
        if tr is not None:
            tr.granted(state, pool.clock())
        if pool.sync_replicas:
            yield from sync_grant(pool, state, lease)
        return lease
    finally:
        in_use = False
        if joined is not None:
            in_use = yield Leave(joined, needs_cancel)
        elif needs_cancel:
            if join is not None:
                join.undo(rt)  # the Join raised after registering: see Join.undo
            in_use = rt.ticket_in_use(req.ticket)
        if needs_cancel and not in_use:
            yield Withdraw(req.ticket, unreachable)


# ---- sync_replicas ----------------------------------------------------------------------------
def sync_grant(pool: PoolView, s: LeaseState, lease: Any) -> Flow[None]:
    """``sync_replicas``: return a grant (``lease``, the shell's lease object, with its local
    state ``s``) only once that many replicas have it, so that a failover to one of them
    cannot hand the same bytes to someone else (the lost tail of asynchronous replication). A
    renewal, an INCR and ``WAIT`` on one connection; the lease's validity then counts from
    that renewal. If the replicas do not acknowledge in ``sync_timeout``, the grant is given
    back and BackendUnavailable raised (a cancellation or interrupt meanwhile also gives it
    back, and propagates)."""
    sent = pool.clock()
    rep, acked, err = None, -1, None
    try:
        # retried while the grant is valid: a failover right after it is ridden out when a
        # replica had it (its renewal then goes to the promoted one); the validity counts
        # from the first try's sending, earlier than the one that got through (safe side)
        r, acked = yield SyncedRenew(
            [1, s.lease_id, s.token, ttl_ms(s.ttl_s), 0], max(0.0, s.seconds_left())
        )
        rep = decode_renew(r)
    except GeneratorExit:
        raise
    except BaseException as e:  # noqa: BLE001 - also on cancellation: give the grant back
        err = e
    if err is None and rep is not None and rep.expiries[0] > 0 and acked >= pool.sync_replicas:
        s.renewed(sent, rep.now_ms, rep.expiries[0])
        if rep.yields[0] > 0:
            s.asked(rep.yields[0])
        return None
    yield GiveBack(lease)
    if err is not None and not isinstance(err, Exception):
        raise err
    raise BackendUnavailable(
        f"pool {pool.name!r}: the grant was not acknowledged by {pool.sync_replicas} replica(s) "
        f"within {pool.sync_timeout}s (acknowledged by {max(acked, 0)}"
        f"{'; ' + str(err) if err else ''}); it was given back, since a failover could lose it"
    ) from err
