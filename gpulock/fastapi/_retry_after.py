"""The service's Retry-After estimator: a request's wait estimate (the server's, from the
pool's drain rate and the bytes ahead; else the rates this worker measures: the pool's grants
and its own, while busy, the mean hold time) and its place, fed to the policy in
:mod:`gpulock.retry_after`.

The policy, in the words of a request: ``ceil(pool_wait + local_position / local_grant_rate)``
(``pool_wait`` the server's estimate; while the server has no drain rate, ``position /
grant_rate``), at least the grace period left, at most ``max_retry_after`` (at most
``park_timeout / 2`` for a request that keeps its place). The 503 carries the same estimate as
``estimated_wait_s`` (:class:`RetryAnswer`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

from gpulock_common.aio import wait_for

from gpulock import retry_after as policy
from gpulock.protocol.replies import PoolStatus
from ._admission import Slots
from ._backend import Backend
from ._job import Job
from ._settings import Settings


class RetryAnswer(NamedTuple):
    """What a 503 says of when to come back: ``retry_after`` (whole seconds, the header) and
    ``estimated_wait`` (seconds, the estimate it came from; None when nothing was measured and
    the answer is the policy's guess per place)."""

    retry_after: int
    estimated_wait: float | None


class RetryAfterEstimator:
    """Retry-After (whole seconds) for a request at a place in the queue.

    Args:
        settings: ``max_retry_after`` and ``park_timeout`` are read from it.
        backend: the pool's last status (queue length, leases, grace period).
        slots: this worker's thread slots (the local queue).
        resident_count: how many of the pool's leases are this worker's resident ones.

    Attributes:
        pool_rate: the pool's grants/s while waiters are queued.
        local_rate: this worker's grants/s while all its threads are taken.
        local_grants: grants to this worker's requests (the counter behind ``local_rate``).
        hold_ewma: moving average of a request's hold time (seconds), None before one.
    """

    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        slots: Slots,
        resident_count: Callable[[], int],
    ):
        self._settings = settings
        self._backend = backend
        self._slots = slots
        self._resident_count = resident_count
        self.pool_rate = policy.BusyRate()
        self.local_rate = policy.BusyRate()
        self.local_grants = 0
        self.hold_ewma: float | None = None

    # ---- measurements ------------------------------------------------------------------------
    def sample(self, now: float, st: PoolStatus) -> None:
        """One status read at ``now`` (monotonic seconds): feed both rates."""
        self.pool_rate.sample(now, st.grants, busy=st.waiter_count > 0)
        self.local_rate.sample(now, self.local_grants, busy=bool(self._slots.waiters))

    def granted(self) -> None:
        """A lease was granted to one of this worker's requests."""
        self.local_grants += 1

    def held(self, hold: float) -> None:
        """A request's lease was held ``hold`` seconds (weight 0.2 in the moving average)."""
        self.hold_ewma = hold if self.hold_ewma is None else 0.8 * self.hold_ewma + 0.2 * hold

    # ---- the estimate ------------------------------------------------------------------------
    def grant_rate(self) -> float | None:
        """Grants per second of the pool while busy, or the Little's-law fallback
        ``leases / mean_hold`` (see :func:`gpulock.retry_after.grant_rate`); None when
        nothing was measured yet."""
        st = self._backend.status
        return policy.grant_rate(
            self.pool_rate.rate,
            leases=st.lease_count if st is not None else 0,
            resident=self._resident_count(),
            mean_hold=self.hold_ewma,
        )

    def pool_wait(self, position: int, amount: int = 0, *, tail: bool = False) -> float | None:
        """The server's estimate of the seconds until a request at ``position`` (1-based) of
        the pool's queue is granted, read off the last status (docs/SEMANTICS.md, "Wait
        estimate"): the estimate of the waiter listed at that place; or, for a place not
        listed or with ``tail``, the estimate of a request of ``amount`` bytes joining the
        queue's tail behind ``position - 1`` waiters (:meth:`PoolStatus.estimated_wait_for`,
        the listed waiters' mean amount standing in for those not listed). None while the
        server has no measured drain rate (or no status was read)."""
        st = self._backend.status
        if st is None or st.drain is None:
            return None
        p = max(1, int(position))
        if not tail and p <= len(st.waiters):
            return st.waiters[p - 1].estimated_wait
        ahead = replace(st, waiters=st.waiters[: p - 1], waiter_count=p - 1)
        return ahead.estimated_wait_for(amount)

    def answer(
        self,
        position: int,
        server_hint: float | None = None,
        *,
        local: int = 0,
        parked: bool = False,
        pool_wait: float | None = None,
        amount: int = 0,
        tail: bool = False,
    ) -> RetryAnswer:
        """The 503's answer for a request at ``position`` (1-based) in the pool's queue, and,
        still waiting for one of this worker's threads, at ``local`` among this worker's
        waiters. The estimate (:func:`gpulock.retry_after.queue_seconds`): the pool's part is
        ``pool_wait`` (the request's own server estimate) when given, else
        :meth:`pool_wait` (``amount``, ``tail``); while the server has no drain rate,
        ``position / grant_rate``; plus ``local / local_grant_rate``. Without any rate: one
        second per place, or ``server_hint`` (the core's time to the nearest lease expiry) when
        shorter (then ``estimated_wait`` is None). Retry-After is that estimate through the
        policy (:func:`gpulock.retry_after.retry_after`): ``parked``, the request keeps its
        place for ``park_timeout`` seconds, so at most ``park_timeout / 2``; in a grace period
        after Redis lost the pool (nothing is granted before it ends) at least the time left
        in it, also for a parked request (whose place lasts past the grace); always in [1,
        max_retry_after]."""
        if pool_wait is None:
            pool_wait = self.pool_wait(position, amount, tail=tail)
        rate = self.grant_rate()
        st = self._backend.status
        if pool_wait is not None and st is not None and st.drain is not None:
            rate = rate or st.drain.grants_per_s  # the local part's rate, without its own
        secs = policy.queue_seconds(
            position,
            rate,
            local=local,
            local_rate=self.local_rate.rate,
            server_hint=server_hint,
            pool_wait=pool_wait,
        )
        measured = pool_wait is not None or bool(rate)
        ra = policy.retry_after(
            secs,
            cap=self._settings.max_retry_after,
            grace_left=self._backend.grace_left(),
            keep_place=self._settings.park_timeout if parked else None,
        )
        return RetryAnswer(ra, secs if measured else None)

    def retry_after(
        self,
        position: int,
        server_hint: float | None = None,
        *,
        local: int = 0,
        parked: bool = False,
    ) -> int:
        """Seconds a client should wait before retrying a request at ``position``: the
        ``retry_after`` of :meth:`answer`."""
        return self.answer(position, server_hint, local=local, parked=parked).retry_after

    def parked(
        self,
        position: int,
        local: int,
        server_hint: float | None = None,
        *,
        pool_wait: float | None = None,
        amount: int = 0,
    ) -> RetryAnswer:
        """The answer for a request that keeps its place (X-Request-ID), on whichever worker
        answers: ``position`` counts the pool's queue and, while the request still waits for
        one of its owner's threads, its ``local`` place among that worker's waiters (then the
        pool's part is the tail estimate: it is not in the pool's queue yet). ``pool_wait``:
        its own server estimate, when known."""
        if local:
            p = max(0, position - local)
            return self.answer(p, server_hint, local=local, parked=True, amount=amount, tail=True)
        return self.answer(position, server_hint, parked=True, pool_wait=pool_wait, amount=amount)

    def for_job(self, job: Job, position: int, pool_queue: int | None) -> RetryAnswer:
        """The answer for a job whose wait ran out. A parked job keeps its place: the time for
        its own ``position`` to come up (its last server estimate, while in the pool's queue).
        Any other job leaves the queue, and its retry joins at the back, behind everything
        queued now (in the pool, and for this worker's threads): the time for that whole queue
        to drain (the server's estimate at the queue's tail). (Quoting its old place told a
        burst of requests that each timed out at the head "retry in 1 s", inviting a retry
        storm.)"""
        if job.ticket is not None and self._settings.park_timeout > 0:
            local = max(1, self._slots.position(job.slot_future)) if job.phase == "slot" else 0
            own = job.estimated_wait if job.phase == "queued" else None
            return self.parked(
                position, local, job.server_retry_after, pool_wait=own, amount=job.amount
            )
        if pool_queue is None:
            pool_queue = self._backend.queued()
        if job.phase != "slot":
            pool_queue = max(pool_queue, position)
        return self.answer(
            pool_queue,
            job.server_retry_after,
            local=len(self._slots.waiters),
            amount=job.amount,
            tail=True,
        )

    # ---- a job's place ---------------------------------------------------------------------
    def job_position(self, job: Job, queued: int | None = None) -> int:
        """The job's place: in the pool's queue when it is there, else (still waiting for a
        local thread) the pool's queue length (``queued``, default as last read) plus its
        place among the local waiters."""
        if job.phase == "queued" and job.position:
            return job.position
        if queued is None:
            queued = self._backend.queued()
        return queued + max(1, self._slots.position(job.slot_future))

    async def position_now(self, job: Job) -> tuple[int, int | None]:
        """``(the job's place now, the pool queue's length now or None)``: one ZCARD, not the
        last reaper tick's length (the Retry-After of a request that leaves the queue needs it)."""
        try:
            queued = int(
                await wait_for(self._backend.command("ZCARD", self._backend.queue_key), 0.5)
            )
        except Exception:
            queued = None
        if job.phase == "queued" and job.position:
            return job.position, queued
        return self.job_position(job, queued), queued
