"""OpenAI's Models API: ``GET /v1/models`` (the one served model) and
``GET /v1/models/{model_id}`` (its object, or 404 ``model_not_found``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Path

from ..openapi import errors
from ..state import Service


def models_router(svc: Service) -> APIRouter:
    """The two routes over ``svc``'s served model (its id is the path parameter's example)."""
    router = APIRouter()

    @router.get("/v1/models", responses=errors())
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [svc.model_object()]}

    @router.get(
        "/v1/models/{model_id:path}",
        responses=errors(s404="model_not_found: this service serves another model"),
    )
    async def model_info(
        model_id: str = Path(..., examples=[svc.served], description="the served model's id"),
    ) -> dict[str, Any]:
        """The served model's object; 404 ``model_not_found`` for any other id."""
        if model_id not in svc.names:
            raise svc.unknown_model(model_id)
        return svc.model_object()

    return router
