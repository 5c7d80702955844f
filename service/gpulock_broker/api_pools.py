"""The pool routes of the HTTP lease API (``/v1/pools``, ``/v1/pools/{pool}``): list the
pools a token may use, a pool's status, and an admin's configure and delete. :data:`router`
has no prefix of its own: ``api.py``'s router (``/v1``) includes it.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query
from gpulock_common.errors import AuthError
from gpulock_common.options import DEFAULT_PLACEMENT

from gpulock.errors import BackendUnavailable, PoolNotFound

from .api_common import PoolName, _allowed, _answer, _err, _map, get_broker, log, principal
from .auth import Principal
from .responses import LINKS, errors
from .routing import FiniteJSONRoute
from .core import Broker
from .answers import PoolConfigured, PoolDeleted, PoolList, PoolOut
from .models import PoolConfigRequest

router = APIRouter(route_class=FiniteJSONRoute)


def _pool_out(st) -> PoolOut:
    d = st.to_dict()
    d["free"] = st.free
    for w in d["waiters"]:
        w["estimated_wait_s"] = w.pop("estimated_wait")
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
