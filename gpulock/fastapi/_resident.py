"""Resident leases: the long-lived leases of what each worker keeps on the GPU (weights, CUDA
context), taken without ever blocking the pool's request traffic, taken again when lost, and
the room they leave for requests."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from .._async import AsyncLease
from .._replies import PoolStatus
from ..errors import AcquireTimeout, BackendUnavailable, CapacityExceeded, GpuLockError
from ..errors import PoolNotFound
from ..units import format_size, parse_size
from ._admission import TtlBound
from ._backend import Backend
from ._errors import HttpErrors
from ._history import History
from ._metrics import metrics
from ._settings import Settings

log = logging.getLogger("gpulock.fastapi")


def resident_held(st: PoolStatus) -> int:
    """Bytes held by resident leases (the workers' models) in a status that lists the leases."""
    return sum(
        lz.amount for lz in st.leases if str(lz.holder.get("purpose", "")).startswith("resident")
    )


class ResidentLeases:
    """This worker's resident leases.

    Args:
        settings: ``ttl`` and ``reaper_interval`` are read from it.
        backend: the pool; every read of the room also refreshes the status it keeps.
        ttl_bound: bounds a lease's ttl by the pool's ``max_ttl``.
        history: where grants and releases are recorded.
        errors: builds the 413 of :meth:`check_room`.
        spawn: runs a background task the limiter's ``stop()`` cancels.
        changed: called whenever what readiness reports may have changed.
        stopping: True once the limiter is shutting down (lost leases are not taken again).

    Attributes:
        leases: the resident leases held.
        wanted: bytes asked for, over all :meth:`acquire` calls.
        pool_bytes: bytes held by all workers' resident leases at the last full read (None
            before one).
    """

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        ttl_bound: TtlBound,
        history: History,
        errors: HttpErrors,
        spawn: Callable[[Coroutine[Any, Any, Any], str], Any],
        changed: Callable[[], None],
        stopping: Callable[[], bool],
    ):
        self._settings = settings
        self._backend = backend
        self._ttl_bound = ttl_bound
        self._history = history
        self._errors = errors
        self._spawn = spawn
        self._changed = changed
        self._stopping = stopping
        self.leases: list[AsyncLease] = []
        self.wanted = 0
        self.pool_bytes: int | None = None
        self._waiting = 0
        self._mode = ""

    def held(self) -> int:
        """Bytes of this worker's resident leases that are valid."""
        return sum(lz.amount for lz in self.leases if not lz.lost and not lz.released)

    def count(self) -> int:
        """This worker's resident leases."""
        return len(self.leases)

    def note(self, st: PoolStatus) -> None:
        """A status read that lists the leases: keep the pool's resident total."""
        self.pool_bytes = resident_held(st)

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

    async def room(self) -> tuple[int, int]:
        """``(capacity, bytes held by resident leases)`` read from Redis now."""
        assert self._backend.pool is not None
        st = await self._backend.pool.status(limit=100_000)
        self._backend.record(st)  # fresh: readiness quotes it
        self.note(st)
        assert self.pool_bytes is not None
        return st.capacity, self.pool_bytes

    async def check_room(self, amount: int) -> None:
        """413 at once for a request that fits the capacity but not the room the workers'
        resident leases (their models) leave: FIFO would otherwise keep it at the head of the
        queue for its whole timeout, stalling every request behind it, and then answer an
        unwinnable 503. The cached resident total (refreshed every ``10 × reaper_interval``) only
        picks the suspects; the refusal is decided on a fresh read.

        Raises: GpuLockHTTPException 413."""
        st = self._backend.status
        if st is None or not self.pool_bytes:
            return
        if amount > st.capacity or amount <= st.capacity - self.pool_bytes:
            return  # > capacity: the core raises CapacityExceeded (413) itself
        try:
            capacity, held = await self.room()
        except GpuLockError:
            return  # the acquire reports the backend's state
        if capacity - held < amount <= capacity:
            raise self._errors.room(amount, capacity, held)

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
        resident leases leave too little room, as for a 4th worker on a GPU that fits three) sit at the head of the
        queue and stall every request behind it. So: while ``capacity - resident bytes of
        others >= amount`` (it fits once the short request leases drain) we wait in the queue
        like anyone else; otherwise we only *try* (``timeout=0``: never queue, never jump the
        queue) once per reaper interval, and move into the queue as soon as room appears (a
        worker died and its lease was reaped). Re-checked every reaper interval."""
        pool = self._backend.pool
        assert pool is not None
        interval = self._settings.reaper_interval
        tenant = self._settings.tenant
        backoff = 0.5
        holder = {"purpose": f"resident:{purpose}"}
        self._mode = ""
        while True:
            try:
                capacity, others = await self.room()
                # the pool's max_ttl, as just read, bounds it
                ttl_s = self._ttl_bound(ttl or self._settings.ttl)
                if capacity - others < amount:
                    self._mode = (
                        f"the other workers' resident leases hold {format_size(others)}, "
                        f"so {format_size(amount)} cannot fit until one of them ends; "
                        f"trying every {interval:g}s without queueing"
                    )
                    try:
                        lease = await pool.acquire(
                            amount, ttl=ttl_s, timeout=0, holder=holder, tenant=tenant
                        )
                        break
                    except AcquireTimeout:
                        await asyncio.sleep(interval)
                        continue
                self._mode = "queued behind the requests ahead of it"
                acq = asyncio.ensure_future(
                    pool.acquire(amount, ttl=ttl_s, timeout=None, holder=holder, tenant=tenant)
                )
                try:
                    while True:
                        done, _ = await asyncio.wait({acq}, timeout=max(interval, 0.5))
                        if done:
                            break
                        capacity, others = await self.room()
                        if capacity - others < amount:  # another resident took the room
                            acq.cancel()  # stop blocking
                            with contextlib.suppress(BaseException):
                                await acq
                            break
                except BaseException:
                    acq.cancel()
                    raise
                if acq.done() and not acq.cancelled():
                    lease = acq.result()
                    break
            except CapacityExceeded:
                raise
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
