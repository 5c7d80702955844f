"""OpenAI's Models API: ``GET /v1/models`` (the served models: the embedding model, and the
generative one when there is one) and ``GET /v1/models/{model_id}`` (its object, or 404
``model_not_found``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Path

from ..openapi import errors
from ..state import Service


def models_router(svc: Service) -> APIRouter:
    """The two routes over ``svc``'s served models (the embedding model's id is the path
    parameter's example)."""
    router = APIRouter()

    @router.get("/v1/models", responses=errors())
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": svc.model_objects()}

    @router.get(
        "/v1/models/{model_id:path}",
        responses=errors(s404="model_not_found: this service serves another model"),
    )
    async def model_info(
        model_id: str = Path(..., examples=[svc.served], description="the served model's id"),
    ) -> dict[str, Any]:
        """A served model's object; 404 ``model_not_found`` for any other id."""
        if model_id in svc.names:
            return svc.model_object()
        for obj in svc.model_objects()[1:]:
            if obj["id"] == model_id:
                return obj
        raise svc.unknown_model(model_id)

    return router
