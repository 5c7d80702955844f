"""Request ids and access logs, one path for every gpulock HTTP surface (the embeddings service,
the lease broker): pure ASGI middleware :class:`AccessLog`.

* **Request id**: every response carries ``X-Request-ID``: the client's own when it sent one
  (echoed as it is), else a fresh one (32 hex digits). A generated id goes on the response
  only, never into the request's headers: the service's idempotent replays (a client-sent
  ``X-Request-ID``) stay off for a request that did not ask for them.
* **Access log**: one line per request on the logger ``gpulock.access`` at INFO: method, path,
  status, duration (ms), request id, queue wait (ms, when the request waited for a lease) and
  lease bytes (when it asked for one); ``-`` for what a request did not have. Plain
  ``key=value`` text, or one JSON object per line with a ``time`` field too (UTC, ISO 8601;
  ``log_format="json"``, ``--log-format json``, ``GPULOCK_LOG_FORMAT=json``). The line goes through the standard :mod:`logging` module:
  gunicorn's, uvicorn's or your own configuration of ``gpulock.access`` decides where it goes
  (set its level to WARNING to turn it off). While no handler would receive it (gunicorn and
  uvicorn configure only their own loggers), the line is written to stderr instead, unless
  the logger's own level is above INFO; decided per line, so a configuration made later wins.

Handlers add what they know with :func:`note` (``lease_bytes``, ``queue_wait_s``): the record
of the request being served (a context variable), a no-op outside one.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import os
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["ACCESS_LOGGER", "LOG_FORMATS", "AccessLog", "check_log_format", "note"]

ACCESS_LOGGER = "gpulock.access"
LOG_FORMATS = ("plain", "json")
HEADER = b"x-request-id"

_record: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "gpulock_access_record", default=None
)


def note(**fields: Any) -> None:
    """Add ``fields`` (``lease_bytes``: int bytes; ``queue_wait_s``: float seconds) to the
    access-log record of the request being served; nothing outside a request."""
    rec = _record.get()
    if rec is not None:
        rec.update(fields)


def check_log_format(value: str | None) -> str:
    """``value`` (default ``GPULOCK_LOG_FORMAT``, else ``plain``) lower-cased.

    Raises: InvalidArgument naming the value when it is not ``plain`` or ``json``."""
    from .errors import InvalidArgument

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
    wait = rec.get("queue_wait_s")
    fields = {
        "method": rec["method"],
        "path": rec["path"],
        "status": rec["status"],
        "duration_ms": round(rec["duration_s"] * 1000, 3),
        "request_id": rec["request_id"],
        "queue_wait_ms": None if wait is None else round(wait * 1000, 3),
        "lease_bytes": rec.get("lease_bytes"),
    }
    if fmt == "json":  # dated itself: a JSON line is read without the logging prefix
        when = datetime.datetime.fromtimestamp(rec["started"], datetime.timezone.utc)
        fields = {"time": when.isoformat(timespec="milliseconds"), **fields}
        return json.dumps(fields, separators=(",", ":"))
    return " ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items())


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
        rid = sent if sent else uuid.uuid4().hex.encode()
        rec: dict[str, Any] = {
            "method": scope.get("method", "-"),
            "path": scope.get("path", "-"),
            "status": 500,  # until a response starts: an app that raised answers 500
            "request_id": rid.decode("latin-1"),
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
