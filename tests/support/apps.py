"""An ASGI app (a FastAPI app with a :class:`gpulock.fastapi.GpuLimiter`) run in the test's own
event loop: its lifespan entered and an in-process HTTP client on it."""

from __future__ import annotations

from typing import Any


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
