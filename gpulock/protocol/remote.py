"""The flows of a proxy's remote holders: the part of the protocol the HTTP broker needs.

A proxy acquires for clients on other hosts, which renew and release through it. So a grant
it gets is *not* heartbeated by the proxy's process (the remote client renews it, or it
expires after its ttl), and a queued request keeps its place across the client's retries:
the pool object's runtime keeps the place (:class:`~gpulock.protocol.steps.PlaceKeeper`:
refreshed by its heartbeat, the grant caught by its listener; no task, thread or connection
per request) until :func:`wait_place` hands the grant over or :func:`gpulock.protocol.flow.cancel`
withdraws it. The caller must do one of the two. Renewal and release are
:func:`gpulock.protocol.flow.renew` and :func:`gpulock.protocol.flow.release`.
"""

from __future__ import annotations

from gpulock.protocol.args import ttl_ms, validate_request_id
from gpulock.protocol.flow import acquire_call
from gpulock.protocol.replies import Grant, NotGranted
from gpulock.protocol.request import AcquireRequest
from gpulock.protocol.steps import SUBSCRIBE, Flow, PlaceKeeper, PoolView, TimedOut, Wait

__all__ = ["enqueue", "wait_place"]


def enqueue(
    pool: PoolView, rt: PlaceKeeper, req: AcquireRequest, queue: bool, deadline: float | None
) -> Flow[Grant | NotGranted]:
    """One acquire of ``req`` on behalf of a remote holder (``queue`` False: never queued),
    its connection errors retried until ``deadline`` (local time; None: the pool's
    ``backend_timeout``). Idempotent by the request's ticket: sent again it refreshes the
    place and returns the current position, or the grant made to it meanwhile (with the
    server's current time as ``now_ms``). A queued request's place is kept by the runtime; a
    grant goes to whoever waits on a place kept for it.

    Raises: InvalidArgument, CapacityExceeded, PoolNotFound, QueueFull, BackendUnavailable."""
    if queue and not rt.subscribed:
        yield SUBSCRIBE
    argv = req.argv("wait" if queue else "try", rt.channel_id)
    res, _ = yield from acquire_call(pool, rt, req, argv, deadline=deadline)
    if isinstance(res, Grant):
        rt.hand_over(res)
    elif res.queued:
        rt.keep_place(req.ticket, argv, ttl_ms(req.waiter_ttl_s), res.position, res.retry_after_ms)
    return res


def wait_place(rt: PlaceKeeper, request_id: str, timeout: float) -> Flow[Grant | None]:
    """The grant of the place kept for ``request_id`` (:func:`enqueue`), within ``timeout``
    seconds (then the place is forgotten), or None: the timeout passed (the place stays
    kept), or no place is kept for ``request_id``.

    Raises: InvalidArgument, the wait's failure (BackendUnavailable: re-queueing a request the
    server had dropped failed; PoolClosed); the place is forgotten then."""
    handle = rt.kept_place(validate_request_id(request_id))
    if handle is None:
        return None
    try:
        got = yield Wait(handle, timeout)
    except Exception:  # the wait ended with an error (not a cancellation): its place too
        rt.forget_place(handle)
        raise
    if isinstance(got, TimedOut):
        return None
    rt.forget_place(handle)
    grant: Grant = got
    return grant
