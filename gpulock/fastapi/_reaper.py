"""The background reaper: a status read of the pool every ``reaper_interval`` seconds (the read
reaps expired leases and wakes the waiters that now fit), which the limiter's parts learn
from; every 10th read is full: it also sweeps the metrics of dead processes and refreshes the
calibrated estimates and the OOM back-off."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from gpulock_common.aio import stop_tasks

from gpulock.transport.failure_log import FailureLog
from gpulock.protocol.replies import PoolStatus
from gpulock.errors import GpuLockError, PoolNotFound
from ._backend import Backend
from ._metrics import multiproc_dir, sweep_dead_processes
from ._settings import Settings

#: Leases and waiters the reaper's status read lists: the queue's head with each waiter's wait
#: estimate, and the mean amount that stands in for the others in a 503's estimate at the
#: queue's tail (RetryAfterEstimator.pool_wait).
STATUS_LIMIT = 64


class Reaper:
    """Reads the pool's status in the background.

    Args:
        settings: ``reaper_interval``; ``capacity`` re-creates a pool that is not found.
        backend: the pool; each read is recorded there (or the error).
        on_read: ``await on_read(now, status, full)`` after each successful read (``now`` in
            ``time.monotonic()`` seconds; ``full`` every 10th read).
        publish: called after every read, successful or not (readiness).
    """

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        on_read: Callable[[float, PoolStatus, bool], Awaitable[None]],
        publish: Callable[[], None],
    ):
        self._settings = settings
        self._backend = backend
        self._on_read = on_read
        self._publish = publish
        # Repeated failures (Redis down) log one line, then a summary.
        self._log = FailureLog(f"reaper tick for pool {backend.pool_name}")
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the loop (in the running event loop)."""
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="gpulock-reaper")

    async def stop(self) -> None:
        """Cancel the loop and wait for it to end (cancelling again if a Redis call lost the
        cancellation: :func:`gpulock_common.aio.stop_tasks`)."""
        if self._task:
            await stop_tasks([self._task])

    async def _loop(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(self._settings.reaper_interval)
            n += 1
            try:
                await self.tick(full=(n % 10 == 0))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._log.failed(e, exc_info=True)
            else:
                self._log.ok()

    async def tick(self, full: bool = True) -> None:
        """One read now; ``full`` also sweeps the multiprocess directory of dead processes'
        files. A pool not found is created
        again when a capacity was given. Redis errors are recorded, not raised."""
        be = self._backend
        assert be.pool is not None
        now = time.monotonic()
        try:
            st = await be.pool.status(limit=STATUS_LIMIT)
        except PoolNotFound as e:
            be.status, be.redis_error = None, str(e)
            capacity = self._settings.capacity
            if capacity is not None:
                with contextlib.suppress(GpuLockError):
                    await be.pool.configure(capacity, create_only=True)
            self._publish()
            return
        except GpuLockError as e:
            be.redis_error = str(e)
            self._publish()
            return
        be.redis_error = None
        be.record(st, now)
        await self._on_read(now, st, full)
        if full:
            d = multiproc_dir()
            if d:
                sweep_dead_processes(d)
        self._publish()
