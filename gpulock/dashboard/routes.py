"""``/dashboard`` for a FastAPI app (the service's and the broker's): the page, its script and
style (package data in ``gpulock/dashboard/static``, no CDN, no build step) and
``/dashboard/data``, the JSON of :func:`gpulock.dashboard.view.dashboard_view`.

Imports FastAPI when :func:`dashboard_router` is called, never at import time. The page, the
script and the style hold no data and are served to anyone; ``/dashboard/data`` runs the
caller's ``dependencies`` first (the broker's admin-token check). Every answer carries a
Content-Security-Policy that allows this origin only, so the page cannot load anything from
elsewhere.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any, Awaitable, Callable, Sequence

__all__ = ["CSP", "dashboard_router", "static_text"]

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_STATIC = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


@cache
def static_text(name: str) -> str:
    """A shipped file of the page (``index.html``, ``dashboard.js``, ``dashboard.css``).
    Raises KeyError for another name."""
    if name not in _STATIC:
        raise KeyError(name)
    return resources.files("gpulock.dashboard").joinpath("static", name).read_text("utf-8")


def dashboard_router(
    view: Callable[[], Awaitable[dict[str, Any]]],
    *,
    dependencies: Sequence[Any] = (),
    responses: dict[int | str, dict[str, Any]] | None = None,
) -> Any:
    """A FastAPI ``APIRouter``: ``GET /dashboard`` (the page), ``/dashboard/dashboard.js``,
    ``/dashboard/dashboard.css`` and ``GET /dashboard/data`` (``await view()``, as JSON,
    behind ``dependencies``: FastAPI ``Depends(...)`` objects). ``responses``: the OpenAPI
    ``responses=`` of ``/dashboard/data`` beyond its 200 (what ``dependencies`` and ``view``
    may answer instead)."""
    from fastapi import APIRouter
    from fastapi.responses import JSONResponse, Response

    router = APIRouter(tags=["dashboard"])
    headers = {
        "Content-Security-Policy": CSP,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }

    def static(name: str) -> Callable[[], Awaitable[Response]]:
        async def serve() -> Response:
            return Response(static_text(name), media_type=_STATIC[name], headers=headers)

        return serve

    router.add_api_route(
        "/dashboard",
        static("index.html"),
        methods=["GET"],
        include_in_schema=False,
        response_model=None,
    )
    for name in ("dashboard.js", "dashboard.css"):
        router.add_api_route(
            f"/dashboard/{name}",
            static(name),
            methods=["GET"],
            include_in_schema=False,
            response_model=None,
        )

    async def data() -> JSONResponse:
        return JSONResponse(await view(), headers={**headers, "Cache-Control": "no-store"})

    router.add_api_route(
        "/dashboard/data",
        data,
        methods=["GET"],
        dependencies=list(dependencies),
        response_model=None,
        response_class=JSONResponse,
        responses=dict(responses or {}),
        summary="The live view of the pools (bytes, seconds; no token identities)",
    )
    return router
