"""Request ids and access logs, one path for every gpulock HTTP surface (the embeddings service,
the lease broker): pure ASGI middleware :class:`AccessLog`.

* **Request id**: every response carries ``X-Request-ID``: the client's own when it sent one
  (echoed as it is), else a fresh one (32 hex digits). A generated id goes on the response
  only, never into the request's headers: the service's idempotent replays (a client-sent
  ``X-Request-ID``) stay off for a request that did not ask for them. A client's id is at most
  :data:`MAX_REQUEST_ID_BYTES` bytes (:func:`request_id_error`, the one rule: the guards answer
  400 past it, :class:`gpulock.http.guards.RequestLimits`, and so does a guarded call,
  ``gpulock.fastapi``); a longer one is neither echoed nor logged (a fresh id stands in).
* **Access log**: one line per request on the logger ``gpulock.access`` at INFO: method, path,
  status, duration (ms), request id, queue wait (ms, when the request waited for a lease) and
  lease bytes (when it asked for one); ``-`` for what a request did not have. Plain
  ``key=value`` text, or one JSON object per line with a ``time`` field too (UTC, ISO 8601;
  ``log_format="json"``, ``--log-format json``, ``GPULOCK_LOG_FORMAT=json``). What a client
  chose (the path, the request id) can never forge a field or a line: in a plain line a value
  that is not printable ASCII without spaces, ``"``, ``=`` and ``\\`` is written as a JSON
  string (double quotes, backslash escapes, non-ASCII as ``\\uXXXX``), as a JSON line writes
  every string; header bytes that are not UTF-8 show as ``\\xNN`` (:func:`shown`). The line
  goes through the standard :mod:`logging` module: gunicorn's, uvicorn's or your own
  configuration of ``gpulock.access`` decides where it goes (set its level to WARNING to turn
  it off). While no handler would receive it (gunicorn and uvicorn configure only their own
  loggers), the line is written to stderr instead, unless the logger's own level is above
  INFO; decided per line, so a configuration made later wins.

Handlers add what they know with :func:`note` (``lease_bytes``, ``queue_wait_s``): the record
of the request being served (a context variable), a no-op outside one.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import os
import re
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "ACCESS_LOGGER",
    "LOG_FORMATS",
    "MAX_REQUEST_ID_BYTES",
    "AccessLog",
    "check_log_format",
    "note",
    "request_id_error",
    "shown",
]

ACCESS_LOGGER = "gpulock.access"
LOG_FORMATS = ("plain", "json")
HEADER = b"x-request-id"
#: The longest ``X-Request-ID`` a client may send, in bytes: room for a UUID, a trace id and a
#: prefix; the id is an idempotency key, so a longer one is refused (400), never cut (two
#: different ids cut to one would join two requests).
MAX_REQUEST_ID_BYTES = 128
# a plain line's value that needs no quoting: printable ASCII but space, '"', '=' and '\'
_BARE = re.compile(r"[!#-<>-\[\]-~]+")

_record: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "gpulock_access_record", default=None
)


def note(**fields: Any) -> None:
    """Add ``fields`` (``lease_bytes``: int bytes; ``queue_wait_s``: float seconds) to the
    access-log record of the request being served; nothing outside a request."""
    rec = _record.get()
    if rec is not None:
        rec.update(fields)


def request_id_error(value: bytes | str, header: str = "X-Request-ID") -> str | None:
    """None when ``value`` (a request id header's value: bytes, or text as Starlette decodes
    it, one character per byte; other text counts its UTF-8 bytes) may be used, else the 400's
    message naming the bound. Any characters the HTTP server let through are allowed (the
    service hashes the id into its lease request id); only the length is bounded
    (:data:`MAX_REQUEST_ID_BYTES`)."""
    if isinstance(value, str):
        one_per_byte = all(ord(c) < 256 for c in value)
        value = value.encode("latin-1" if one_per_byte else "utf-8", "surrogatepass")
    n = len(value)
    if n <= MAX_REQUEST_ID_BYTES:
        return None
    return (
        f"{header} is {n} bytes long; this server takes at most {MAX_REQUEST_ID_BYTES} bytes "
        f"(it is the request's idempotency key and is never cut): send a shorter id, such as "
        f"a UUID"
    )


def shown(value: bytes | str) -> str:
    """``value`` as valid Unicode text for a log line: header bytes decoded as UTF-8 (a byte
    that is not, as ``\\xNN``), a text's lone surrogates as ``\\udcNN``."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _plain(v: Any) -> str:
    """One value of a plain line: ``-`` for None, numbers as they are, a string bare when
    :data:`_BARE` allows it (and it is not ``-``), else as a JSON string (ASCII only)."""
    if v is None:
        return "-"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)
    s = str(v)
    return s if s != "-" and _BARE.fullmatch(s) else json.dumps(s)


def check_log_format(value: str | None) -> str:
    """``value`` (default ``GPULOCK_LOG_FORMAT``, else ``plain``) lower-cased.

    Raises: InvalidArgument naming the value when it is not ``plain`` or ``json``."""
    from gpulock.errors import InvalidArgument

    v = value if value not in (None, "") else os.environ.get("GPULOCK_LOG_FORMAT") or "plain"
    v = str(v).strip().lower()
    if v not in LOG_FORMATS:
        raise InvalidArgument(f"log format must be 'plain' or 'json', got {value!r}")
    return v


class FallbackFormatter(logging.Formatter):
    """The stderr line while no handler is configured: a JSON line as it is (its ``time`` field
    dates it), a plain one after ``asctime level logger:`` as gunicorn's own lines are."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        return msg if msg.startswith("{") else super().format(record)


class _Emitter:
    """Writes a line to ``logger`` at INFO; to stderr while no handler would receive it."""

    def __init__(self, logger: logging.Logger):
        self.log = logger
        self.fallback = logging.StreamHandler(sys.stderr)
        self.fallback.setFormatter(FallbackFormatter())

    def __call__(self, line: str) -> None:
        if self.log.hasHandlers():
            self.log.info(line)  # the logging configuration decides
        elif self.log.level in (logging.NOTSET, logging.DEBUG, logging.INFO):
            rec = self.log.makeRecord(self.log.name, logging.INFO, __file__, 0, line, (), None)
            self.fallback.handle(rec)


def _line(rec: dict[str, Any], fmt: str) -> str:
    """The access-log line of the request record ``rec`` in ``fmt`` (``plain`` or ``json``):
    one line whatever the client sent (the module docstring)."""
    wait = rec.get("queue_wait_s")
    fields = {
        "method": shown(rec["method"]),
        "path": shown(rec["path"]),
        "status": rec["status"],
        "duration_ms": round(rec["duration_s"] * 1000, 3),
        "request_id": shown(rec["request_id"]),
        "queue_wait_ms": None if wait is None else round(wait * 1000, 3),
        "lease_bytes": rec.get("lease_bytes"),
    }
    if fmt == "json":  # dated itself: a JSON line is read without the logging prefix
        when = datetime.datetime.fromtimestamp(rec["started"], datetime.timezone.utc)
        fields = {"time": when.isoformat(timespec="milliseconds"), **fields}
        return json.dumps(fields, separators=(",", ":"))
    return " ".join(f"{k}={_plain(v)}" for k, v in fields.items())


class AccessLog:
    """The middleware (see the module docstring). ``log_format``: ``plain`` or ``json``
    (default ``GPULOCK_LOG_FORMAT``, else ``plain``). Raises InvalidArgument for another."""

    def __init__(self, app: ASGIApp, log_format: str | None = None):
        self.app = app
        self.format = check_log_format(log_format)
        self.emit = _Emitter(logging.getLogger(ACCESS_LOGGER))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = next((v for k, v in scope.get("headers", ()) if k == HEADER), None)
        # a client's id past the bound is answered 400 (the guards), with a fresh one
        rid = sent if sent and request_id_error(sent) is None else uuid.uuid4().hex.encode()
        rec: dict[str, Any] = {
            "method": scope.get("method", "-"),
            "path": scope.get("path", "-"),
            "status": 500,  # until a response starts: an app that raised answers 500
            "request_id": rid,
        }
        token = _record.set(rec)
        rec["started"] = time.time()
        start = time.perf_counter()

        async def send_with_id(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                rec["status"] = msg["status"]
                headers = [(k, v) for k, v in msg.get("headers", ()) if k.lower() != HEADER]
                msg["headers"] = headers + [(HEADER, rid)]
            await send(msg)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _record.reset(token)
            rec["duration_s"] = time.perf_counter() - start
            self.emit(_line(rec, self.format))
