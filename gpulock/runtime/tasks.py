"""The event loop a pool object's background work runs in, and its tasks that must finish.

One per :class:`~gpulock.runtime.runtime.Runtime`: the loop is known up front for the sync shell (its
loop thread) or bound when the first background task starts (the asyncio shell's loop).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Callable

from gpulock_common.aio import stop_tasks


class LoopTasks:
    """The loop of one pool object's background work and its fire-and-forget tasks."""

    def __init__(self, pool: str, loop: asyncio.AbstractEventLoop | None = None):
        self.pool = pool
        self.loop = loop  # the loop the tasks run in (known up front for the sync shell)
        self._background: set[asyncio.Task[Any]] = set()

    def bind(self) -> asyncio.AbstractEventLoop:
        """Take the running loop as the loop of the background work; returns it."""
        self.loop = asyncio.get_running_loop()
        return self.loop

    def in_loop(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` in the loop: now when called in it (or in any loop while none is bound),
        else soon, thread-safely. Raises RuntimeError when no loop is bound or running."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and (self.loop is None or running is self.loop):
            fn()
        elif self.loop is None:  # no loop yet: nothing to run it in
            raise RuntimeError(f"gpulock: pool {self.pool}: no event loop yet")
        else:
            self.loop.call_soon_threadsafe(fn)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run a coroutine that must finish even if its caller is cancelled."""
        t = asyncio.get_running_loop().create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)
        return t

    async def drain(self, timeout: float) -> None:
        """Give the spawned tasks still running ``timeout`` seconds to finish; cancel the rest."""
        if self._background:
            # Withdrawals and releases in flight get a moment to finish; against a Redis that
            # does not answer they are dropped (what they were for expires on its own).
            pending = set(self._background)
            _, left = await asyncio.wait(pending, timeout=timeout)
            await stop_tasks(left)
