"""HTTP hygiene, one path for every surface (the service, the lease broker, your own
GpuLimiter app): bodies that are not UTF-8 and values JSON cannot carry answer a 4xx, never a
500; a body is bounded in size and in the time it takes to arrive."""

from __future__ import annotations

import asyncio
import math
import os
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from fastapi import HTTPException, Request, Response
from gpulock_common.aio import wait_for
from gpulock_common.validation import plain_errors

from gpulock.http.access_log import HEADER as REQUEST_ID_HEADER
from gpulock.http.access_log import request_id_error
from gpulock.errors import InvalidArgument
from gpulock.units import format_size, parse_size

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_READ_TIMEOUT",
    "NESTED_TOO_DEEPLY",
    "allowed_methods",
    "Detail",
    "RequestLimits",
    "install_error_handlers",
    "install_http_guards",
    "plain_detail",
    "utf8_error",
]

DEFAULT_MAX_REQUEST_BYTES = "16MiB"
DEFAULT_READ_TIMEOUT = 30.0
DEFAULT_TOO_LARGE_HINT = "send fewer or shorter inputs"

# A surface's error body: ``detail(code, message)`` is the value of ``"detail"`` in the guards'
# replies. ``code``: invalid_utf8, invalid_json, nested_too_deeply, request_too_large,
# request_timeout.
Detail = Callable[[str, str], Any]

NESTED_TOO_DEEPLY = (
    "JSON nested too deeply: the request body nests more levels than this server parses; "
    "send JSON nested at most a few hundred levels"
)

# Containers deeper than this are shown as a placeholder in a 422's echo of the input: the
# reply is built by recursive code (and Python's JSON encoder), which a body nested hundreds
# of levels deep (still parseable) made overflow the stack: a 500.
MAX_RENDER_DEPTH = 16
_TOO_DEEP_TO_SHOW = "...(nested too deeply to show)"


def plain_detail(code: str, message: str) -> Any:
    """The default error body: ``{"detail": message}`` (the service's, FastAPI's own)."""
    return message


def utf8_error(body: bytes | bytearray) -> str | None:
    """None when ``body`` is valid UTF-8, else a message naming the first bad byte."""
    try:
        bytes(body).decode("utf-8")
        return None
    except UnicodeDecodeError as e:
        return (
            f"the request body is not valid UTF-8: byte 0x{body[e.start]:02x} at offset {e.start} "
            f"({e.reason}); send JSON encoded as UTF-8 (Content-Type: application/json)"
        )


def _renderable(x: Any, depth: int = 0) -> Any:
    """The value with what JSON in UTF-8 cannot carry made printable: non-finite floats (NaN,
    ±Infinity) become their names, lone surrogates (``"\\ud800"``) and undecodable bytes
    their escapes; containers nested deeper than :data:`MAX_RENDER_DEPTH` a placeholder (the
    recursion is bounded)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (bytes, bytearray)):
        return bytes(x).decode("utf-8", "backslashreplace")
    if isinstance(x, str):
        try:
            x.encode("utf-8")
            return x
        except UnicodeEncodeError:
            return x.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(x, (dict, list, tuple)) and depth >= MAX_RENDER_DEPTH:
        return _TOO_DEEP_TO_SHOW
    if isinstance(x, dict):
        return {_renderable(k, depth + 1): _renderable(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_renderable(v, depth + 1) for v in x]
    return x


# FastAPI's own 400 for a body its JSON parser raised on (not a JSONDecodeError); an app's own
# HTTPException(400) keeps its text.
_FASTAPI_PARSE_ERROR = "There was an error parsing the body"


#: An exception handler of a FastAPI app.
_Handler = Callable[[Request, Exception], Awaitable[Response]]


def _error_handlers(detail: Detail) -> tuple[_Handler, _Handler, _Handler]:
    from fastapi.encoders import jsonable_encoder
    from fastapi.exception_handlers import http_exception_handler
    from fastapi.responses import JSONResponse

    def reply(status: int, code: str, message: str) -> Response:
        return JSONResponse({"detail": detail(code, message)}, status_code=status)

    async def validation_error(request: Request, exc: Exception) -> Response:
        # FastAPI hands a body it did not parse as JSON (no JSON content type) to validation
        # as bytes, and its own error reply echoes them back: bytes that are not UTF-8 were a
        # 500, as were NaN, Infinity and lone surrogates (Python's JSON parser accepts them),
        # and input nested hundreds of levels deep.
        body = getattr(exc, "body", None)
        if isinstance(body, (bytes, bytearray)):
            msg = utf8_error(body)
            if msg:
                return reply(400, "invalid_utf8", msg)
        # each loc the path through the body the client sent, without pydantic's internals
        # (a union member's name, "[key]"): what every surface and client says to users
        errors: Any = plain_errors(getattr(exc, "errors", list)(), getattr(exc, "body", None))
        try:
            content = _renderable(jsonable_encoder(_renderable(errors)))
        except RecursionError:  # pragma: no cover - _renderable bounds the depth
            return reply(400, "nested_too_deeply", NESTED_TOO_DEEPLY)
        return JSONResponse({"detail": content}, status_code=422)

    async def http_error(request: Request, exc: Exception) -> Response:
        if getattr(exc, "status_code", None) == 405:
            # Starlette's Allow names the methods of the first route of the path only
            # (GET of /v1/pools/{pool}, not its PUT and DELETE): name those of all of them
            allow = allowed_methods(request)
            if allow:
                exc.headers = {**(getattr(exc, "headers", None) or {}), "Allow": allow}  # type: ignore[attr-defined]
        # FastAPI answers a JSON body it could not decode "400 There was an error parsing the
        # body" (its parser raised something other than a JSONDecodeError): when the bytes are
        # not UTF-8, say so (and where); when they nest too deeply, say that.
        cause = exc.__cause__
        if getattr(exc, "status_code", None) == 400 and isinstance(cause, ValueError):
            body = getattr(request, "_body", None)
            if not isinstance(body, (bytes, bytearray)):
                body = getattr(cause, "object", None)
            msg = utf8_error(body) if isinstance(body, (bytes, bytearray)) else None
            if msg:
                return reply(400, "invalid_utf8", msg)
        if (
            getattr(exc, "status_code", None) == 400
            and getattr(exc, "detail", None) == _FASTAPI_PARSE_ERROR
        ):
            if isinstance(cause, RecursionError):
                return reply(400, "nested_too_deeply", NESTED_TOO_DEEPLY)
            return reply(
                400,
                "invalid_json",
                _FASTAPI_PARSE_ERROR + (f" ({type(cause).__name__})" if cause else ""),
            )
        wait = getattr(exc, "estimated_wait_s", None)  # a 503's wait estimate (gpulock.fastapi)
        if wait is not None:
            return JSONResponse(
                {"detail": getattr(exc, "detail", ""), "estimated_wait_s": wait},
                status_code=getattr(exc, "status_code", 503),
                headers=getattr(exc, "headers", None),
            )
        return await http_exception_handler(request, exc)  # type: ignore[arg-type]

    async def recursion_error(request: Request, exc: Exception) -> Response:
        # A JSON parser run on the body outside FastAPI's (a route's own check, such as the
        # broker's refusal of NaN) overflows the stack on input nested a few thousand levels
        # deep. A request without a body did not cause it: that stays a 500 (a bug).
        h = request.headers
        if h.get("transfer-encoding") or h.get("content-length", "0") not in ("", "0"):
            return reply(400, "nested_too_deeply", NESTED_TOO_DEEPLY)
        raise exc

    return validation_error, http_error, recursion_error


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def allowed_methods(request: Request) -> str:
    """The ``Allow`` header of a 405: every method a route of ``request``'s app serves at its
    path (sorted, comma-separated; HEAD with GET, as Starlette serves it), found by asking each
    route whether it would take the request with that method; ``""`` when none would."""
    from starlette.routing import Match

    routes = getattr(request.app, "routes", ())
    return ", ".join(
        m
        for m in _METHODS
        if any(r.matches({**request.scope, "method": m})[0] is Match.FULL for r in routes)
    )


def install_error_handlers(app: Any, *, detail: Detail | None = None) -> None:
    """The error replies of every gpulock HTTP surface: 400 naming the byte for a body that is
    not UTF-8 (with any content type), 400 for JSON nested too deeply to parse, 422 for every
    invalid request (also one that sent NaN, Infinity, a lone surrogate or input nested
    hundreds of levels deep, which FastAPI's own reply could not render: a 500), each error's
    ``loc`` the path in the body sent, without pydantic's internals
    (:func:`gpulock_common.validation.plain_errors`).

    An error that carries a wait estimate (``estimated_wait_s``, seconds: the FastAPI
    integration's 503s, docs/SERVICE.md) is answered ``{"detail": ..., "estimated_wait_s": s}``.

    ``detail(code, message)``: the surface's error body, the value of ``"detail"`` (default
    :func:`plain_detail`: the message; the broker's: ``{"error": code, "message": message}``)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    validation_error, http_error, recursion_error = _error_handlers(detail or plain_detail)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RecursionError, recursion_error)


class RequestLimits:
    """Pure ASGI middleware bounding what one request may cost before anything parses it:

    * **size**: a body over ``max_body_bytes`` (``GPULOCK_MAX_REQUEST_BYTES``, 16 MiB) answers
      413. Content-Length is checked first; a body without one (chunked) is counted as it
      arrives. The body is parsed on the worker's event loop, which also runs the lease
      heartbeats: an unbounded one (a 50 MB string) stalls them.
    * **time**: the whole body must arrive within ``read_timeout`` seconds
      (``GPULOCK_READ_TIMEOUT``, 30) of the request's start, else 408 and the connection is
      closed: a client that declares 100 bytes and sends 14, or drips a byte a second, is cut.
    * **request id**: an ``X-Request-ID`` over
      :data:`gpulock.http.access_log.MAX_REQUEST_ID_BYTES` answers 400 ``invalid_request_id``
      naming the bound (it is an idempotency key: never cut).

    The refusals are raised as ``HTTPException`` from the read that crosses the bound (FastAPI
    passes those through its body parsing as they are), their ``detail`` made by ``detail(code,
    message)`` (the surface's error body, see :func:`install_error_handlers`); ``too_large_hint``
    ends the 413's message (what the client should send instead). The header phase is bounded
    by the server (see :mod:`gpulock.http.server`)."""

    def __init__(
        self,
        app: ASGIApp,
        max_body_bytes: int | str | None = None,
        read_timeout: float | None = None,
        *,
        detail: Detail | None = None,
        too_large_hint: str | None = None,
    ):
        self.app = app
        self.detail = detail or plain_detail
        self.hint = DEFAULT_TOO_LARGE_HINT if too_large_hint is None else too_large_hint
        self.limit = parse_size(
            max_body_bytes
            if max_body_bytes not in (None, "")
            else (os.environ.get("GPULOCK_MAX_REQUEST_BYTES") or DEFAULT_MAX_REQUEST_BYTES),
            name="max_request_bytes",
        )
        rt = read_timeout if read_timeout is not None else os.environ.get("GPULOCK_READ_TIMEOUT")
        self.read_timeout = float(rt) if rt not in (None, "") else DEFAULT_READ_TIMEOUT
        if not self.read_timeout > 0:
            raise InvalidArgument(f"read_timeout must be > 0 seconds, got {rt!r}")

    def too_large(self, seen: str) -> str:
        return (
            f"request body of {seen} is over this server's limit of {format_size(self.limit)} "
            f"({self.limit} bytes; GPULOCK_MAX_REQUEST_BYTES)"
            + (f"; {self.hint}" if self.hint else "")
        )

    def too_slow(self) -> str:
        return (
            f"the request body did not arrive within {self.read_timeout:g}s (GPULOCK_READ_TIMEOUT); "
            f"send the whole body at once"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from fastapi.responses import JSONResponse

        close = {
            "Connection": "close"
        }  # the rest of the body is never read: do not reuse the connection
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                n = int(v) if v.isdigit() else 0
                if n > self.limit:
                    return await JSONResponse(
                        {"detail": self.detail("request_too_large", self.too_large(f"{n} bytes"))},
                        status_code=413,
                        headers=close,
                    )(scope, receive, send)
            elif k == REQUEST_ID_HEADER and (bad := request_id_error(v)) is not None:
                return await JSONResponse(
                    {"detail": self.detail("invalid_request_id", bad)},
                    status_code=400,
                    headers=close,
                )(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        received = 0
        complete = False

        async def limited_receive() -> Message:
            nonlocal received, complete
            if complete:
                return await receive()
            try:
                msg = await wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise HTTPException(
                    408, self.detail("request_timeout", self.too_slow()), headers=close
                ) from None
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.limit:
                    raise HTTPException(
                        413,
                        self.detail(
                            "request_too_large", self.too_large(f"more than {self.limit} bytes")
                        ),
                        headers=close,
                    )
                complete = not msg.get("more_body", False)
            else:
                complete = True
            return msg

        return await self.app(scope, limited_receive, send)


def install_http_guards(
    app: Any,
    *,
    max_body_bytes: int | str | None = None,
    read_timeout: float | None = None,
    detail: Detail | None = None,
    too_large_hint: str | None = None,
) -> None:
    """What every gpulock HTTP surface installs, for your own app too: the error handlers
    (:func:`install_error_handlers`) and the size and read-time bounds (:class:`RequestLimits`;
    defaults from ``GPULOCK_MAX_REQUEST_BYTES`` and ``GPULOCK_READ_TIMEOUT``). Call it once,
    right after creating the app.

    ``detail(code, message)``: the surface's error body (the value of ``"detail"``; default:
    the message); ``too_large_hint``: what the 413 tells the client to send instead (default:
    "send fewer or shorter inputs")."""
    install_error_handlers(app, detail=detail)
    app.add_middleware(
        RequestLimits,
        max_body_bytes=max_body_bytes,
        read_timeout=read_timeout,
        detail=detail,
        too_large_hint=too_large_hint,
    )
