"""What each route of the lease API (``/v1``) answers, as FastAPI ``responses=`` for its
OpenAPI schema: every status a route can return, with the body it really has
(:class:`~gpulock_broker.answers.ErrorResponse` for the broker's errors, FastAPI's
``HTTPValidationError`` for 422) and the headers of a 503; and the OpenAPI links from a grant
to the operations on its lease (a client, or schemathesis' stateful phase, follows them).

Every route may answer (the HTTP guards and the token check run before any handler):
400 (a body that is not UTF-8 or JSON, or nests too deeply), 401 (no or unknown token), 403
(the token may not use the pool), 408 (a body that did not arrive in time), 413 (a body over
the size bound), 422 (a path, query or body value the schema refuses) and 503 (Redis
unavailable, or the broker not started; Retry-After). :func:`errors` adds a route's own.
"""

from __future__ import annotations

from typing import Any

from gpulock.http.openapi import error_responses
from gpulock.retry_after import openapi_headers

from .answers import ErrorResponse

__all__ = ["LINKS", "OPERATION_IDS", "errors"]

# The operationId of each route (the links below name them).
OPERATION_IDS = (
    "acquire_lease",
    "renew_lease",
    "resize_lease",
    "release_lease",
    "cancel_request",
    "list_pools",
    "pool_status",
    "configure_pool",
    "delete_pool",
)

_HEADERS_503 = openapi_headers("queued: the request's 1-based place in the queue.")

_COMMON: dict[int, str] = {
    400: "invalid_utf8, invalid_json or nested_too_deeply: the body is not UTF-8 or JSON, or "
    "nests more levels than the server parses",
    401: "unauthorized: no bearer token, or one the broker does not know",
    403: "forbidden: the token may not use this pool",
    408: "request_timeout: the body did not arrive within the read timeout",
    413: "request_too_large: the body is over the broker's size bound (1 MiB by default)",
    503: "backend_unavailable: Redis does not answer, or the broker is not started; retry "
    "after Retry-After",
}

_VALIDATION = (
    "A value the schema refuses (the field is named in detail[].loc), or one that breaks a "
    "bound the pool sets"
)


def errors(*, validation: str | None = _VALIDATION, **own: str) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: the statuses every route answers plus the route's own,
    given as ``s404="why"`` (a status already common gets the route's description instead).

    ``validation``: what the route's 422 means; None for a route without parameters or body
    (no 422)."""
    out = error_responses(_COMMON, own, ErrorResponse, _HEADERS_503)
    if validation is not None:
        # FastAPI's HTTPValidationError ({"detail": [{"loc", "msg", "type"}]}), our words
        out[422] = {"description": validation}
    return out


def _link(operation: str, **parameters: str) -> dict[str, Any]:
    return {"operationId": operation, "parameters": parameters}


# OpenAPI links: how an answer's values feed the next operation.
LINKS: dict[str, dict[str, Any]] = {
    # 201: the granted lease, renewed, resized, released, or withdrawn by its request id
    "granted": {
        "RenewLease": _link(
            "renew_lease", pool="$request.path.pool", lease_id="$response.body#/lease_id"
        ),
        "ReleaseLease": _link(
            "release_lease", pool="$request.path.pool", lease_id="$response.body#/lease_id"
        ),
        "ResizeLease": _link(
            "resize_lease", pool="$request.path.pool", lease_id="$response.body#/lease_id"
        ),
        "CancelRequest": _link(
            "cancel_request", pool="$request.path.pool", request_id="$response.body#/request_id"
        ),
        "PoolStatus": _link("pool_status", pool="$request.path.pool"),
    },
    # 200 of a resize: the lease renewed, released
    "resized": {
        "RenewLease": _link(
            "renew_lease", pool="$request.path.pool", lease_id="$response.body#/lease_id"
        ),
        "ReleaseLease": _link(
            "release_lease", pool="$request.path.pool", lease_id="$response.body#/lease_id"
        ),
    },
    # 200 of a renewal: the lease released
    "renewed": {
        "ReleaseLease": _link(
            "release_lease", pool="$request.path.pool", lease_id="$response.body#/lease_id"
        ),
    },
    # 200 of a pool's configuration: its status, a lease in it, its deletion
    "configured": {
        "PoolStatus": _link("pool_status", pool="$request.path.pool"),
        "AcquireLease": _link("acquire_lease", pool="$request.path.pool"),
        "DeletePool": _link("delete_pool", pool="$request.path.pool"),
    },
}
