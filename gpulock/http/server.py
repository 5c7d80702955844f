"""The connection-level bound of every gpulock HTTP server (the embeddings service under
gunicorn, the lease broker under uvicorn) that the ASGI app cannot see: a uvicorn protocol that
closes a connection whose request line and headers do not arrive within the read timeout
(uvicorn has none: a connection that sends nothing, or a header byte a second, was held
forever), or that sends more header bytes than ``MAX_HEADER_BYTES``.

The request-level bounds (error replies, body size and read time) are
:func:`gpulock.http.guards.install_http_guards`'s. uvicorn is imported only by
:func:`server_protocol`.
"""

from __future__ import annotations

import os
from typing import Any

from gpulock.http.guards import DEFAULT_READ_TIMEOUT

__all__ = [
    "read_timeout",
    "server_protocol",
    "MAX_HEADER_BYTES",
]

# Request line and headers together; h11's own bound (uvicorn's h11_max_incomplete_event_size)
# is 16 KiB, httptools has none.
MAX_HEADER_BYTES = 64 * 1024

_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)
_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


def read_timeout() -> float:
    """``GPULOCK_READ_TIMEOUT`` (seconds), else the default (30)."""
    v = os.environ.get("GPULOCK_READ_TIMEOUT")
    return float(v) if v not in (None, "") else DEFAULT_READ_TIMEOUT


def _timed(base: type, timeout: float, max_header_bytes: int) -> type:
    class TimedProtocol(base):  # type: ignore[misc]  # base: a class known only at run time
        """``base`` with a deadline for each request's head (request line and headers):
        armed when the connection opens and when the first bytes of a next request arrive,
        disarmed when a request's headers are complete (its cycle starts)."""

        def connection_made(self, transport: Any) -> None:
            self._head_timer = None
            self._head_bytes = 0
            self._head_tail = b""
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._head_bytes = 0
            self._head_tail = b""
            self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _refuse(self, template: bytes, text: str) -> None:
            self._disarm()
            if not self.transport.is_closing():
                body = text.encode()
                self.transport.write(template % (len(body), body))
                self.transport.close()

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being served (its own bounds apply)
            self._refuse(
                _408,
                f"the request line and headers did not arrive within {timeout:g}s "
                f"(GPULOCK_READ_TIMEOUT)\n",
            )

        def data_received(self, data: bytes) -> None:
            idle = self.cycle is None or self.cycle.response_complete
            if idle and self._head_timer is None:
                self._arm()  # the first bytes of a next request on a kept-alive connection
            before = self.cycle
            if self._head_timer is not None:
                # Counted *before* the parser sees the chunk: a head that arrives whole in one
                # or two reads (up to 256 KiB each) completes the request in the parser, and
                # was served, however long (heads of 70 and 100 KB were answered 200).
                self._head_bytes += self._head_part(data)
                if self._head_bytes > max_header_bytes:
                    self._refuse(_431, f"request line and headers over {max_header_bytes} bytes\n")
                    return
                self._head_tail = data[-3:]
            super().data_received(data)
            if self.cycle is not before:
                self._disarm()  # the headers are complete: the request's body has its own bound

        def _head_part(self, data: bytes) -> int:
            """How many bytes of ``data`` belong to the head being received: up to the end of
            its blank line (CRLF CRLF, or LF LF, which the parsers accept too), also when that
            is split across reads; all of ``data`` when it does not end in this chunk."""
            tail = self._head_tail
            window = tail + data
            ends = [i for i in (window.find(b"\r\n\r\n"), window.find(b"\n\n")) if i >= 0]
            if not ends:
                return len(data)
            end = min(ends) + (4 if window.startswith(b"\r\n\r\n", min(ends)) else 2)
            return max(0, end - len(tail))

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    TimedProtocol.__name__ = TimedProtocol.__qualname__ = f"Timed{base.__name__}"
    return TimedProtocol


def server_protocol(timeout: float | None = None, max_header_bytes: int = MAX_HEADER_BYTES) -> type:
    """uvicorn's HTTP protocol class (httptools when installed, else h11) with the head
    deadline above; pass it as ``uvicorn.Config(http=...)``."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # pragma: no cover - uvicorn without httptools
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    return _timed(base, read_timeout() if timeout is None else float(timeout), max_header_bytes)
