"""Resident leases: the long-lived leases of what each worker keeps on the GPU (weights, CUDA
context), taken without ever blocking the pool's request traffic and taken again when lost.
The pool itself refuses a request larger than the room they leave (docs/SEMANTICS.md,
"Resident leases"): the 413 is the core's RoomExceeded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from gpulock._async import AsyncLease
from gpulock.errors import AcquireTimeout, BackendUnavailable, CapacityExceeded, PoolNotFound
from gpulock.units import format_size, parse_size
from ._admission import TtlBound
from ._backend import Backend
from ._history import History
from ._metrics import metrics
from ._settings import Settings

log = logging.getLogger("gpulock.fastapi")


class ResidentLeases:
    """This worker's resident leases.

    Args:
        settings: ``ttl`` and ``reaper_interval`` are read from it.
        backend: the pool; every read of the room also refreshes the status it keeps.
        ttl_bound: bounds a lease's ttl by the pool's ``max_ttl``.
        history: where grants and releases are recorded.
        spawn: runs a background task the limiter's ``stop()`` cancels.
        changed: called whenever what readiness reports may have changed.
        stopping: True once the limiter is shutting down (lost leases are not taken again).

    Attributes:
        leases: the resident leases held.
        wanted: bytes asked for, over all :meth:`acquire` calls.
    """

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        ttl_bound: TtlBound,
        history: History,
        spawn: Callable[[Coroutine[Any, Any, Any], str], Any],
        changed: Callable[[], None],
        stopping: Callable[[], bool],
    ):
        self._settings = settings
        self._backend = backend
        self._ttl_bound = ttl_bound
        self._history = history
        self._spawn = spawn
        self._changed = changed
        self._stopping = stopping
        self.leases: list[AsyncLease] = []
        self.wanted = 0
        self._waiting = 0
        self._mode = ""

    def held(self) -> int:
        """Bytes of this worker's resident leases that are valid."""
        return sum(lz.amount for lz in self.leases if not lz.lost and not lz.released)

    def count(self) -> int:
        """This worker's resident leases."""
        return len(self.leases)

    def message(self) -> str:
        """Why the resident leases are short: the bytes missing, the pool's free room and
        shortfall, and how the lease is being waited for."""
        need = self.wanted - self.held()
        st = self._backend.status
        if st is None:
            return f"waiting for a resident lease of {format_size(need)}; pool status unknown ({self._backend.redis_error})"
        free = max(0, st.capacity - st.used)
        short = max(0, need - free)
        msg = (
            f"waiting for a resident lease of {format_size(need)} ({need} bytes) for this worker's model: "
            f"pool {self._backend.pool_name!r} has {format_size(free)} free of {format_size(st.capacity)} "
            f"({st.lease_count} leases hold {format_size(st.used)}"
        )
        if short:
            msg += f"); shortfall {format_size(short)} ({short} bytes)"
        else:
            msg += f"; {st.waiter_count} queued)"
        if self._mode:
            msg += f"; {self._mode}"
        return msg

    async def acquire(
        self, amount: int | str, *, purpose: str = "model", ttl: float | None = None
    ) -> AsyncLease:
        """Take a long-lived lease for what this worker keeps on the GPU (weights, CUDA
        context). Waits as long as it takes (readiness reports the shortfall meanwhile); the
        lease is released by ``stop()`` and, if the worker dies, reaped after its ttl. If the
        lease is lost later (Redis restarted without data, a long pause), readiness turns false
        and it is taken again in the background."""
        amount = parse_size(amount, name="resident amount")
        self.wanted += amount
        self._waiting += 1
        self._changed()
        try:
            lease = await self._acquire_once(amount, purpose, ttl)
        finally:
            self._waiting -= 1
        return lease

    async def _read(self) -> int:
        """Read the pool's status now (readiness quotes it; the ttl bound uses its max_ttl);
        the bytes of the resident leases held and queued."""
        assert self._backend.pool is not None
        st = await self._backend.pool.status(limit=0)
        self._backend.record(st)
        return st.resident + st.resident_queued

    async def release_all(self) -> None:
        """Release every resident lease (errors ignored)."""
        for lease in self.leases:
            self._history.record("release", lease, route="resident")  # before the release is sent
            with contextlib.suppress(BaseException):
                await lease.release()
        self.leases.clear()
        metrics().resident.set(0)

    async def _acquire_once(self, amount: int, purpose: str, ttl: float | None) -> AsyncLease:
        """Take a resident lease without ever blocking the pool's request traffic.

        A FIFO queue would let a resident request that can never fit (the other workers'
        resident leases leave too little room, as for a 4th worker on a GPU that fits three)
        sit at the head of the queue and stall every request behind it. The pool queues a
        resident request only where it fits next to the resident leases held and queued
        (docs/SEMANTICS.md, "Resident leases"): then it waits in the queue like anyone else
        (it is granted once the short request leases ahead drain); else it is answered at once
        (AcquireTimeout) and asked again every reaper interval, so it gets the room within an
        interval of a worker dying and its lease being reaped."""
        pool = self._backend.pool
        assert pool is not None
        interval = self._settings.reaper_interval
        tenant = self._settings.tenant
        backoff = 0.5
        holder = {"purpose": f"resident:{purpose}"}
        self._mode = ""
        while True:
            try:
                await self._read()
                # the pool's max_ttl, as just read, bounds it
                ttl_s = self._ttl_bound(ttl or self._settings.ttl)
                self._mode = "queued behind the requests ahead of it"
                lease = await pool.acquire(
                    amount, ttl=ttl_s, timeout=None, holder=holder, tenant=tenant, resident=True
                )
                break
            except CapacityExceeded:
                raise
            except AcquireTimeout:  # the other resident leases leave too little room now
                with contextlib.suppress(BackendUnavailable, PoolNotFound):
                    others = await self._read()
                    self._mode = (
                        f"the other workers' resident leases hold {format_size(others)}, "
                        f"so {format_size(amount)} cannot fit until one of them ends; "
                        f"trying every {interval:g}s without queueing"
                    )
                await asyncio.sleep(interval)
            except (BackendUnavailable, PoolNotFound) as e:
                log.warning(
                    "gpulock: resident lease of %s not acquired yet: %s", format_size(amount), e
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
        self._mode = ""
        self.leases.append(lease)
        self._history.record("grant", lease, route="resident")
        metrics().resident.inc(amount)
        self._changed()

        def lost(lz: AsyncLease) -> None:
            # Lost leases get no release record; this one ends the lease's interval in the
            # history (else a test's sweep counts it held for ever, next to its replacement).
            self._history.record("lost", lz, route="resident")
            log.warning(
                "gpulock: resident lease of %s lost; worker not ready until it is taken again",
                format_size(lz.amount),
            )
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            loop.call_soon(self._replace, lz, purpose, ttl)

        lease.on_lost(lost)
        return lease

    def _replace(self, lz: AsyncLease, purpose: str, ttl: float | None) -> None:
        if self._stopping() or lz not in self.leases:
            return
        self.leases.remove(lz)
        metrics().resident.dec(lz.amount)
        self._changed()
        self._spawn(self._acquire_once(lz.amount, purpose, ttl), "gpulock-resident")
