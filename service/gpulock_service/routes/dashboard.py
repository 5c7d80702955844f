"""``/dashboard``: the live view of the service's pool (the page and its data,
``gpulock.dashboard.routes``), from this worker's Redis client."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gpulock.dashboard.routes import dashboard_router as view_router
from gpulock.dashboard.view import dashboard_view

from ..openapi import errors
from ..state import Service


def dashboard_router(svc: Service) -> APIRouter:
    """The dashboard's routes over ``svc``'s one pool; before the limiter is connected its
    data names that as the pool's error."""
    limiter, pool = svc.limiter, svc.settings.pool

    async def dashboard_data() -> dict[str, Any]:
        if limiter.backend.redis is None:
            return {"pools": [], "errors": {pool: "not connected to Redis yet"}}
        return await dashboard_view(limiter.backend.redis, [pool], svc.pool_status)

    return view_router(dashboard_data, responses=errors())
