"""The FastAPI router of the HTTP lease API, ``/v1``. Mount it in any FastAPI app::

    from gpulock_broker import router, Broker, load_tokens
    app.include_router(router)
    # in the app's lifespan:
    broker = Broker(redis_url, load_tokens())
    await broker.start(); app.state.gpulock_broker = broker
    ...
    await broker.aclose()

Status codes: 201 granted; 200 renewed/resized/released/status/configured/deleted; 503 queued
past ``wait`` (an acquire, or a lease's growth) (with ``Retry-After`` and ``X-Queue-Position``; the place is kept for a retry with the
same ``request_id``), queue full, or Redis unavailable; 413 amount above capacity; 422 bad input
(the field is named in ``detail[].loc``); 401 no or unknown bearer token; 403 pool not allowed
for the token (or not admin); 404 pool not configured, or a lease of another token; 409 pool
delete refused while leases or waiters are live, or a growth refused by the deadlock rule
(``resize_refused``); 410 the lease is lost. Error bodies are
``{"detail": {"error": CODE, "message": TEXT, ...}}`` (422: FastAPI's
``{"detail": [{"loc": [...], "msg": ...}]}``). Each route declares them in the OpenAPI schema
(``responses.py``), with the links from a grant to its lease's operations.

This module has the routes of a lease's life (acquire, renew, resize, release, withdraw a
request); the pools' are ``api_pools.py``'s, included in :data:`router`; what they share
(dependencies, path parameters, error answers) is ``api_common.py``'s.
"""

from __future__ import annotations

import time
from typing import Optional

from fastapi import APIRouter, Body, Depends, Request, Response
from gpulock_common import tracing
from gpulock_common.grace import grace_note
from gpulock_common.wire import answer_for

from gpulock.errors import QueueFull
from gpulock.http.disconnect import watch_disconnect

from .api_common import (
    LeaseId,
    PoolName,
    RequestId,
    _allowed,
    _err,
    _map,
    get_broker,
    principal,
)
from .api_pools import router as pools_router
from .auth import Principal
from .responses import LINKS, errors
from .routing import FiniteJSONRoute
from .core import (
    Broker,
    Granted,
    Resized,
)
from .outcomes import Queued, Refused
from .answers import (
    LeaseGrant,
    QueuedPlace,
    LeaseReleased,
    LeaseRenewed,
    LeaseResized,
    RequestCancelled,
)
from .models import (
    LeaseRequest,
    RenewRequest,
    ResizeRequest,
)

router = APIRouter(prefix="/v1", tags=["leases"], route_class=FiniteJSONRoute)


@router.post(
    "/pools/{pool}/leases",
    status_code=201,
    response_model=LeaseGrant,
    operation_id="acquire_lease",
    responses={
        201: {"description": "granted", "links": LINKS["granted"]},
        **errors(
            s404="pool_not_found: the pool is not configured",
            s413="capacity_exceeded: amount is above the pool's capacity, or, on a pool of "
            "several devices, above the capacity of the device named by device (else of the "
            "largest device): it can never be granted (amount and capacity in the body); "
            "room_exceeded: amount fits the capacity but not the room the pool's resident "
            "leases (models held for their holders' life) leave, held or queued (amount, "
            "room, capacity, resident and device in the body); quota_exceeded: amount is "
            "above the quota of the token's tenant, or what the tenant's resident leases "
            "leave of it (amount, quota, tenant and resident in the body); or "
            "request_too_large: the body is over "
            "the size bound",
            s503="queued: still waiting after `wait` seconds (request_id, position, "
            "hold_place_for, estimated_wait_s; Retry-After and X-Queue-Position; retry with the same request_id "
            "to keep the place); busy: not available now and queue=false; queue_full; "
            "backend_unavailable",
            validation="A value the schema refuses (named in detail[].loc; a bad priority is "
            "named with its value), a ttl above the pool's max_ttl (a bound each pool sets, GET "
            "/v1/pools/{pool}), a device the pool does not have (named), or a request_id "
            "already used for another amount",
        ),
    },
    summary="Acquire a lease (or wait in the queue)",
)
async def acquire_lease(
    request: Request,
    response: Response,
    body: LeaseRequest,
    pool: str = PoolName,
    who: Principal = Depends(principal),
    broker: Broker = Depends(get_broker),
) -> LeaseGrant:
    """Take ``amount`` bytes of ``pool``, waiting in its queue by ``priority`` (higher first;
    a queued request gains one level per second waited), then arrival; on the device
    ``device`` when given, else where the pool's placement puts it (the 201 names the
    device). Granted: 201; one granted after it queued in this request (a long poll) says
    the place it took in ``queued`` (position, queue_length, estimated_wait_s; null when
    granted at once). Still
    queued after ``wait`` seconds: 503 with ``Retry-After`` (seconds) and ``X-Queue-Position``;
    retry with the same ``request_id`` to keep the place (it is kept ``hold_place_for`` seconds)
    and to get the same grant if it was made meanwhile. The 503's ``estimated_wait_s`` is the
    server's estimate of the seconds until the grant (busy, not queued: had it joined the
    queue's tail; null while the pool's drain rate is not measured; docs/SEMANTICS.md, "Wait
    estimate"), and ``Retry-After`` is that estimate (null: the time to the nearest lease
    expiry) rounded up to whole seconds, at least the grace period left, at most half the
    longest a place is kept (queued), within [1, the broker's cap]; 0 for a request held at
    least a second (a long poll) outside a grace period: come back now to go on waiting."""
    t0 = time.monotonic()  # held_ms: how long this request was held here before the grant reply
    # on the request's server span (when traced); the core makes no span for a remote holder
    tracing.annotate(
        {
            tracing.POOL: pool,
            tracing.AMOUNT: body.amount_bytes,
            tracing.PRIORITY: body.options.priority,
            tracing.TENANT: who.tenant or None,
        }
    )
    _allowed(who, pool)
    # a client that hangs up during the long poll leaves the queue at once (uvicorn does not
    # cancel the handler by itself)
    gone = watch_disconnect(request) if body.wait > 0 else None
    try:
        r = await broker.acquire(
            who, pool, body.amount_bytes, body.options, wait=body.wait, queue=body.queue, gone=gone
        )
    except Exception as e:
        err = e.error if isinstance(e, Refused) else e  # (with its Retry-After)
        if isinstance(err, QueueFull):
            broker.count_event(pool, "rejected")
        _traced_outcome(None, err)
        _map(e, pool)
    finally:
        if gone is not None:
            gone.cancel()
    _traced_outcome(r)
    if not isinstance(r, Granted):
        broker.count_event(pool, "rejected")  # the 503 below (queued or busy)
    if isinstance(r, Granted):
        g = r.grant
        held_ms = max(0, int((time.monotonic() - t0) * 1000))  # floor: never more than it was held
        return LeaseGrant(
            held_ms=held_ms,
            lease_id=g.lease_id,
            pool=pool,
            amount=g.amount,
            token=g.token,
            ttl=r.ttl_s,
            expires_in=max(0, g.expires_ms - g.now_ms) / 1000,
            expires_at=g.expires_ms / 1000,
            acquired_at=r.acquired_ms / 1000,
            request_id=r.request_id,
            device=g.device,
            queued=None
            if r.queued is None
            else QueuedPlace(
                position=r.queued.position,
                queue_length=r.queued.queue_length,
                estimated_wait_s=r.queued.estimated_wait_s,
            ),
        )
    headers = {"Retry-After": str(r.retry_after_s)}
    grace = f": {grace_note(pool, r.grace_left_s)}" if r.grace_left_s > 0 else ""
    if r.queued:
        headers["X-Queue-Position"] = str(r.position)
        _err(
            503,
            "queued",
            f"queued at position {r.position} of {r.queue_length}{grace}; retry with the same "
            f"request_id within {r.hold_s:g}s to keep the place",
            headers,
            request_id=r.request_id,
            position=r.position,
            queue_length=r.queue_length,
            retry_after=r.retry_after_s,
            hold_place_for=r.hold_s,
            grace_left=r.grace_left_s,
            estimated_wait_s=r.estimated_wait_s,
        )
    _err(
        503,
        "busy",
        f"not available now ({r.queue_length} queued) and queue=false{grace}",
        headers,
        request_id=r.request_id,
        queue_length=r.queue_length,
        retry_after=r.retry_after_s,
        grace_left=r.grace_left_s,
        estimated_wait_s=r.estimated_wait_s,
    )


def _traced_outcome(r: Granted | Queued | None, error: BaseException | None = None) -> None:
    """An acquire request's outcome on its server span (when traced): granted (lease id,
    fencing token, the place it queued at with the estimate then, position 0 when granted
    at once), queued (position), busy, or refused (the error's wire code)."""
    if not tracing.recording():
        return
    attrs: dict[str, object]
    if error is not None:
        a = answer_for(error)
        attrs = {
            tracing.OUTCOME: "refused",
            tracing.ERROR_CODE: a.code if a is not None else type(error).__name__,
        }
    elif isinstance(r, Granted):
        q = r.queued
        attrs = {
            tracing.OUTCOME: "granted",
            tracing.LEASE_ID: r.grant.lease_id,
            tracing.FENCING_TOKEN: r.grant.token,
            tracing.DEVICE: r.grant.device,
            tracing.POSITION: 0 if q is None else q.position,
            tracing.ESTIMATED_WAIT: None if q is None else q.estimated_wait_s,
        }
    else:
        assert r is not None
        attrs = {
            tracing.OUTCOME: "queued" if r.queued else "busy",
            tracing.POSITION: r.position if r.queued else None,
        }
    tracing.annotate(attrs)


@router.put(
    "/pools/{pool}/leases/{lease_id}",
    response_model=LeaseRenewed,
    operation_id="renew_lease",
    responses={
        200: {"description": "renewed", "links": LINKS["renewed"]},
        **errors(
            s404="pool_not_found, or not_found: no lease of this id for this token",
            s410="lease_lost: the lease expired, was released, or its pool was reset or "
            "deleted; its holder must stop using the memory",
            validation="A value the schema refuses (named in detail[].loc), or a ttl above the "
            "pool's max_ttl",
        ),
    },
    summary="Renew (heartbeat) a lease",
)
async def renew_lease(
    body: Optional[RenewRequest] = Body(None),
    pool: str = PoolName,
    lease_id: str = LeaseId,
    who: Principal = Depends(principal),
    broker: Broker = Depends(get_broker),
) -> LeaseRenewed:
    """Extend the lease to ``ttl`` seconds from now (server clock). Idempotent. Never
    re-acquires: 410 when the lease was lost (its holder must stop using the memory). On a pool
    with preemption on, ``yield_requested`` says the server asked the holder to yield the
    lease to a request of higher priority, and ``yield_deadline_s`` how long it has left to
    release it (the expiry never passes that deadline)."""
    _allowed(who, pool)
    try:
        rec, r = await broker.renew(who, pool, lease_id, body.ttl if body else None)
    except Exception as e:
        _map(e, pool)
    asked = r.yield_deadline_ms > 0
    return LeaseRenewed(
        lease_id=lease_id,
        pool=pool,
        token=rec.token,
        ttl=rec.ttl_s,
        expires_in=max(0, r.expires_ms - r.now_ms) / 1000,
        expires_at=r.expires_ms / 1000,
        device=rec.device,
        yield_requested=asked,
        yield_deadline_s=max(0, r.yield_deadline_ms - r.now_ms) / 1000 if asked else None,
    )


@router.post(
    "/pools/{pool}/leases/{lease_id}/resize",
    response_model=LeaseResized,
    operation_id="resize_lease",
    responses={
        200: {"description": "resized", "links": LINKS["resized"]},
        **errors(
            s404="pool_not_found, or not_found: no lease of this id for this token",
            s409="resize_refused: the growth cannot be granted now and every other lease "
            "holding bytes on its device is resident or waits to grow, so waiting could never "
            "end (lease_id, amount, current in the body); the lease keeps its amount",
            s410="lease_lost: the lease expired, was released, or its pool was reset or "
            "deleted; its holder must stop using the memory",
            s413="capacity_exceeded, room_exceeded, quota_exceeded: the new amount can never "
            "fit the lease's device, the room its resident leases leave, or its tenant's quota "
            "(as for an acquire); or request_too_large",
            s503="queued: the growth still waits after `wait` seconds (position, "
            "hold_place_for, estimated_wait_s; Retry-After and X-Queue-Position; send the same resize again to go "
            "on waiting); queue_timeout: not granted within `timeout` (0: not possible now), "
            "the lease keeps its amount; queue_full; backend_unavailable",
            validation="A value the schema refuses (named in detail[].loc, a bad amount with "
            "its value), or a resident lease (never resized)",
        ),
    },
    summary="Resize a lease (a growth may wait in the queue)",
)
async def resize_lease(
    request: Request,
    body: ResizeRequest,
    pool: str = PoolName,
    lease_id: str = LeaseId,
    who: Principal = Depends(principal),
    broker: Broker = Depends(get_broker),
) -> LeaseResized:
    """Change the lease's amount to ``amount`` (docs/SEMANTICS.md, "Resizing a lease"): a
    shrink hands the bytes on at once; a growth is granted now, or waits in the queue (at the
    lease's place, ahead of the new requests its request was ahead of; on its device) up to ``timeout`` while the lease keeps its bytes. Same
    lease id and token. 200: the lease as the server has it now (a reply made at once renewed
    it). Still waiting after ``wait`` seconds: 503 ``queued`` with ``Retry-After`` (from the
    growth's ``estimated_wait_s`` by the acquire's rule); send the
    same resize again within ``hold_place_for`` seconds to keep waiting (else, or when the
    client hangs up during the wait, the growth is withdrawn). A resize of the lease to
    another amount replaces a growth that waits (back to the lease's amount withdraws it)."""
    _allowed(who, pool)
    gone = watch_disconnect(request) if body.wait > 0 else None
    try:
        r = await broker.resize(
            who, pool, lease_id, body.amount_bytes, body.timeout, wait=body.wait, gone=gone
        )
    except Exception as e:
        _map(e, pool)
    finally:
        if gone is not None:
            gone.cancel()
    if isinstance(r, Resized):
        g = r.grant
        return LeaseResized(
            lease_id=lease_id,
            pool=pool,
            amount=g.amount,
            token=g.token,
            ttl=r.rec.ttl_s,
            expires_in=r.expires_in,
            expires_at=g.expires_ms / 1000,
            device=g.device,
            held_ms=int(r.held_s * 1000),  # floor: never more than it was held
        )
    headers = {"Retry-After": str(r.retry_after_s)}
    pos = ""
    if r.position is not None:
        headers["X-Queue-Position"] = str(r.position)
        pos = f" at position {r.position}"
    _err(
        503,
        "queued",
        f"lease {lease_id[:8]}…: its growth to {r.amount} bytes waits{pos}; send the same "
        f"resize again within {r.hold_s:g}s to go on waiting",
        headers,
        lease_id=lease_id,
        amount=r.amount,
        position=r.position,
        retry_after=r.retry_after_s,
        hold_place_for=r.hold_s,
        estimated_wait_s=r.estimated_wait_s,
    )


@router.delete(
    "/pools/{pool}/leases/{lease_id}",
    response_model=LeaseReleased,
    operation_id="release_lease",
    responses=errors(
        s404="pool_not_found, or not_found: no lease of this id for this token",
        s410="lease_lost: the lease was lost before (it expired, or its pool was reset or "
        "deleted); nothing of other holders is freed",
    ),
    summary="Release a lease",
)
async def release_lease(
    pool: str = PoolName,
    lease_id: str = LeaseId,
    who: Principal = Depends(principal),
    broker: Broker = Depends(get_broker),
) -> LeaseReleased:
    """Give the bytes back (the queue's head is granted at once). Idempotent: a repeat answers
    200 again. 410 when the lease was lost before (nothing of other holders is freed)."""
    _allowed(who, pool)
    try:
        now = await broker.release(who, pool, lease_id)
    except Exception as e:
        _map(e, pool)
    return LeaseReleased(
        lease_id=lease_id, pool=pool, released_at=None if now is None else now / 1000
    )


@router.delete(
    "/pools/{pool}/requests/{request_id}",
    response_model=RequestCancelled,
    operation_id="cancel_request",
    responses=errors(),
    summary="Withdraw a queued request",
)
async def cancel_request(
    pool: str = PoolName,
    request_id: str = RequestId,
    who: Principal = Depends(principal),
    broker: Broker = Depends(get_broker),
) -> RequestCancelled:
    """Leave the queue, or release the grant made to this request (when its 201 never
    reached the client). Idempotent."""
    _allowed(who, pool)
    try:
        what = await broker.cancel(who, pool, request_id)
    except Exception as e:
        _map(e, pool)
    return RequestCancelled(
        request_id=request_id, pool=pool, outcome=("none", "left_queue", "released_grant")[what]
    )


# the pools' routes (``api_pools.py``), after the leases' as they always were
router.include_router(pools_router)
