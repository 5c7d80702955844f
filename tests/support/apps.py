"""An ASGI app (a FastAPI app with a :class:`gpulock.fastapi.GpuLimiter`) run in the test's own
event loop: its lifespan entered and an in-process HTTP client on it."""

from __future__ import annotations

from typing import Any

from .pools import GiB


class Running:
    """``async with Running(app) as client``: the app's lifespan entered (GpuLimiter started)
    and an httpx client on it in-process (ASGITransport); both closed on exit."""

    def __init__(self, app: Any):
        self.app = app

    async def __aenter__(self) -> Any:
        import httpx

        self._cm = self.app.router.lifespan_context(self.app)
        await self._cm.__aenter__()
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://t", timeout=30
        )
        return self.client

    async def __aexit__(self, *exc: Any) -> None:
        await self.client.aclose()
        await self._cm.__aexit__(*exc)


def one_route_app(url: str, pool: str, **kw: Any) -> tuple[Any, Any]:
    """A FastAPI app with one route, ``POST /sync`` (1 GiB a request, answers ``{"ok": true}``),
    guarded by a :class:`GpuLimiter` on pool ``pool`` at ``url`` (capacity 4 GiB, made if
    missing, never exiting the process); ``kw`` are more GpuLimiter settings. Returns
    ``(app, limiter)``."""
    from fastapi import FastAPI

    from gpulock.fastapi import GpuLimiter

    gpu = GpuLimiter(url, pool, capacity=4 * GiB, configure="create", exit_on_fatal=False, **kw)
    app = FastAPI(lifespan=gpu.lifespan)

    @app.post("/sync")
    @gpu.endpoint("sync", estimate=lambda body: GiB)
    def sync_route(body: dict) -> dict:
        return {"ok": True}

    return app, gpu
