"""Places kept for remote holders: the part of the protocol a proxy (the HTTP broker) needs.

A proxy acquires for clients on other hosts, which renew and release through it. So a grant
it gets is *not* heartbeated by the proxy's process (the remote client renews it, or it
expires after its ttl), and a queued request keeps its place across the client's retries:
the pool object's runtime refreshes the place and catches its grant (one pub/sub connection
for all of them; no task, thread or connection per request) until
:meth:`gpulock.AsyncPool.wait_remote` hands the grant over or
:meth:`~gpulock.AsyncPool.cancel_remote` withdraws it. The caller must do one of the two.
"""

from __future__ import annotations

import asyncio

from gpulock.protocol.args import ttl_ms, validate_request_id
from gpulock.protocol.request import AcquireRequest
from gpulock.protocol.replies import Grant, NotGranted
from gpulock.runtime.runtime import Runtime, Waiter
from gpulock.runtime.waiters import WaiterFuture
from gpulock.transport.translate import translate


def keep_place(
    rt: Runtime, req: AcquireRequest, argv: list[str], res: Grant | NotGranted, now: float
) -> None:
    """After an acquire sent for a remote holder (``argv``: the acquire's arguments, sent
    again by the runtime's refreshes; ``now``: the pool's monotonic clock, seconds): keep its
    place in the runtime when it queued, or hand a grant to whoever waits on the place."""
    w = rt.waiters.get(req.ticket)
    if isinstance(res, Grant):
        if w is not None:  # granted meanwhile: hand it to concurrent wait_remote calls too
            rt.remove_waiter(req.ticket)
            if not w.future.done():
                w.future.set_result(res)
    elif res.queued:
        if w is None or w.future.done():
            fut = WaiterFuture(loop=asyncio.get_running_loop())
            rt.add_waiter(Waiter(req.ticket, fut, argv, ttl_ms(req.waiter_ttl_s), res.position))
        else:
            w.position = res.position
        rt.set_reap_timer(now, res.retry_after_ms)


async def wait_grant(rt: Runtime, pool: str, request_id: str, timeout: float) -> Grant | None:
    """The grant of a place kept by :func:`keep_place`, within ``timeout`` seconds (then the
    place is forgotten here), or None: the timeout passed, or no place is kept for
    ``request_id``; a place kept stays kept. Raises InvalidArgument, BackendUnavailable."""
    request_id = validate_request_id(request_id)
    w = rt.waiters.get(request_id)
    if w is None:
        return None
    done, _ = await asyncio.wait((w.future,), timeout=timeout)
    if not done:
        return None
    if rt.waiters.get(request_id) is w:
        rt.remove_waiter(request_id)
    try:
        grant: Grant = w.future.result()  # a waiter's future carries its Grant
        return grant
    except Exception as e:
        raise translate(e, pool) from e
