"""OpenAPI ``responses=`` for FastAPI routes, built the one way the lease broker and the
embeddings service both declare their errors: every status a route can answer, each with its
error body's model and a description, a 503 with its ``Retry-After`` headers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["error_responses"]


def error_responses(
    base: Mapping[int, str],
    own: Mapping[str, str],
    model: type,
    headers_503: Mapping[str, Any],
) -> dict[int | str, dict[str, Any]]:
    """``base`` (status -> description: what every route answers) with the route's ``own``
    statuses, given as ``{"s404": "why"}`` (a status already in ``base`` takes the route's
    description), in status order; each names ``model`` as its body and a 503 carries
    ``headers_503`` (:func:`gpulock.retry_after.openapi_headers`)."""
    described = dict(base)
    for key, why in own.items():
        described[int(key.lstrip("s"))] = why
    out: dict[int | str, dict[str, Any]] = {}
    for code in sorted(described):
        entry: dict[str, Any] = {"model": model, "description": described[code]}
        if code == 503:
            entry["headers"] = dict(headers_503)
        out[code] = entry
    return out
