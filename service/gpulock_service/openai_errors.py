"""The embeddings service's errors in OpenAI's shape (the object itself is
:func:`gpulock.http.sse.error_body`'s, which a guarded stream's error event uses too)::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

Status conventions (OpenAI's, so the ``openai`` SDK raises the matching exception and shows the
message): **400** for every invalid request body (FastAPI's 422 included: OpenAI answers
400 ``invalid_request_error`` with ``param`` naming the field), 404 for an unknown model
(``code: "model_not_found"``) or route. gpulock's own answers keep their statuses: **413** for a
request too large (body bytes, inputs, or GPU memory), **503 with Retry-After** for overload
(the SDK retries it, honouring Retry-After), 504 for inference past its deadline, 408 for a
body that did not arrive in time. ``type``: ``invalid_request_error`` for 4xx,
``server_error`` for 5xx; ``code``: gpulock's reason (``queue_timeout``, ``queue_full``,
``capacity``, ``not_ready``, ``invalid_json``, ``request_too_large``, ...) where there is one.

:func:`install_openai_errors` puts it on an app: an exception handler for the answers raised
with a reason (:class:`OpenAIError`, gpulock's ``GpuLockHTTPException``) and pure ASGI
middleware :class:`OpenAIErrorBodies` that rewrites every other error body of the
``{"detail": ...}`` shape (the HTTP guards', FastAPI's validation, Starlette's 404/405).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi import HTTPException, Request, Response
from fastapi.responses import JSONResponse
from gpulock_common.validation import describe, param_of
from pydantic import BaseModel, Field

from gpulock.http.sse import error_body as error_body
from gpulock.http.sse import error_type as error_type

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "OpenAIError",
    "OpenAIErrorBodies",
    "OpenAIErrorResponse",
    "error_body",
    "guard_detail",
    "install_openai_errors",
]


class OpenAIErrorObject(BaseModel):
    """The ``error`` of an error body (for the OpenAPI schema; :func:`error_body` builds it)."""

    message: str
    type: str = Field(
        ...,
        description="invalid_request_error (4xx), authentication_error (401), "
        "permission_error (403), server_error (5xx)",
    )
    param: str | None = Field(..., description="the request field at fault, if one is")
    code: str | None = Field(
        ...,
        description="gpulock's reason: queue_timeout, queue_full, capacity, quota, not_ready, "
        "model_not_found, invalid_json, request_too_large, inference_timeout, ...",
    )
    estimated_wait_s: float | None = Field(
        None,
        description="a 503 that waited for GPU memory (queue_timeout, queue_full, cuda_oom): "
        "the estimated seconds until a grant, from the pool's drain rate and the bytes ahead "
        "(the estimate its Retry-After comes from); absent when nothing was measured yet",
    )


class OpenAIErrorResponse(BaseModel):
    """Every error body of the service: ``{"error": {message, type, param, code}}``."""

    error: OpenAIErrorObject


class OpenAIError(HTTPException):
    """An error answered in OpenAI's shape: ``status``, ``message`` (also ``detail``), and
    ``code``/``param`` (``None`` for none)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(status_code=status, detail=message, headers=headers)
        self.code = code
        self.param = param


def guard_detail(code: str, message: str) -> dict[str, str]:
    """The HTTP guards' ``detail`` (``install_http_guards(detail=...)``): their reason kept as
    ``{"error": code, "message": message}``, which :class:`OpenAIErrorBodies` turns into
    ``code`` and ``message``."""
    return {"error": code, "message": message}


def _from_detail(detail: Any) -> tuple[str, str | None, str | None]:
    """``(message, code, param)`` of a ``{"detail": detail}`` body: a message; the HTTP guards'
    ``{"error": code, "message": text}``; or FastAPI's list of validation errors, said in
    users' words (``param``: the first one's top-level field, e.g. ``input``)."""
    if isinstance(detail, dict) and "message" in detail:
        code = detail.get("error")
        return str(detail["message"]), code if isinstance(code, str) else None, None
    if isinstance(detail, list) and detail and all(isinstance(e, dict) for e in detail):
        bad_json = next((e for e in detail if e.get("type") == "json_invalid"), None)
        if bad_json is not None:  # FastAPI's: loc ["body", character offset]
            loc = bad_json.get("loc", ())
            why = (bad_json.get("ctx") or {}).get("error") or bad_json.get("msg", "")
            at = f" at character {loc[1]}" if len(loc) > 1 else ""
            return f"the body is not valid JSON: {why}{at}", "invalid_json", None
        # in users' words (input[0][1], no pydantic internals): gpulock_common.validation
        return "invalid request: " + describe(detail), None, param_of(detail)
    return (detail if isinstance(detail, str) else json.dumps(detail, default=str)), None, None


class OpenAIErrorBodies:
    """Pure ASGI middleware: an error response (status ≥ 400, JSON) whose body is
    ``{"detail": ...}`` is answered in OpenAI's shape instead (422 becomes 400); its other
    headers are kept. Bodies already in that shape, and successes, pass through untouched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewrite(msg: Message) -> None:
            nonlocal start
            if msg["type"] == "http.response.start":
                ctype = dict(msg.get("headers", ())).get(b"content-type", b"")
                if msg["status"] >= 400 and ctype.startswith(b"application/json"):
                    start = msg  # held until the body is complete
                    return
                return await send(msg)
            if start is None or msg["type"] != "http.response.body":
                return await send(msg)
            chunks.append(msg.get("body", b""))
            if msg.get("more_body", False):
                return
            status, body = start["status"], b"".join(chunks)
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and set(parsed) == {"detail"}:
                message, code, param = _from_detail(parsed["detail"])
                status = 400 if status == 422 else status
                body = json.dumps(error_body(status, message, code, param)).encode()
            headers = [(k, v) for k, v in start.get("headers", ()) if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)


def install_openai_errors(app: Any) -> None:
    """OpenAI's error shape for every error of ``app``; call it after ``install_http_guards``
    (given ``detail=guard_detail``; it keeps those handlers for the errors without a reason of
    their own)."""
    from starlette.exceptions import HTTPException as StarletteHTTPException

    inner = app.exception_handlers.get(StarletteHTTPException)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        code = getattr(exc, "code", None) or getattr(exc, "reason", None)
        if isinstance(exc, OpenAIError) or code is not None:
            body = error_body(
                status, str(getattr(exc, "detail", "")), code, getattr(exc, "param", None)
            )
            wait = getattr(exc, "estimated_wait_s", None)  # a 503's (gpulock.fastapi)
            if wait is not None:
                body["error"]["estimated_wait_s"] = wait
            return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))
        if inner is not None:
            return await inner(request, exc)
        raise exc

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(OpenAIErrorBodies)
