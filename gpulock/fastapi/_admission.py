"""Admission of a guarded call: a place among this worker's executor threads (a line that
knows each waiter's place, ordered as the pool's queue is: by priority, then first come first
served, a waiter gaining one level per second waited), then a lease from the pool's queue,
with a ttl the pool's ``max_ttl`` bounds.

The thread slot is taken *before* the lease, so no bytes sit leased while their request waits
for a thread."""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from gpulock_common.aio import wait_for

from gpulock.protocol.args import AGING_S
from gpulock._async import AsyncLease
from gpulock.errors import AcquireTimeout, InvalidArgument
from ._backend import Backend
from ._tracing import local_wait

log = logging.getLogger("gpulock.fastapi")


class Slots:
    """A semaphore of ``n`` slots whose waiters know their place. The line is ordered as the
    pool's queue (docs/SEMANTICS.md, "Priorities"): by ``arrival - priority x AGING_S``, so a
    higher priority goes first, equal ones first come first served, and a waiter's effective
    priority rises one level per ``AGING_S`` seconds waited (none starves).

    Attributes:
        free: slots free now.
        waiters: the futures of the waiters, first in line first.
    """

    def __init__(self, n: int):
        self.free = n
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._keys: list[float] = []  # the waiters' sort keys, in the same order

    def position(self, fut: asyncio.Future[None] | None) -> int:
        """The 1-based place of the waiter ``fut``; 0 for None or one no longer waiting."""
        if fut is None:
            return 0
        try:
            return self.waiters.index(fut) + 1
        except ValueError:
            return 0

    async def acquire(
        self, on_wait: Callable[[asyncio.Future[None]], None], priority: int = 0
    ) -> None:
        """Take a slot; when none is free, queue by ``priority`` (see the class) and call
        ``on_wait(future)`` first (the future identifies the waiter to :meth:`position`). A
        cancelled waiter leaves the line, and passes on a slot that was handed to it
        meanwhile."""
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        key = time.monotonic() - priority * AGING_S
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self.waiters.insert(i, fut)
        on_wait(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # handed to us just as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    i = self.waiters.index(fut)
                    del self.waiters[i]
                    del self._keys[i]
            raise

    def release(self) -> None:
        """Give a slot back: to the first waiter still waiting, else to the free count."""
        while self.waiters:
            fut = self.waiters.popleft()
            self._keys.pop(0)
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


class TtlBound:
    """Lease ttls bounded by the pool's ``max_ttl`` as last read (the operator's bound wins:
    ``gpulock pool set --max-ttl``); one warning line each time the clamp changes."""

    def __init__(self, backend: Backend):
        self._backend = backend
        self._clamped: tuple[float, float] | None = None

    def __call__(self, ttl: float) -> float:
        """``ttl`` (seconds), at most the pool's ``max_ttl`` when one is set."""
        st = self._backend.status
        mttl = st.max_ttl if st is not None else 0.0
        if mttl and ttl > mttl:
            if self._clamped != (ttl, mttl):
                self._clamped = (ttl, mttl)
                log.warning(
                    "gpulock: lease ttl %gs (GPULOCK_TTL / ttl=) exceeds pool %s's max_ttl %gs; "
                    "using %gs (renewed every %gs)",
                    ttl,
                    self._backend.pool_name,
                    mttl,
                    mttl,
                    mttl / 3,
                )
            return mttl
        if self._clamped is not None and self._clamped[0] == ttl:
            self._clamped = None
        return ttl


class Admission:
    """The two waits of a guarded call, both bounded by the call's deadline.

    Args:
        slots: this worker's executor-thread slots.
        backend: the pool to lease from.
        lease_ttl: the ttl to lease with now (seconds; the pool's ``max_ttl`` bounds it).
        refresh: reads the pool's status now (so ``lease_ttl`` sees a lowered ``max_ttl``).
        tenant: the tenant the leases count under (None: none).
    """

    def __init__(
        self,
        slots: Slots,
        backend: Backend,
        lease_ttl: Callable[[], float],
        refresh: Callable[[], Awaitable[None]],
        *,
        tenant: str | None = None,
    ):
        self.slots = slots
        self._backend = backend
        self._lease_ttl = lease_ttl
        self._refresh = refresh
        self._tenant = tenant

    async def slot(
        self,
        deadline: float | None,
        timeout_s: float | None,
        on_wait: Callable[[asyncio.Future[None]], None],
        *,
        priority: int = 0,
    ) -> None:
        """Take a thread slot by ``deadline`` (monotonic seconds; None: no deadline, the
        caller cancels); ``on_wait`` and ``priority`` as in :meth:`Slots.acquire`. Traced as
        span ``gpulock.admission`` (:func:`gpulock.fastapi._tracing.local_wait`).

        Raises: AcquireTimeout (position 0) when none was free in time (``timeout_s`` is
        the wait the message names)."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise AcquireTimeout("no thread slot in time", position=0)
        with local_wait(priority) as w:  # span gpulock.admission (when traced)
            try:
                await wait_for(
                    self.slots.acquire(w.waiting(on_wait, self.slots.position), priority),
                    remaining,
                )
            except asyncio.TimeoutError:
                raise AcquireTimeout(
                    f"no free thread in this worker within {timeout_s}s", position=0
                ) from None

    async def lease(
        self,
        amount: int,
        deadline: float | None,
        *,
        request_id: str | None,
        route: str,
        on_queued: Callable[[int], None],
        priority: int = 0,
        preemptible: bool = False,
    ) -> AsyncLease:
        """Lease ``amount`` bytes from the pool's queue by ``deadline`` (monotonic seconds;
        None: no deadline, the caller cancels), as ``request_id`` (None: a fresh one), with
        ``priority``, reporting each place in the queue to ``on_queued``; ``preemptible``: the
        pool may ask the lease to yield to a higher-priority request. When the pool
        refuses the ttl (its ``max_ttl`` was lowered since the last status read) the status is
        read again and, if the ttl is now clamped lower, the lease asked for once more.

        Raises: what :meth:`AsyncPool.acquire` raises (AcquireTimeout, QueueFull,
        CapacityExceeded, ...)."""
        pool = self._backend.pool
        assert pool is not None  # set by start()
        remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
        ttl_s = self._lease_ttl()
        try:
            return await pool.acquire(
                amount,
                ttl=ttl_s,
                timeout=remaining,
                request_id=request_id,
                holder={"route": route},
                on_queued=on_queued,
                priority=priority,
                tenant=self._tenant,
                preemptible=preemptible,
            )
        except InvalidArgument:
            # max_ttl lowered since our last status read: read it now, retry once if it clamps
            await self._refresh()
            if self._lease_ttl() >= ttl_s:
                raise
            remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
            return await pool.acquire(
                amount,
                ttl=self._lease_ttl(),
                timeout=remaining,
                request_id=request_id,
                holder={"route": route},
                on_queued=on_queued,
                priority=priority,
                tenant=self._tenant,
                preemptible=preemptible,
            )
