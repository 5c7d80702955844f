"""Pure ASGI middleware :class:`HttpMetrics`: every HTTP request counted by method, route and
status (``gpulock_http_requests_total``) and timed (``gpulock_http_request_duration_seconds``),
whatever answered it: the guards' 400/408/413, validation, 404s and 503s before a lease is
asked for, as well as the guarded calls. ``route`` is the matched route's path template
(``/v1/models/{model_id:path}``), ``<unmatched>`` when no route matched, so a scan of random
paths adds no series."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ._metrics import metrics

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNMATCHED = "<unmatched>"


class HttpMetrics:
    """The middleware (see the module docstring); add it outside the app's error rewriting, so
    it counts the status the client got."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = 500  # until a response starts: an app that raised answers 500

        async def send_counted(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            route = getattr(scope.get("route"), "path", None) or UNMATCHED
            method = str(scope.get("method", "-"))
            m = metrics()
            m.http_requests.labels(method, route, str(status)).inc()
            m.http_duration.labels(method, route).observe(time.perf_counter() - start)
