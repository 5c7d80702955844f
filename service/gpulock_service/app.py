"""The embeddings (and generation) service: ``create_app(settings)`` builds the FastAPI app; the module attribute
``app`` builds one from the environment on first access (for ``gunicorn
gpulock_service.app:app`` and ``uvicorn gpulock_service.app:app``).

Neither importing this module nor building the app does any I/O, imports torch or touches CUDA:
under ``gunicorn --preload`` the master imports it and then forks. Everything that connects or
loads happens in the lifespan (:mod:`gpulock_service.startup`), i.e. in each worker after the
fork. ``create_app`` composes the parts: the shared state (:mod:`gpulock_service.state`), the
HTTP guards, OpenAI's error bodies and the middleware, the routers
(:mod:`gpulock_service.routes`) and the truthful OpenAPI schema
(:mod:`gpulock_service.openapi`).
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI

from gpulock.fastapi._http_metrics import HttpMetrics
from gpulock.http.access_log import AccessLog
from gpulock.http.guards import install_http_guards
from gpulock.http.telemetry import instrument_app
from gpulock.units import parse_size

from .openai_errors import guard_detail, install_openai_errors
from .openapi import install_openapi
from .routes import (
    dashboard_router,
    embeddings_router,
    generation_router,
    health_router,
    metrics_router,
    models_router,
    schema_bounds,
)
from .settings import Settings
from .startup import lifespan
from .state import build_service


class _WorkerHeader:
    """Pure ASGI middleware: ``X-Worker-PID`` on every response (which worker answered)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        pid = str(os.getpid()).encode()

        async def send_with(msg):
            if msg["type"] == "http.response.start":
                msg.setdefault("headers", [])
                msg["headers"] = list(msg["headers"]) + [(b"x-worker-pid", pid)]
            await send(msg)

        return await self.app(scope, receive, send_with)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the service (no I/O here; see :mod:`gpulock_service.startup` for what the lifespan
    does). ``app.state`` holds ``limiter``, ``settings``, ``model`` and, when batching,
    ``batcher``."""
    svc = build_service(settings or Settings())
    settings = svc.settings
    app = FastAPI(
        title="gpulock inference service",
        lifespan=lifespan(svc),
        description="OpenAI-compatible embeddings and generation (chat completions, "
        "completions); every request leases GPU memory from a gpulock pool.",
    )
    # 400 for bytes that are not UTF-8, 422 (answered 400, below) for invalid input, 413 for a
    # body over GPULOCK_MAX_REQUEST_BYTES, 408 for one that does not arrive within
    # GPULOCK_READ_TIMEOUT (the same guards as the broker's and a user's GpuLimiter app's).
    install_http_guards(
        app,
        max_body_bytes=parse_size(settings.max_request_bytes, name="max_request_bytes"),
        read_timeout=settings.read_timeout,
        detail=guard_detail,
    )
    app.state.limiter = svc.limiter
    app.state.settings = settings
    app.state.model = svc.model
    # errors in OpenAI's shape (400 for an invalid body; 413, 503 + Retry-After kept)
    install_openai_errors(app)
    app.add_middleware(HttpMetrics)  # outside the rewriting: counts the status sent
    app.add_middleware(_WorkerHeader)
    # outermost: X-Request-ID on every response (errors too) and one gpulock.access line each
    app.add_middleware(AccessLog, log_format=settings.log_format)
    # in this order (a request matches the first route that takes it)
    if settings.dashboard:
        app.include_router(dashboard_router(svc))
    app.include_router(health_router(svc))
    app.include_router(metrics_router(svc))
    app.include_router(models_router(svc))
    embeddings, batcher = embeddings_router(svc)
    if batcher is not None:
        app.state.batcher = batcher
    app.include_router(embeddings)
    generation = generation_router(svc)
    if generation is not None:
        app.include_router(generation)
    install_openapi(app, lambda: schema_bounds(svc))
    # a server span per request when OTEL_* asks for traces (each worker's lifespan sets the
    # provider: gpulock.http.telemetry); nothing otherwise
    instrument_app(app)
    return app


_app: FastAPI | None = None


def __getattr__(name: str) -> Any:
    # ``gpulock_service.app:app``: built on first access from GPULOCK_* variables (PEP 562).
    global _app
    if name == "app":
        if _app is None:
            _app = create_app()
        return _app
    raise AttributeError(name)
