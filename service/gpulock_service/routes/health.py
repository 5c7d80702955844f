"""``GET /health`` (liveness) and ``GET /ready`` (readiness) of a service worker."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from .. import alloc_conf
from ..openapi import READY_SCHEMA, errors
from ..state import Service


def health_router(svc: Service) -> APIRouter:
    """The two probes, answered from this worker's state (no Redis call)."""
    router = APIRouter()
    limiter = svc.limiter

    @router.get("/health", responses=errors())
    async def health() -> dict[str, Any]:
        """Liveness: answers as long as the event loop runs; never waits on Redis or the queue.
        ``pytorch_cuda_alloc_conf``: the allocator setting in effect (see ``alloc_conf``);
        ``oom_backoff``: the OOM back-off as this worker last read it (no read now).
        ``device_truth``: the device's external use and over-users as last read
        (``GpuLimiter.device.truth``); ``grace``: the pool's restart grace period
        (``GpuLimiter.backend.grace``)."""
        return {
            "status": "ok",
            "pid": os.getpid(),
            "pytorch_cuda_alloc_conf": alloc_conf.state(),
            "oom_backoff": limiter.backoff.state(),
            "device_truth": limiter.device.truth(),
            "grace": limiter.backend.grace(),
        }

    @router.get(
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
            "pool": svc.settings.pool,
            "model": svc.served,
            "device": svc.device,
            "resident_bytes": svc.resident_bytes,
            "checks": checks,
            "grace": limiter.backend.grace(),
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    return router
