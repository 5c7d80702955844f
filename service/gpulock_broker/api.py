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
"""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn, Optional

from fastapi import APIRouter, Body, Depends, HTTPException, Path, Query, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from gpulock_common.errors import AuthError
from gpulock_common.grace import grace_note
from gpulock_common.wire import answer_for
from gpulock_common.options import DEFAULT_PLACEMENT

from gpulock.errors import (
    BackendUnavailable,
    GpuLockError,
    InvalidArgument,
    LeaseLost,
    PoolNotFound,
    QueueFull,
)
from gpulock.http.disconnect import watch_disconnect

from .auth import Principal
from .responses import LINKS, errors
from .routing import FiniteJSONRoute
from .core import (
    Broker,
    ClientGone,
    Granted,
    LeaseGone,
    NotYours,
    PoolBeingDeleted,
    Resized,
)
from .answers import (
    LeaseGrant,
    LeaseReleased,
    LeaseRenewed,
    LeaseResized,
    PoolConfigured,
    PoolDeleted,
    PoolList,
    PoolOut,
    RequestCancelled,
)
from .models import (
    LEASE_ID_PATTERN,
    POOL_PATTERN,
    REQUEST_ID_PATTERN,
    LeaseRequest,
    PoolConfigRequest,
    RenewRequest,
    ResizeRequest,
)

log = logging.getLogger("gpulock.broker")

router = APIRouter(prefix="/v1", tags=["leases"], route_class=FiniteJSONRoute)
_bearer = HTTPBearer(auto_error=False, description="A broker token (see the tokens file).")

PoolName = Path(..., pattern=POOL_PATTERN, description="Pool name: 1-64 of [A-Za-z0-9._-].")
LeaseId = Path(..., pattern=LEASE_ID_PATTERN, description="32 hex digits, from the 201.")
RequestId = Path(..., pattern=REQUEST_ID_PATTERN, description="The request_id of the POST.")


def _err(
    code: int, error: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> NoReturn:
    raise HTTPException(code, detail={"error": error, "message": message, **extra}, headers=headers)


async def get_broker(request: Request) -> Broker:
    b = getattr(request.app.state, "gpulock_broker", None)
    if b is None:
        _answer(BackendUnavailable, "the lease broker is not started", {"Retry-After": "1"})
    return b


async def principal(
    request: Request,
    cred: Optional[HTTPAuthorizationCredentials] = Depends(_bearer),
    broker: Broker = Depends(get_broker),
) -> Principal:
    who = broker.tokens.lookup(cred.credentials) if cred is not None and cred.credentials else None
    if who is None:
        _answer(
            AuthError,
            "a valid bearer token is required (Authorization: Bearer TOKEN)",
            {"WWW-Authenticate": "Bearer"},
        )
    return who


async def admin_principal(who: Principal = Depends(principal)) -> Principal:
    """The caller's principal if it is an admin token (else 401 / 403)."""
    if not who.admin:
        _answer(AuthError, "only an admin token may see the dashboard", code="forbidden")
    return who


async def dashboard_data(broker: Broker) -> dict[str, Any]:
    """``GET /dashboard/data``'s body (the route is ``gpulock.dashboard.routes``'s): the view of
    every pool; Redis not answering is the broker's 503 ``backend_unavailable``."""
    try:
        return await broker.dashboard()
    except Exception as e:
        _map(e, "*")


def _allowed(who: Principal, pool: str) -> None:
    if not who.may_use(pool):
        _answer(AuthError, f"this token may not use pool {pool!r}", code="forbidden")


def _answer(
    cls: type[GpuLockError],
    message: str,
    headers: dict[str, str] | None = None,
    code: str | None = None,
    **fields: Any,
) -> NoReturn:
    """Answer as the error table says ``cls`` is answered (its row of ``code``, else its first
    row: :mod:`gpulock_common.wire`), with ``message`` and the body ``fields``."""
    a = answer_for(cls, code)
    assert a is not None, (cls, code)
    _err(a.status, a.code, message, headers, **fields)


def _map(e: Exception, pool: str) -> NoReturn:
    """Answer gpulock's errors (and the broker's own) as HTTP: a shared error by the error
    table (:mod:`gpulock_common.wire`: status, code and the exception's fields), with the
    broker's message and, for a 503, ``Retry-After: 1``; the broker's own exceptions by what
    they mean to the caller (a lease gone, or of another token, is a lost lease to it)."""
    if isinstance(e, LeaseGone):
        _answer(LeaseLost, str(e), lease_id=e.lease_id)
    if isinstance(e, NotYours):
        _answer(
            LeaseLost,
            "no such lease for this token",
            code="not_found",
            lease_id=str(e.args[0]) if e.args else None,
        )
    if isinstance(
        e, ClientGone
    ):  # nobody reads this answer; it names the outcome in the access log
        _err(
            499,
            "client_disconnected",
            "the client closed the connection; the request was withdrawn",
            request_id=str(e.args[0]) if e.args else None,
        )
    a = answer_for(e)
    if a is None or not isinstance(e, GpuLockError):
        raise e
    if isinstance(e, InvalidArgument):  # in the shape of the schema's own refusals
        raise HTTPException(
            a.status, detail=[{"loc": ["body"], "msg": str(e), "type": "value_error"}]
        )
    message, headers, extra = str(e), None, {}
    if isinstance(e, PoolNotFound):
        message = f"pool {pool!r} is not configured (an admin sets it: PUT /v1/pools/{pool})"
    if isinstance(e, BackendUnavailable) and not isinstance(e, PoolBeingDeleted):
        log.warning("gpulock broker: pool %s: %s", pool, e)
        message = f"Redis is unavailable: {e}"
    if a.status == 503:  # queue full, Redis unavailable, a pool being deleted: retry in a second
        headers, extra = {"Retry-After": "1"}, {"retry_after": 1}
    _err(a.status, a.code, message, headers, **a.body(e), **extra)


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
            "hold_place_for; Retry-After and X-Queue-Position; retry with the same request_id "
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
    device). Granted: 201. Still
    queued after ``wait`` seconds: 503 with ``Retry-After`` (seconds) and ``X-Queue-Position``;
    retry with the same ``request_id`` to keep the place (it is kept ``hold_place_for`` seconds)
    and to get the same grant if it was made meanwhile."""
    t0 = time.monotonic()  # held_ms: how long this request was held here before the grant reply
    _allowed(who, pool)
    # a client that hangs up during the long poll leaves the queue at once (uvicorn does not
    # cancel the handler by itself)
    gone = watch_disconnect(request) if body.wait > 0 else None
    try:
        r = await broker.acquire(
            who, pool, body.amount_bytes, body.options, wait=body.wait, queue=body.queue, gone=gone
        )
    except Exception as e:
        if isinstance(e, QueueFull):
            broker.count_event(pool, "rejected")
        _map(e, pool)
    finally:
        if gone is not None:
            gone.cancel()
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
    )


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
    re-acquires: 410 when the lease was lost (its holder must stop using the memory)."""
    _allowed(who, pool)
    try:
        rec, exp, now = await broker.renew(who, pool, lease_id, body.ttl if body else None)
    except Exception as e:
        _map(e, pool)
    return LeaseRenewed(
        lease_id=lease_id,
        pool=pool,
        token=rec.token,
        ttl=rec.ttl_s,
        expires_in=max(0, exp - now) / 1000,
        expires_at=exp / 1000,
        device=rec.device,
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
            "hold_place_for; Retry-After and X-Queue-Position; send the same resize again to go "
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
    it). Still waiting after ``wait`` seconds: 503 ``queued`` with ``Retry-After``; send the
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


def _pool_out(st) -> PoolOut:
    d = st.to_dict()
    d["free"] = st.free
    return PoolOut.model_validate(d)


@router.get(
    "/pools",
    response_model=PoolList,
    operation_id="list_pools",
    responses=errors(validation=None),
    summary="List the pools this token may use",
)
async def list_pools(
    who: Principal = Depends(principal), broker: Broker = Depends(get_broker)
) -> PoolList:
    """Every pool this token may use. On a Redis Cluster with a shard down the answer is
    still 200: the pools of the shards that answered, and the others named in
    ``unreachable`` (their master, slot ranges and why), each master asked for at most 2 s."""
    try:
        listing = await broker.pool_listing()
        out = []
        for n in listing.names:
            if not who.may_use(n):
                continue
            try:
                out.append(_pool_out(await broker.status(n, limit=0)))
            except PoolNotFound:
                pass
            except BackendUnavailable as e:
                listing.lost(n, e)  # its shard went away since the listing
    except Exception as e:
        _map(e, "*")
    return PoolList(pools=out, unreachable=[u.to_dict() for u in listing.unreachable])


@router.get(
    "/pools/{pool}",
    response_model=PoolOut,
    operation_id="pool_status",
    responses=errors(s404="pool_not_found: the pool is not configured"),
    summary="Pool status",
)
async def pool_status(
    pool: str = PoolName, who: Principal = Depends(principal), broker: Broker = Depends(get_broker)
) -> PoolOut:
    """Capacity, used bytes, devices (capacity and use of each), leases (soonest expiry
    first, each with its device) and waiters (queue order, each with its requested priority
    and device)."""
    _allowed(who, pool)
    try:
        return _pool_out(await broker.status(pool))
    except Exception as e:
        _map(e, pool)


def _admin_only(who: Principal, pool: str, what: str) -> None:
    _allowed(who, pool)
    if not who.admin:
        _answer(AuthError, f"only an admin token may {what} pools", code="forbidden")


@router.put(
    "/pools/{pool}",
    response_model=PoolConfigured,
    operation_id="configure_pool",
    responses={
        200: {"description": "configured", "links": LINKS["configured"]},
        **errors(s403="forbidden: the token may not use this pool, or is not an admin token"),
    },
    summary="Create or resize a pool, or set its devices (admin)",
)
async def configure_pool(
    body: PoolConfigRequest,
    pool: str = PoolName,
    who: Principal = Depends(principal),
    broker: Broker = Depends(get_broker),
) -> PoolConfigured:
    """Set the capacity (bytes or "24GiB") or the devices (``devices``: each one's capacity;
    ``capacity`` then defaults to their sum and must equal it if given) and optionally the
    placement (``placement`` "bestfit" or "spread"), the queue bound, the longest lease
    ttl (``max_ttl``, seconds; also the grace period after Redis restarts without its data) and
    the queue policy (``policy`` "fifo" or "backfill", ``backfill_window`` seconds) and tenant
    quotas (``quotas``: tenant to bytes or a size, 0 removes; tenants left out keep theirs);
    what is left out keeps its value. Admin tokens only. Lowering the capacity below what is in use keeps
    the leases; nothing new is granted until use falls below it. The count of devices changes
    only while the pool has no lease and no waiter (else 422, nothing changed)."""
    _admin_only(who, pool, "configure")
    try:
        r = await broker.configure(pool, body.settings)
    except Exception as e:
        _map(e, pool)
    devices = r.get("devices") or [r["capacity"]]
    log.info(
        "gpulock broker: %s set pool %s capacity=%d policy=%s quotas=%s devices=%s placement=%s",
        who.name,
        pool,
        r["capacity"],
        r["policy"],
        " ".join(f"{t}={b}" for t, b in sorted(r["quotas"].items())) or "-",
        ",".join(str(c) for c in devices),
        r.get("placement", DEFAULT_PLACEMENT),
    )
    # the reply's fields by name (a pool setting added to the reply and the answer model
    # needs no line here)
    fields = {k: r[k] for k in PoolConfigured.model_fields if k in r}
    fields.update(
        pool=pool,
        created=bool(r["created"]),
        devices=devices,
        placement=r.get("placement", DEFAULT_PLACEMENT),
    )
    return PoolConfigured(**fields)


@router.delete(
    "/pools/{pool}",
    response_model=PoolDeleted,
    operation_id="delete_pool",
    responses=errors(
        s403="forbidden: the token may not use this pool, or is not an admin token",
        s404="pool_not_found: there is no such pool",
        s409="pool_in_use: leases are held or requests wait (leases and waiters in the "
        "body); nothing was deleted (force=true deletes it anyway)",
    ),
    summary="Delete a pool (admin)",
)
async def delete_pool(
    pool: str = PoolName,
    force: bool = Query(False, description="Delete even while leases are held or requests wait."),
    who: Principal = Depends(principal),
    broker: Broker = Depends(get_broker),
) -> PoolDeleted:
    """Delete the pool's configuration, leases and queue. Admin tokens only. 409 while leases
    are held or requests wait (the counts are in the body), unless ``force=true``; 404 when
    there is no such pool. Leases that were held answer 410 at their next renewal; requests
    waiting on this broker answer 404."""
    _admin_only(who, pool, "delete")
    try:
        r = await broker.delete_pool(pool, force=force)
    except Exception as e:
        _map(e, pool)
    if r.state == "missing":
        _map(PoolNotFound(pool), pool)
    if r.state == "in_use":
        _err(
            409,
            "pool_in_use",
            f"pool {pool!r} is in use: {r.leases} lease(s) held, {r.waiters} request(s) "
            f"waiting; nothing was deleted (force=true deletes it anyway)",
            leases=r.leases,
            waiters=r.waiters,
        )
    log.info(
        "gpulock broker: %s deleted pool %s (%d lease(s), %d waiter(s) dropped)",
        who.name,
        pool,
        r.leases,
        r.waiters,
    )
    return PoolDeleted(pool=pool, leases=r.leases, waiters=r.waiters)
