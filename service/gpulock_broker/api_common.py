"""What the routes of the HTTP lease API share: the dependencies (the started broker, the
caller's principal, an admin's), the path parameters, the pool check, and the error answers
(gpulock's errors and the broker's own as HTTP, by the error table of
:mod:`gpulock_common.wire`). The routes are ``api.py``'s (a lease's life) and ``api_pools.py``'s
(pools); ``dashboard_data`` is the body of ``app.py``'s dashboard route.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn, Optional

from fastapi import Depends, HTTPException, Path, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from gpulock_common.errors import AuthError
from gpulock_common.wire import answer_for

from gpulock.retry_after import UNAVAILABLE_RETRY_AFTER
from gpulock.errors import (
    BackendUnavailable,
    GpuLockError,
    InvalidArgument,
    LeaseLost,
    PoolNotFound,
)

from .auth import Principal
from .core import (
    Broker,
    ClientGone,
    LeaseGone,
    NotYours,
    PoolBeingDeleted,
)
from .outcomes import Refused
from .models import (
    LEASE_ID_PATTERN,
    POOL_PATTERN,
    REQUEST_ID_PATTERN,
)

log = logging.getLogger("gpulock.broker")

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
        _answer(
            BackendUnavailable,
            "the lease broker is not started",
            {"Retry-After": str(UNAVAILABLE_RETRY_AFTER)},
        )
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
    broker's message; a :class:`Refused` (a full queue, a growth's timeout) with the
    Retry-After and estimate it carries (from the pool's state, by the one policy), any other
    503 (Redis unavailable, a pool being deleted: no state to estimate from) with
    :data:`gpulock.retry_after.UNAVAILABLE_RETRY_AFTER`; the broker's own exceptions by what
    they mean to the caller (a lease gone, or of another token, is a lost lease to it)."""
    later: dict[str, Any] | None = None
    if isinstance(e, Refused):
        later = {"retry_after": e.retry_after_s, "estimated_wait_s": e.estimated_wait_s}
        e = e.error
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
    if a.status == 503:
        extra = later or {"retry_after": UNAVAILABLE_RETRY_AFTER}
        headers = {"Retry-After": str(extra["retry_after"])}
    _err(a.status, a.code, message, headers, **a.body(e), **extra)
