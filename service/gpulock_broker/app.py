"""``gpulock broker``: the HTTP lease API alone, without a model (also
``python -m gpulock_broker``, same options). :func:`register_broker` is the ``gpulock.cli``
entry point that adds the command to ``gpulock``."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Optional

from .auth import Principal, TokenConfigError, load_tokens

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
# 8100: not `gpulock serve`'s 8000, so the broker and the service can share a host.
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8100


# A lease request is a few hundred bytes; GPULOCK_MAX_REQUEST_BYTES overrides this bound.
DEFAULT_MAX_REQUEST_BYTES = "1MiB"
TOO_LARGE_HINT = "a lease request is a few hundred bytes of JSON (holder metadata: at most 256)"


def error_detail(code: str, message: str) -> dict[str, str]:
    """The broker's error body (``{"detail": {"error": CODE, "message": TEXT}}``), also for the
    HTTP guards' 400, 408 and 413."""
    return {"error": code, "message": message}


def create_broker_app(
    redis_url: str = DEFAULT_REDIS_URL,
    tokens: Optional[Iterable[Principal]] = None,
    *,
    tokens_file: Optional[str] = None,
    max_request_bytes: int | str | None = None,
    read_timeout: float | None = None,
    log_format: str | None = None,
    **broker_kw: Any,
):
    """A FastAPI app serving the lease API at ``/v1`` (OpenAPI at ``/openapi.json``, docs at
    ``/docs``) and ``GET /health``.

    Args:
        redis_url: where the pools live.
        tokens: principals; default: :func:`load_tokens` (``tokens_file``, then the env).
        max_request_bytes: the largest body (else 413 before it is read); default
            ``GPULOCK_MAX_REQUEST_BYTES``, else 1 MiB.
        read_timeout: seconds a body may take to arrive (else 408); default
            ``GPULOCK_READ_TIMEOUT``, else 30.
        log_format: the access log's, ``plain`` or ``json`` (default ``GPULOCK_LOG_FORMAT``,
            else ``plain``); see :mod:`gpulock.http.access_log`.
        **broker_kw: passed to :class:`Broker` (max_wait, backend_timeout, park_max, ...).

    Raises: TokenConfigError when no token is configured.
    """
    import os

    from fastapi import FastAPI

    from gpulock.http.access_log import AccessLog
    from gpulock.http.guards import install_http_guards
    from gpulock.http.telemetry import instrument_app

    from fastapi import Depends

    from gpulock.dashboard.routes import dashboard_router

    from .api import router
    from .api_common import admin_principal, dashboard_data
    from .core import Broker
    from .responses import errors

    principals = list(tokens) if tokens is not None else load_tokens(tokens_file)
    broker = Broker(redis_url, principals, **broker_kw)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await broker.start()
        app.state.gpulock_broker = broker
        try:
            yield
        finally:
            await broker.aclose()

    app = FastAPI(
        title="gpulock lease broker",
        version="1",
        description="HTTP leases on gpulock GPU-memory pools. Amounts are bytes (or sizes such as "
        '"4GiB"), durations seconds, instants Unix seconds on the Redis server clock.',
        lifespan=lifespan,
    )
    app.include_router(router)
    # the live view, /dashboard: the page is static; its data needs an admin token
    app.include_router(
        dashboard_router(
            lambda: dashboard_data(broker),
            dependencies=[Depends(admin_principal)],
            responses=errors(
                s403="forbidden: only an admin token may see the dashboard", validation=None
            ),
        )
    )
    # the same guards as the service's: 400 for bytes that are not UTF-8 or JSON nested too
    # deeply, 413 over the size bound, 408 for a body that does not arrive in time; their
    # bodies in the broker's error shape ({"detail": {"error", "message"}})
    install_http_guards(
        app,
        max_body_bytes=max_request_bytes
        if max_request_bytes is not None
        else (os.environ.get("GPULOCK_MAX_REQUEST_BYTES") or DEFAULT_MAX_REQUEST_BYTES),
        read_timeout=read_timeout,
        detail=error_detail,
        too_large_hint=TOO_LARGE_HINT,
    )
    # outermost: X-Request-ID on every response (errors too) and one gpulock.access line each
    app.add_middleware(AccessLog, log_format=log_format)

    @app.get("/health", tags=["health"], summary="Liveness (no Redis call)")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # a server span per request (its parent the caller's traceparent) when OTEL_* asks for
    # traces; run_broker sets the provider
    instrument_app(app)
    return app


def run_broker(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    redis_url: str = DEFAULT_REDIS_URL,
    tokens_file: Optional[str] = None,
    max_wait: float = 20.0,
    log_level: str = "info",
    log_format: str = "plain",
) -> None:
    """Serve the broker with uvicorn until interrupted; one ``gpulock.access`` line per
    request (``log_format``: ``plain`` or ``json``) instead of uvicorn's access log."""
    import uvicorn

    from gpulock.http import telemetry
    from gpulock.http.server import MAX_HEADER_BYTES, server_protocol

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # traces from the OTEL_* variables (service name gpulock-broker): gpulock.http.telemetry
    telemetry.configure_from_env("gpulock-broker")
    app = create_broker_app(
        redis_url, tokens_file=tokens_file, max_wait=max_wait, log_format=log_format
    )
    # access_log: gpulock.access logs each request (never headers: no tokens); uvicorn's off.
    # http: uvicorn's protocol with a deadline for the request line and headers
    # (GPULOCK_READ_TIMEOUT); an idle kept-alive connection is closed after 5 s.
    try:
        uvicorn.run(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            http=server_protocol(),
            timeout_keep_alive=5,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
    finally:
        telemetry.shutdown()  # the spans still buffered are sent


def register_broker(typer_app) -> None:
    """Add ``broker`` to a Typer app (``gpulock broker``)."""
    import typer

    @typer_app.command("broker")
    def broker(
        host: str = typer.Option(DEFAULT_HOST, "--host", help="Address to listen on."),
        port: int = typer.Option(
            DEFAULT_PORT,
            "--port",
            min=1,
            max=65535,
            help="TCP port (gpulock serve's default is 8000).",
        ),
        redis_url: str = typer.Option(
            DEFAULT_REDIS_URL,
            "--redis-url",
            envvar="GPULOCK_REDIS_URL",
            help="Redis holding the pools.",
        ),
        tokens_file: Optional[str] = typer.Option(
            None,
            "--tokens-file",
            envvar="GPULOCK_BROKER_TOKENS_FILE",
            help='JSON: {"tokens": [{"name", "token" or "sha256", "pools": [...], "admin"}]}; '
            "or the same JSON in GPULOCK_BROKER_TOKENS.",
        ),
        max_wait: float = typer.Option(
            20.0, "--max-wait", min=0.0, max=600.0, help="Longest a queued POST is held, seconds."
        ),
        log_level: str = typer.Option("info", "--log-level"),
        log_format: str = typer.Option(
            "plain",
            "--log-format",
            envvar="GPULOCK_LOG_FORMAT",
            help="access log lines (logger gpulock.access): plain key=value or json",
        ),
    ) -> None:
        """Serve the HTTP lease API (/v1) for hosts that do not talk to Redis."""
        from gpulock import InvalidArgument
        from gpulock.transport.connect import check_url

        from gpulock.http.access_log import check_log_format

        try:
            check_url(redis_url)  # a malformed URL: exit 2 before anything starts
        except InvalidArgument as e:
            typer.echo(f"error: --redis-url: {e}", err=True)
            raise typer.Exit(2) from None
        try:
            log_format = check_log_format(log_format)
        except InvalidArgument as e:
            typer.echo(f"error: --log-format: {e}", err=True)
            raise typer.Exit(2) from None
        from gpulock.http.telemetry import exporters

        try:
            exporters()  # OTEL_TRACES_EXPORTER names exporters this broker has
        except InvalidArgument as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        try:
            run_broker(host, port, redis_url, tokens_file, max_wait, log_level, log_format)
        except TokenConfigError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
