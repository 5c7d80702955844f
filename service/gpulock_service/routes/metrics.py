"""``GET /metrics``: the worker's Prometheus series (all workers' under multiprocess mode)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from ..openapi import METRICS_RESPONSES, errors
from ..state import Service


def metrics_router(svc: Service) -> APIRouter:
    """The scrape route, answered by the limiter (``GpuLimiter.metrics_response``)."""
    router = APIRouter()
    limiter = svc.limiter

    @router.get("/metrics", response_class=Response, responses={**METRICS_RESPONSES, **errors()})
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus text, or OpenMetrics when the scraper's Accept asks for it."""
        return await limiter.metrics_response(request.headers.get("accept"))

    return router
