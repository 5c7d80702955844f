"""The embeddings service's OpenAPI schema, made to tell the truth:

* :func:`errors` is each route's ``responses=``: every status it can return, with OpenAI's error
  body (:class:`~gpulock_service.openai_errors.OpenAIErrorResponse`) and the Retry-After of a 503;
* :func:`install_openapi` makes ``app.openapi()`` drop FastAPI's 422 (the service answers an
  invalid body 400, ``openai_errors``) and write into ``EmbeddingRequest`` the bounds the handler
  enforces, read from the app's settings and model: at least one input and at most
  ``GPULOCK_MAX_BATCH``, a list of token ids not empty, token ids from 0 (to the model's
  vocabulary size - 1 when it has one; none for a model that takes text only), ``dimensions``
  the model's only.

So a value the schema allows is one the service takes (or answers for a reason of state: the
pool's capacity, the queue, the deadlines), and one it refuses is a 400.
"""

from __future__ import annotations

from typing import Any, Callable

from gpulock.http.openapi import error_responses
from gpulock.retry_after import openapi_headers

from .openai_errors import OpenAIErrorResponse

__all__ = [
    "EMBEDDING_RESPONSES",
    "METRICS_RESPONSES",
    "READY_SCHEMA",
    "errors",
    "install_openapi",
]

_HEADERS_503 = openapi_headers(
    "queue_timeout, queue_full: the request's place in the pool's queue."
)

# what every route may answer: the HTTP guards run before any route
_GUARDS: dict[int, str] = {
    400: "invalid_request_error: a body that is not UTF-8 or JSON (invalid_utf8, invalid_json, "
    "nested_too_deeply), or that the route refuses (param names the field)",
    408: "request_timeout: the body did not arrive within GPULOCK_READ_TIMEOUT",
    413: "request_too_large: the body is over GPULOCK_MAX_REQUEST_BYTES",
}

#: ``/metrics``: Prometheus text, or OpenMetrics when the scraper's Accept asks for it.
METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition (0.0.4); OpenMetrics 1.0.0 when Accept "
        "names application/openmetrics-text",
        "content": {
            "text/plain; version=0.0.4; charset=utf-8": {"schema": {"type": "string"}},
            "application/openmetrics-text; version=1.0.0; charset=utf-8": {
                "schema": {"type": "string"}
            },
        },
    }
}


def errors(**own: str) -> dict[int | str, dict[str, Any]]:
    """``responses=`` for a route: the guards' 400, 408 and 413 plus the route's own, given as
    ``s404="why"`` (a status already there gets the route's description instead). A 503
    declares Retry-After."""
    return error_responses(_GUARDS, own, OpenAIErrorResponse, _HEADERS_503)


_EMBEDDING_ERRORS = errors(
    s400="invalid_request_error: a body the schema refuses (param names the field), or "
    "token ids the model cannot take",
    s404="model_not_found: model names another model than the one served",
    s409="an X-Request-ID reused for a request with another body",
    s413="capacity: the inputs need more GPU memory than the pool leaves for requests; or "
    "request_too_large: the body is over GPULOCK_MAX_REQUEST_BYTES",
    s500="cuda_error: a sticky CUDA error (the worker exits and is replaced)",
    s503="queue_timeout, queue_full, not_ready, lease_lost, cuda_oom, backend: overloaded or "
    "not ready; retry after Retry-After",
    s504="inference_timeout: the model ran past GPULOCK_INFERENCE_TIMEOUT",
)
# the 200 of /v1/embeddings (``respond`` builds it)
_EMBEDDINGS_200: dict[str, Any] = {
    "type": "object",
    "required": ["object", "data", "model", "usage"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"const": "embedding"},
                    "index": {"type": "integer", "minimum": 0},
                    "embedding": {
                        "description": "floats, or base64 of little-endian float32",
                        "anyOf": [
                            {"type": "array", "items": {"type": "number"}},
                            {"type": "string"},
                        ],
                    },
                },
            },
        },
        "model": {"type": "string"},
        "usage": {
            "type": "object",
            "required": ["prompt_tokens", "total_tokens"],
            "properties": {
                "prompt_tokens": {"type": "integer", "minimum": 0},
                "total_tokens": {"type": "integer", "minimum": 0},
            },
        },
    },
}
#: ``POST /v1/embeddings``: its 200 and every error it answers.
EMBEDDING_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the embeddings, in input order",
        "content": {"application/json": {"schema": _EMBEDDINGS_200}},
    },
    **_EMBEDDING_ERRORS,
}
#: ``/ready``'s body (200 and 503 alike).
READY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["ready", "pid", "pool", "model", "checks"],
    "properties": {
        "ready": {"type": "boolean"},
        "pid": {"type": "integer"},
        "pool": {"type": "string"},
        "model": {"type": "string"},
        "device": {"type": ["string", "null"]},
        "resident_bytes": {"type": "integer"},
        "checks": {"type": "object"},
        "grace": {
            "type": "object",
            "description": "the pool's restart grace period: nothing new is granted until it ends",
            "properties": {
                "active": {"type": "boolean"},
                "left": {"type": "number"},
                "until": {"type": ["string", "null"]},
                "message": {"type": "string"},
            },
        },
    },
}


def _array_variants(prop: dict[str, Any]) -> list[dict[str, Any]]:
    return [v for v in prop.get("anyOf", [prop]) if v.get("type") == "array"]


def _bound_request(schema: dict[str, Any], bounds: dict[str, int | None]) -> None:
    """Write the handler's bounds into the ``EmbeddingRequest`` schema (in place)."""
    props = schema.get("components", {}).get("schemas", {}).get("EmbeddingRequest", {})
    props = props.get("properties", {})
    inputs = props.get("input", {})
    if not bounds["token_ids"] and "anyOf" in inputs:  # a model that takes text only
        inputs["anyOf"] = [
            v
            for v in inputs["anyOf"]
            if v.get("items", {}).get("type") == "string" or v.get("type") == "string"
        ]
    for variant in _array_variants(inputs):
        variant["minItems"] = 1
        variant["maxItems"] = bounds["max_batch"]
        items = variant.get("items", {})
        token_lists = [items] if items.get("type") == "integer" else []
        if items.get("type") == "array":
            items["minItems"] = 1  # an empty list of token ids is a 400
            token_lists.append(items.get("items", {}))
        for ids in token_lists:
            if ids.get("type") == "integer":
                ids["minimum"] = 0
                if bounds["vocab_size"] is not None:
                    ids["maximum"] = bounds["vocab_size"] - 1
    for variant in props.get("dimensions", {}).get("anyOf", []):
        if variant.get("type") == "integer" and bounds["dimensions"] is not None:
            variant["minimum"] = variant["maximum"] = bounds["dimensions"]


def install_openapi(app: Any, bounds: Callable[[], dict[str, int | None]]) -> None:
    """Make ``app.openapi()`` the truthful schema (see the module docstring). ``bounds()``:
    ``{"max_batch", "dimensions", "vocab_size", "token_ids"}`` (None: no bound; token_ids 0: a
    model that takes text only), called once, when the schema
    is first built."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for item in schema.get("paths", {}).values():
            for op in item.values():
                responses = op.get("responses", {})
                if responses.pop("422", None) is not None and "400" not in responses:
                    raise AssertionError(f"{op.get('operationId')}: a 422 with no 400 declared")
        comps = schema.get("components", {}).get("schemas", {})
        comps.pop("HTTPValidationError", None)
        comps.pop("ValidationError", None)
        _bound_request(schema, bounds())
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
