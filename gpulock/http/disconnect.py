"""Noticing that an HTTP client hung up while its request waits (a queued request whose
client is gone must leave the queue at once: uvicorn and Starlette never cancel a plain
handler). Used by the GpuLimiter and the lease broker's long poll."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi import Request

__all__ = ["watch_disconnect"]


class _Gone(Exception):
    """The client closed the connection while its request waited (see watch_disconnect)."""


def _is_gone(gone: asyncio.Task[Any] | None) -> bool:
    return (
        gone is not None
        and gone.done()
        and not gone.cancelled()
        and gone.exception() is None
        and gone.result()
    )


async def _wait_or_gone(aw: Awaitable[Any], timeout: float, gone: asyncio.Task[Any] | None) -> None:
    """Await ``aw`` for at most ``timeout`` seconds: TimeoutError after it, _Gone as soon as
    ``gone`` says the client hung up (then ``aw`` is cancelled; pass a shield to keep it)."""
    fut = asyncio.ensure_future(aw)
    waits: set[asyncio.Future[Any]] = (
        {fut} if gone is None or gone.done() and not _is_gone(gone) else {fut, gone}
    )
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        fut.cancel()
        raise
    if fut.done():
        if not fut.cancelled():
            fut.exception()  # retrieved; the caller reads the outcome itself
        return
    fut.cancel()
    if _is_gone(gone):
        raise _Gone()
    raise asyncio.TimeoutError()


def watch_disconnect(request: Request) -> asyncio.Task[bool]:
    """A task that returns True once the request's client has closed the connection (the
    ASGI ``http.disconnect`` message); cancel it when the answer is ready. The body is read
    first if nobody has (Starlette keeps it on the request, so the handler still sees it):
    only what follows the body is consumed."""

    async def watch() -> bool:
        from starlette.requests import ClientDisconnect

        try:
            if not hasattr(request, "_body") and not getattr(request, "_stream_consumed", False):
                await request.body()
            while True:
                msg = await request.receive()
                if msg.get("type") == "http.disconnect":
                    return True
        except ClientDisconnect:
            return True
        except asyncio.CancelledError:
            raise
        except Exception:  # the read refused (a bound of RequestLimits): that is not a hang-up
            return False

    t = asyncio.ensure_future(watch())
    t.add_done_callback(lambda t: t.cancelled() or t.exception())
    return t
