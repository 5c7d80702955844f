"""Resizing a held lease as I/O-free step machines (docs/SEMANTICS.md, "Resizing a lease"):
:func:`resize_lease` (a lease of this process, ``lease.resize``) and :func:`resize` (any lease
by id: a proxy's remote holders), over one ``resize.lua`` call and, for a growth that queues,
the runtime's waiter (refreshed, caught by the listener and re-queued after a loss as an
acquire's waiter is). The lease keeps its id and token.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from gpulock_common.options import AcquireOptions

from gpulock.errors import AcquireTimeout, BackendUnavailable, LeaseLost, PoolNotFound
from gpulock.protocol.args import ttl_ms
from gpulock_common import traces
from gpulock.protocol.lease import LeaseState
from gpulock.protocol.replies import Grant, decode_acquire
from gpulock.protocol.retry import retry_bound
from gpulock.protocol.steps import (
    SUBSCRIBE,
    Eval,
    Flow,
    Join,
    Leave,
    PoolView,
    RuntimeView,
    TimedOut,
    Wait,
    WaiterQueue,
    Withdraw,
)
from gpulock.units import format_size, parse_size

__all__ = ["grow_ticket", "resize", "resize_args", "resize_lease"]


class ResizeRuntime(RuntimeView, WaiterQueue, Protocol):
    """What a resize needs of the runtime: the flows' view and its waiter queue."""


def grow_ticket(lease_id: str) -> str:
    """The queue ticket of the growth of lease ``lease_id`` (``lua/lib.lua`` grow_ticket)."""
    return "grow:" + lease_id


def resize_args(amount: int | str, timeout: float | None) -> tuple[int, float | None]:
    """``(bytes, timeout seconds or None)`` as an acquire checks them (a size string or bytes;
    :meth:`AcquireOptions.checked`'s timeout). Raises InvalidArgument naming the bad value."""
    return parse_size(amount), AcquireOptions(timeout=timeout).checked().timeout


def _argv(
    lease_id: str,
    token: int | None,
    amount: int,
    mode: str,
    channel: str,
    priority: int,
    waiter_ttl_s: float,
) -> list[str]:
    """ARGV of ``resize.lua`` (the lease's ttl: '' , the one in its record)."""
    return [
        grow_ticket(lease_id),
        lease_id,
        str(amount),
        "",
        str(ttl_ms(waiter_ttl_s)),
        mode,
        "" if token is None else str(token),
        channel,
        str(priority),
    ]


def resize(
    pool: PoolView,
    rt: ResizeRuntime,
    lease_id: str,
    token: int | None,
    amount: int,
    timeout_s: float | None,
    start: float,
    *,
    priority: int = 0,
    waiter_ttl_s: float,
    on_queued: Callable[[int], Any] | None = None,
) -> Flow[tuple[Grant, float | None]]:
    """Resize lease ``lease_id`` (``token``: its fencing token; None: any) to ``amount`` bytes,
    a growth waiting up to ``timeout_s`` seconds from ``start`` (local time; None: forever,
    0: never queued) at ``priority``. Returns ``(grant, sent)``: the lease as the server has it
    now (``amount``, ``token``, ``expires_ms``), and the local time the call that answered it
    was sent (None when a hand-off granted the growth: the lease was not renewed then).
    ``on_queued(position)``: called when the growth queues, and when a refresh finds its
    place changed (as an acquire's).

    Whatever ends a growth that queued (a timeout, an error, a cancellation) withdraws it: a
    ``resize`` back to the amount before, which also undoes a grant that raced in.

    Raises: InvalidArgument, LeaseLost, CapacityExceeded (QuotaExceeded, RoomExceeded),
    ResizeRefused, QueueFull, AcquireTimeout (the lease keeps its amount), PoolNotFound,
    BackendUnavailable."""
    wait = timeout_s != 0
    if wait and not rt.subscribed:
        yield SUBSCRIBE
    ticket = grow_ticket(lease_id)
    argv = _argv(
        lease_id, token, amount, "wait" if wait else "try", rt.channel_id, priority, waiter_ttl_s
    )
    sent = pool.clock()
    left = None if timeout_s is None else timeout_s - (sent - start)
    try:
        r = yield Eval("resize", argv, bound=retry_bound(pool.backend_timeout, left))
    except PoolNotFound:
        # Gone: the lease's recovery (the heartbeat's) starts now and puts it back; the pool
        # is not made again here, where the lease would not be in it yet.
        rt.seen(0)
        raise
    res = decode_acquire(ticket, r)
    rt.observe(sent, res.now_ms)
    rt.seen(res.epoch, res.capacity)
    if isinstance(res, Grant):
        return res, sent
    current = int(r[10])
    what = f"lease {lease_id[:8]}… of {current} bytes: growing it to {amount} bytes ({format_size(amount)})"
    if not res.queued:
        raise AcquireTimeout(
            f"pool {pool.name!r}: {what} not possible now (timeout=0; {res.queue_length} waiting, "
            f"{res.used}/{res.capacity} bytes used); it keeps its amount",
            queue_length=res.queue_length,
            retry_after=res.retry_after_ms / 1000 if res.retry_after_ms >= 0 else None,
            grace_left=res.grace_left_ms / 1000,
            estimated_wait=res.estimated_wait,
        )
    undo = _argv(lease_id, token, current, "try", rt.channel_id, priority, waiter_ttl_s)
    joined = None
    join: Join | None = None
    withdraw, unreachable = True, False
    try:
        if on_queued is not None:
            on_queued(res.place)  # first here; later ones: the runtime's refreshes
        join = Join(
            ticket,
            argv,
            ttl_ms(waiter_ttl_s),
            res.position,
            on_queued,
            res.retry_after_ms,
            None if timeout_s is None else start + timeout_s,
            "resize",
        )
        joined = yield join
        remaining = None if timeout_s is None else max(0.0, timeout_s - (pool.clock() - start))
        try:
            got = yield Wait(joined, remaining)
        except BackendUnavailable:
            unreachable = True
            raise
        if isinstance(got, TimedOut):
            raise AcquireTimeout(
                f"pool {pool.name!r}: {what} not granted within {timeout_s}s (position "
                f"{res.position if got.position is None else got.position} of "
                f"{res.queue_length}+); it keeps its amount",
                position=res.position if got.position is None else got.position,
                queue_length=res.queue_length,
                retry_after=res.retry_after_ms / 1000 if res.retry_after_ms >= 0 else None,
                waited=pool.clock() - start,
            )
        withdraw = False
        grant: Grant = got
        return grant, None
    finally:
        in_use = False
        if joined is not None:
            in_use = yield Leave(joined, withdraw)
        elif join is not None:
            join.undo(rt)  # the Join raised after registering: see Join.undo
            in_use = rt.ticket_in_use(ticket)
        if withdraw and not in_use:
            yield Withdraw(ticket, unreachable, "resize", undo)


def resize_lease(
    pool: PoolView,
    rt: ResizeRuntime,
    s: LeaseState,
    amount: int | str,
    timeout: float | None,
    start: float,
    *,
    waiter_ttl_s: float,
) -> Flow[None]:
    """``lease.resize(amount, timeout=...)`` of lease ``s`` held by this process: see
    :func:`resize`; the growth queues at its lease's place (ahead of the new requests the
    lease's request was ahead of; its priority counts where the server keeps no place).
    Afterwards ``s.amount`` is the
    new amount; a reply that answered at once renewed the lease, and its local validity counts
    from that call (never beyond the server's expiry). The same amount is a no-op (no call).

    A traced lease (:mod:`gpulock_common.traces`) gets a ``gpulock.resize`` event on its span
    (from and to bytes, outcome, seconds taken); a LeaseLost ends the span as lost.

    Raises: as :func:`resize`; LeaseLost also when the lease was released or found lost
    here (nothing is sent)."""
    n, timeout_s = resize_args(amount, timeout)
    if s.released:
        raise LeaseLost(s.lease_id, "it was released")
    s.check()  # LeaseLost when lost, or past its local validity deadline
    if n == s.amount:
        return None
    before = s.amount
    try:
        grant, sent = yield from resize(
            pool,
            rt,
            s.lease_id,
            s.token,
            n,
            timeout_s,
            start,
            priority=s.priority,
            waiter_ttl_s=waiter_ttl_s,
        )
    except LeaseLost as e:
        s.mark_lost(e.reason)  # ends a traced lease's span (lost)
        raise
    except BaseException as e:
        if s.span is not None:
            traces.resized(s, before, n, e, pool.clock() - start)
        raise
    s.amount = grant.amount
    if sent is not None:
        s.renewed(sent, grant.now_ms, grant.expires_ms)
    if s.span is not None:  # after the renewal its answer is (the SDK's order too)
        traces.resized(s, before, n, None, pool.clock() - start)
    return None
