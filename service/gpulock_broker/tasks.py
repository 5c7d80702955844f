"""The broker's background tasks, and the bound on how long a request waits for Redis.

A Redis call that outlives its HTTP request is not cancelled (it may have queued or granted):
it finishes as a background task, and what it did is kept track of by the caller's records."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

from gpulock_common.aio import stop_tasks

from gpulock.errors import BackendUnavailable

__all__ = ["Tasks"]


class Tasks:
    """The set of the broker's background tasks (keepers of parked places, withdrawals,
    releases, Redis calls that outlived a request).

    Args:
        backend_timeout: the longest :meth:`guard` waits, seconds.
    """

    def __init__(self, backend_timeout: float):
        self.backend_timeout = backend_timeout
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, aw: Awaitable) -> asyncio.Task:
        """Run ``aw`` as a background task; its error, if any, is consumed (not logged)."""
        t = asyncio.ensure_future(aw)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        t.add_done_callback(lambda t: t.cancelled() or t.exception())  # consume the error
        return t

    async def guard(
        self,
        aw: Awaitable,
        inflight: set[asyncio.Future] | None = None,
        bound: float | None = None,
    ) -> Any:
        """Await a Redis operation for at most ``bound`` (default ``backend_timeout``) seconds
        and return its result. A future is awaited as it is; any other awaitable is spawned
        first. The task is in ``inflight`` (when given) until it is done.

        Raises: BackendUnavailable on timeout (the operation goes on in the background: it may
        have queued or granted, and its place is parked like any other, and withdrawn if nobody
        comes back); else what the operation raised."""
        t = aw if isinstance(aw, asyncio.Future) else self.spawn(aw)
        if inflight is not None:
            inflight.add(t)
            t.add_done_callback(inflight.discard)
        limit = self.backend_timeout if bound is None else bound
        done, _ = await asyncio.wait((t,), timeout=limit)
        if not done:
            raise BackendUnavailable(f"Redis did not answer within {limit:g}s")
        return t.result()

    async def aclose(self) -> None:
        """Cancel every background task and wait for them to end."""
        await stop_tasks(list(self._tasks))
