"""The embeddings service: ``create_app(settings)`` builds the FastAPI app; the module attribute
``app`` builds one from the environment on first access (for ``gunicorn
gpulock_service.app:app`` and ``uvicorn gpulock_service.app:app``).

Neither importing this module nor building the app does any I/O, imports torch or touches CUDA:
under ``gunicorn --preload`` the master imports it and then forks. Everything that
connects or loads happens in the lifespan, i.e. in each worker after the fork:

1. connect to Redis, create the pool if a capacity is configured (create-only unless
   ``GPULOCK_CONFIGURE=set``), start the background reaper;
2. take the worker's **resident lease** (configured bytes; on CUDA the weights' size plus the
   CUDA context, topped up to ``memory_reserved`` after loading) — until it is granted the
   worker is not ready and ``/ready`` names the shortfall;
3. load the model once, in a thread, then report ready.

The worker waits ``GPULOCK_STARTUP_TIMEOUT`` seconds for 2-3 before it starts serving; if they
are not done by then it serves anyway (``/health`` answers, requests get 503 not-ready) and
keeps trying in the background.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Path, Request, Response
from fastapi.responses import JSONResponse

from gpulock.http.access_log import AccessLog
from gpulock.dashboard.view import dashboard_view
from gpulock.dashboard.routes import dashboard_router
from gpulock.http.guards import install_http_guards
from gpulock.protocol.keys import pool_key
from gpulock.admin.samples import Sampler
from gpulock.transport.shards_async import aon_key
from gpulock.errors import BackendUnavailable
from gpulock.fastapi import GpuLimiter
from gpulock.fastapi._http_metrics import HttpMetrics
from gpulock.units import format_size, parse_size

from . import alloc_conf
from .metrics import observe_request
from .inputs import EmbeddingRequest, InputRules, check_shape, count, texts_of
from .models import build_model
from .openai_errors import OpenAIError, guard_detail, install_openai_errors
from .openapi import (
    EMBEDDING_RESPONSES,
    METRICS_RESPONSES,
    READY_SCHEMA,
    errors,
    install_openapi,
)
from .settings import Settings

log = logging.getLogger("gpulock.service")

ROUTE = "embeddings"


class _WorkerHeader:
    """Pure ASGI middleware: ``X-Worker-PID`` on every response (which worker answered)."""

    def __init__(self, app):
        self.app = app
        self.value = str(os.getpid()).encode()

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
    """Build the service (no I/O here; see the module docstring for what the lifespan does)."""
    settings = settings or Settings()
    alloc_conf.apply()  # before any worker imports torch
    model = build_model(settings)
    served: str = settings.model_name or str(getattr(model, "name", settings.model))
    limiter = GpuLimiter(
        settings.redis_url,
        settings.pool,
        capacity=settings.capacity,
        configure=settings.configure,
        acquire_timeout=settings.acquire_timeout,
        inference_timeout=settings.inference_timeout,
        ttl=settings.ttl,
        executor_threads=settings.executor_threads,
        park_timeout=settings.park_timeout,
        result_ttl=settings.result_ttl,
        max_waiters=settings.max_waiters,
        reaper_interval=settings.reaper_interval,
        history_file=settings.history_file,
        enabled=not settings.disabled,
        exit_on_fatal=settings.exit_on_fatal,
        priority_header=settings.priority_header,
        tenant=settings.tenant,
        device=settings.sample_device,
        device_reader=settings.device_reader,
    )
    info: dict[str, Any] = {"device": None, "resident_bytes": 0, "resident_source": None}

    def resolve_device() -> str:
        if settings.model == "sleep" and settings.device == "auto":
            return "cpu"
        from gpulock.cuda import resolve_device as rd

        return rd(settings.device)

    async def bring_up() -> None:
        limiter.set_condition("model", False, "starting")
        try:
            device = await asyncio.to_thread(resolve_device)
            info["device"] = device
            on_cuda = device.startswith("cuda")
            configured = settings.resident_bytes()
            if configured is not None:
                resident, source = configured, "GPULOCK_RESIDENT"
            elif on_cuda:
                hint = getattr(model, "resident_hint", lambda: 0)() or 0
                resident = (
                    int(hint) + parse_size(settings.cuda_context)
                    if settings.cuda_context != "0"
                    else int(hint)
                )
                source = "weights size + GPULOCK_CUDA_CONTEXT (topped up to the measured reservation after load)"
            else:
                resident, source = (
                    parse_size(settings.cpu_resident),
                    "GPULOCK_CPU_RESIDENT (CPU device)",
                )
            info["resident_source"] = source
            if resident > 0:
                limiter.set_condition(
                    "model", False, f"waiting for the resident lease ({format_size(resident)})"
                )
                await limiter.acquire_resident(resident, purpose=served)
                info["resident_bytes"] = resident
            limiter.set_condition("model", False, f"loading {served} on {device}")

            def load() -> None:
                if settings.torch_threads and not on_cuda and settings.model != "sleep":
                    import torch

                    torch.set_num_threads(settings.torch_threads)
                model.load(device)

            await asyncio.to_thread(load)
            if on_cuda and configured is None:
                from gpulock.cuda import resident_bytes

                ctx = 0 if settings.cuda_context == "0" else parse_size(settings.cuda_context)
                measured = await asyncio.to_thread(resident_bytes, device, context_bytes=ctx)
                if measured and measured > resident:
                    log.info(
                        "gpulock: measured resident %s > leased %s; topping up",
                        format_size(measured),
                        format_size(resident),
                    )
                    await limiter.acquire_resident(measured - resident, purpose=served + "-topup")
                    info["resident_bytes"] = measured
            if on_cuda and settings.calibrate and hasattr(model, "calibration_run"):
                await _calibrate(device)
            limiter.set_condition("model", True, "")
            log.info(
                "gpulock: worker %d ready: %s on %s, resident lease %s (%s)",
                os.getpid(),
                served,
                device,
                format_size(info["resident_bytes"]) if info["resident_bytes"] else "none",
                source,
            )
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("gpulock: worker start failed")
            limiter.set_condition("model", False, f"start failed: {type(e).__name__}: {e}")

    async def _calibrate(device: str) -> None:
        lock = pool_key(settings.pool, "calibrating")
        if limiter.pool is None:  # not started (the lifespan starts it before bring_up)
            return
        redis = limiter.pool.redis  # the limiter's own client
        # on the pool's server alone (on a cluster, its shard: gpulock.transport.shards_async.aon_key)
        claimed = await aon_key(redis, lock, ("SET", lock, str(os.getpid()), "NX", "EX", 600))
        if not claimed[0]:
            return
        try:
            b_max = max(1, settings.max_batch)
            shapes = [
                (b, s)
                for b in sorted({1, 8, 32, min(128, b_max), b_max})
                for s in (16, 64, settings.max_tokens)
            ]
            out = await limiter.calibrate(
                ROUTE, model.calibration_run, shapes, device, model.estimate_bytes
            )
            log.info("gpulock: calibrated %d shapes into %s", len(out), limiter.estimates_key)
        finally:
            await aon_key(redis, lock, ("DEL", lock))

    async def pool_status(name: str, limit: int):
        if limiter.pool is None:
            raise BackendUnavailable("the service is not connected to Redis yet")
        return await limiter.pool.status(limit=limit)

    async def pool_names() -> list[str]:
        return [settings.pool]

    async def dashboard_data() -> dict[str, Any]:
        if limiter.redis is None:
            return {"pools": [], "errors": {settings.pool: "not connected to Redis yet"}}
        return await dashboard_view(limiter.redis, [settings.pool], pool_status)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await limiter.start()
        if settings.dashboard and limiter.redis is not None:
            # one sampler per worker; the pool's sampler lease lets one of them write
            sampler = Sampler(limiter.redis, pool_names, pool_status)
            limiter.spawn(sampler.run(), name="gpulock-sampler")
        task = limiter.spawn(bring_up(), name="gpulock-bring-up")
        if settings.startup_timeout > 0:
            done, _ = await asyncio.wait({task}, timeout=settings.startup_timeout)
            if not done:
                _, checks = limiter.readiness()
                why = "; ".join(
                    f"{k}: {v.get('message')}" for k, v in checks.items() if not v["ok"]
                )
                log.warning(
                    "gpulock: worker %d serving while not ready after %.0fs: %s",
                    os.getpid(),
                    settings.startup_timeout,
                    why,
                )
        try:
            yield
        finally:
            await limiter.stop()

    app = FastAPI(
        title="gpulock embeddings service",
        lifespan=lifespan,
        description="OpenAI-compatible embeddings; every request leases GPU memory from a gpulock pool.",
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
    app.state.limiter = limiter
    app.state.settings = settings
    app.state.model = model
    # errors in OpenAI's shape (400 for an invalid body; 413, 503 + Retry-After kept)
    install_openai_errors(app)
    app.add_middleware(HttpMetrics)  # outside the rewriting: counts the status sent
    app.add_middleware(_WorkerHeader)
    # outermost: X-Request-ID on every response (errors too) and one gpulock.access line each
    app.add_middleware(AccessLog, log_format=settings.log_format)
    if settings.dashboard:
        app.include_router(dashboard_router(dashboard_data, responses=errors()))

    @app.get("/health", responses=errors())
    async def health() -> dict[str, Any]:
        """Liveness: answers as long as the event loop runs; never waits on Redis or the queue.
        ``pytorch_cuda_alloc_conf``: the allocator setting in effect (see ``alloc_conf``);
        ``oom_backoff``: the OOM back-off as this worker last read it (no read now).
        ``device_truth``: the device's external use and over-users as last read
        (``GpuLimiter.device_truth``); ``grace``: the pool's restart grace period
        (``GpuLimiter.grace``)."""
        return {
            "status": "ok",
            "pid": os.getpid(),
            "pytorch_cuda_alloc_conf": alloc_conf.state(),
            "oom_backoff": limiter.backoff_state(),
            "device_truth": limiter.device_truth(),
            "grace": limiter.grace(),
        }

    @app.get(
        "/ready",
        responses={
            200: {
                "description": "ready",
                "content": {"application/json": {"schema": READY_SCHEMA}},
            },
            **errors(),
            503: {
                "description": "not ready: the same body, naming the checks that fail",
                "content": {"application/json": {"schema": READY_SCHEMA}},
            },
        },
    )
    async def ready() -> JSONResponse:
        """Readiness: Redis reachable, model loaded, resident lease held and valid. ``grace``:
        the pool's restart grace period, shown but not counted (it is the pool's, not this
        worker's: every worker on the pool is in it alike)."""
        ok, checks = limiter.readiness()
        body = {
            "ready": ok,
            "pid": os.getpid(),
            "pool": settings.pool,
            "model": served,
            "device": info["device"],
            "resident_bytes": info["resident_bytes"],
            "checks": checks,
            "grace": limiter.grace(),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response, responses={**METRICS_RESPONSES, **errors()})
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus text, or OpenMetrics when the scraper's Accept asks for it."""
        return await limiter.metrics_response(request.headers.get("accept"))

    # OpenAI's model objects carry a Unix time; this one is when this worker built the app
    created = int(getattr(model, "created", 0) or time.time())
    names = (served, f"sentence-transformers/{served}")

    def model_object() -> dict[str, Any]:
        return {"id": served, "object": "model", "created": created, "owned_by": "gpulock"}

    def unknown_model(name: str) -> OpenAIError:
        return OpenAIError(
            404,
            f"model {name!r} is not served here; this service serves {served!r} "
            f"(GET /v1/models); leave 'model' out or send that name",
            code="model_not_found",
            param="model",
        )

    @app.get("/v1/models", responses=errors())
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_object()]}

    @app.get(
        "/v1/models/{model_id:path}",
        responses=errors(s404="model_not_found: this service serves another model"),
    )
    async def model_info(
        model_id: str = Path(..., examples=[served], description="the served model's id"),
    ) -> dict[str, Any]:
        """The served model's object; 404 ``model_not_found`` for any other id."""
        if model_id not in names:
            raise unknown_model(model_id)
        return model_object()

    rules = InputRules(
        served=served,
        max_batch=settings.max_batch,
        context=int(getattr(model, "max_tokens", settings.max_tokens)),
        truncate=settings.truncate,
    )

    def estimate(body: EmbeddingRequest) -> int:
        check_shape(body, rules)
        if body.model is not None and body.model not in names:
            raise unknown_model(body.model)
        if body.dimensions is not None and body.dimensions != model.dimensions:
            raise OpenAIError(
                400,
                f"{served} returns {model.dimensions} dimensions, not {body.dimensions}",
                param="dimensions",
            )
        counts = count(body, model, rules)  # once: the estimate and the usage use them
        body._tokens = sum(counts)
        body._longest = max(counts)
        observe_request(len(counts), body._tokens)
        return limiter.estimate(ROUTE, len(counts), max(counts), model.estimate_bytes)

    def estimate_batch(bodies: list[EmbeddingRequest]) -> int:
        """One model call over all the batch's inputs, padded to the longest."""
        n = sum(len(texts_of(b)) for b in bodies)
        return limiter.estimate(ROUTE, n, max(b._longest for b in bodies), model.estimate_bytes)

    def respond(body: EmbeddingRequest, vectors: list[list[float]]) -> Response:
        n_tokens = body._tokens
        if body.encoding_format == "base64":
            import numpy as np

            data = [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode(),
                }
                for i, v in enumerate(vectors)
            ]
        else:
            data = [
                {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)
            ]
        payload = {
            "object": "list",
            "data": data,
            "model": served,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
        return Response(
            json.dumps(payload, separators=(",", ":")).encode(), media_type="application/json"
        )

    def embed_batch(bodies: list[EmbeddingRequest]) -> list[Response]:
        """Runs in gpulock's executor thread, under the batch's lease: one model call."""
        texts = [t for b in bodies for t in texts_of(b)]
        vectors = model.embed(texts)
        out, k = [], 0
        for b in bodies:
            n = len(texts_of(b))
            out.append(respond(b, vectors[k : k + n]))
            k += n
        return out

    if settings.batch:
        batcher = limiter.batcher(
            ROUTE,
            embed_batch,
            estimate=estimate,
            estimate_batch=estimate_batch,
            max_wait_ms=settings.batch_max_wait_ms,
            max_size=settings.batch_max_size,
            param="body",  # X-Request-ID: the fingerprint of the unbatched handler's `body`
            priority=settings.priority,
            max_priority=settings.max_priority,
        )
        app.state.batcher = batcher

        @app.post("/v1/embeddings", responses=EMBEDDING_RESPONSES)
        async def embeddings_batched(
            body: EmbeddingRequest, request: Request, response: Response
        ) -> Response:
            """Joins a batch of this worker's concurrent requests (GPULOCK_BATCH)."""
            return await batcher.submit(body, request=request, response=response)

    else:

        @app.post("/v1/embeddings", responses=EMBEDDING_RESPONSES)
        @limiter.endpoint(
            ROUTE,
            estimate=estimate,
            priority=settings.priority,
            max_priority=settings.max_priority,
        )
        def embeddings(body: EmbeddingRequest) -> Response:
            """Runs in gpulock's executor thread, under the request's lease."""
            return respond(body, model.embed(texts_of(body)))

    def bounds() -> dict[str, int | None]:
        """The handler's bounds for the schema (built on the first GET /openapi.json)."""
        try:  # MiniLM's reads its tokenizer (from disk, loaded with the model)
            vocab = getattr(model, "vocab_size", None)
        except Exception:  # noqa: BLE001 - a schema without the bound, never a 500
            log.warning("gpulock: the model's vocab_size could not be read", exc_info=True)
            vocab = None
        return {
            "max_batch": settings.max_batch,
            "dimensions": getattr(model, "dimensions", None),
            "vocab_size": vocab if isinstance(vocab, int) else None,
            "token_ids": int(callable(getattr(model, "decode_tokens", None))),
        }

    install_openapi(app, bounds)
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
