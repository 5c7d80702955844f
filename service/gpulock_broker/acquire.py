"""One acquire request: grant now, or long-poll up to ``wait`` seconds, or answer with the
place kept for a retry (see the protocol in :mod:`gpulock_broker.core`)."""

from __future__ import annotations

import asyncio
from typing import Callable

from gpulock.http import access_log as access
from gpulock_common.grace import grace_outlasts
from gpulock_common.options import DEFAULT_TTL_S, AcquireOptions
from gpulock.protocol.args import new_id
from gpulock.protocol.replies import Grant, NotGranted
from gpulock.errors import (
    AcquireTimeout,
    BackendUnavailable,
    InvalidArgument,
    PoolClosed,
    PoolNotFound,
    QueueFull,
)
from gpulock.retry_after import estimate_or_hint, retry_after

from .auth import Principal
from .leases import Leases
from .outcomes import ClientGone, Granted, Queued, Refused, Waited
from .parking import Parking, ticket
from .pools import Pools
from .tasks import Tasks

__all__ = ["LONG_POLL_S", "Acquirer", "queue_full", "refused", "retry_after_of"]

#: A request the broker held at least this long (a long poll, seconds) is answered
#: Retry-After: 0.
LONG_POLL_S = 1.0


def retry_after_of(
    estimate: float | None,
    hint: float | None,
    *,
    cap: float,
    grace_left: float,
    held: float,
    keep_place: float | None,
) -> int:
    """The Retry-After (whole seconds) of the broker's 503 for an acquire or a growth that
    was not granted: a request that keeps its place (``keep_place``: the most seconds it is
    kept after one answer, ``park_max``; None: not queued, no place) and was held at least
    :data:`LONG_POLL_S` (``held``, seconds) outside a grace period gets 0: its wait paced it
    already, and a grant may land any moment, so it comes back now to go on waiting. Any
    other: the policy (:func:`gpulock.retry_after.retry_after`) applied to the server's wait
    estimate ``estimate`` (seconds; None while the pool's drain rate is not measured: the
    server's ``hint``, :func:`gpulock.retry_after.estimate_or_hint`): at least ``grace_left``
    (nothing is granted before the grace period ends), at most ``keep_place / 2`` (or the
    grace left), in [1, ``cap``]."""
    if keep_place is not None and grace_left <= 0 and held >= LONG_POLL_S:
        return 0
    secs = estimate_or_hint(estimate, hint)
    return retry_after(secs, cap=cap, grace_left=grace_left, keep_place=keep_place)


#: Leases and waiters listed by the status read behind a queue-full refusal's Retry-After (its
#: tail estimate counts the waiters not listed at the listed ones' mean amount).
REFUSAL_STATUS_LIMIT = 32
#: How old (seconds) the status read behind a queue-full refusal's Retry-After may be: the
#: refusals of one pool within this share one read, so an overload's storm of refusals does
#: not add a read per refusal.
REFUSAL_STATUS_MAX_AGE = 1.0


def refused(
    error: QueueFull | AcquireTimeout,
    estimate: float | None,
    hint: float | None,
    *,
    cap: float,
    grace_left: float,
) -> Refused:
    """``error`` with the Retry-After of a request that keeps no place (it left the queue, or
    never joined it): :func:`retry_after_of` of the server's wait estimate ``estimate`` (else
    its ``hint``; seconds) and ``grace_left`` (seconds), in [1, ``cap``]."""
    ra = retry_after_of(estimate, hint, cap=cap, grace_left=grace_left, held=0.0, keep_place=None)
    return Refused(error, ra, estimate)


async def queue_full(
    pools: Pools, pool: str, error: QueueFull, amount: int, *, cap: float
) -> Refused:
    """A full queue's refusal of a request of ``amount`` bytes on ``pool``: the script refuses
    without an estimate, so the pool's status gives the estimate of a request joining the
    queue's tail (:meth:`PoolStatus.estimated_wait_for`), the scripts' hint
    (:meth:`PoolStatus.retry_hint`) and the grace period left; the status is read at most
    :data:`REFUSAL_STATUS_MAX_AGE` ago (one read serves a storm of refusals), bounded by
    ``backend_timeout``; a read that fails leaves them unknown (Retry-After 1)."""
    try:
        st = await pools.recent_status(
            pool, limit=REFUSAL_STATUS_LIMIT, max_age=REFUSAL_STATUS_MAX_AGE
        )
    except Exception:  # noqa: BLE001 - the refusal stands; only its Retry-After is a guess
        return refused(error, None, None, cap=cap, grace_left=0.0)
    return refused(
        error,
        st.estimated_wait_for(amount),
        st.retry_hint(),
        cap=cap,
        grace_left=st.grace_left,
    )


class Acquirer:
    """Runs acquire requests on the broker's parts.

    Args:
        pools, parking, leases, tasks: the broker's parts.
        max_wait: the longest a request is held while queued, seconds.
        retry_after_max: the largest Retry-After sent, seconds.
        clock: the local clock, seconds.
    """

    def __init__(
        self,
        pools: Pools,
        parking: Parking,
        leases: Leases,
        tasks: Tasks,
        *,
        max_wait: float,
        retry_after_max: int,
        clock: Callable[[], float],
    ):
        self._pools, self._parking, self._leases, self._tasks = pools, parking, leases, tasks
        self.max_wait = max_wait
        self.retry_after_max = retry_after_max
        self._clock = clock

    async def acquire(
        self,
        who: Principal,
        pool: str,
        amount: int,
        options: AcquireOptions,
        *,
        wait: float,
        queue: bool = True,
        gone: asyncio.Future | None = None,
    ) -> Granted | Queued:
        """See :meth:`gpulock_broker.core.Broker.acquire`."""
        rid = options.request_id or new_id()
        tk = ticket(who, rid)
        p = self._pools.get(pool)
        ttl = DEFAULT_TTL_S if options.ttl is None else options.ttl
        meta = {**(options.holder or {}), "owner": who.id, "principal": who.name, "via": "broker"}
        # on the holder's behalf: its ticket, its owner, its token's tenant
        opts = options._replace(
            ttl=ttl, timeout=None, holder=meta, request_id=tk, tenant=who.tenant or None
        )
        key = (pool, tk)
        entry = self._parking.attach(key)
        final = False  # granted, or nothing was queued: no place to keep

        # A long poll's time is the request's: while Redis (the pool's shard) is unreachable,
        # the enqueue is retried for as long as the request would have been held anyway.
        poll = min(wait, self.max_wait) if queue else 0.0
        budget = max(self._tasks.backend_timeout, poll)

        def enqueue(retry_for: float | None = None):
            return p.enqueue(amount, opts, queue=queue, retry_for=retry_for)

        start = self._clock()
        access.note(lease_bytes=amount)
        try:
            res: Grant | NotGranted = await self._tasks.guard(
                enqueue(budget), entry.inflight, budget
            )
            # the place it took, for its 201 should it be granted later in this request
            place = (
                Waited(res.position, res.queue_length, res.estimated_wait)
                if isinstance(res, NotGranted) and res.queued
                else None
            )
            if (
                isinstance(res, NotGranted)
                and res.queued
                and wait > 0
                and not grace_outlasts(res.grace_left_ms / 1000, poll - (self._clock() - start))
            ):  # (a long poll that ends before the grace period: answered now, place kept)
                left = max(0.0, poll - (self._clock() - start))
                wt = asyncio.ensure_future(p.wait(tk, left))
                if gone is not None and not (gone.done() and not _true(gone)):
                    await asyncio.wait((wt, gone), return_when=asyncio.FIRST_COMPLETED)
                if _true(gone):
                    wt.cancel()
                    final = True  # nothing to keep: nobody will come back for this answer
                    if entry.attached == 1:  # no retry of it is waiting here
                        await self._tasks.guard(
                            p.cancel(tk), entry.inflight
                        )  # leaves, or releases the raced grant
                    raise ClientGone(rid)
                g = await wt
                # No grant: ask again (idempotent) for the fresh position and retry-after.
                res = g if g is not None else await self._tasks.guard(enqueue(), entry.inflight)
            if isinstance(res, Grant):
                final = True
                access.note(queue_wait_s=self._clock() - start)
                acquired_ms = entry.granted_ms or res.expires_ms - round(ttl * 1000)
                entry.granted_ms = 0
                # a grant that waited for its client (parked): give the client a full ttl
                res = await self._leases.full_ttl(pool, res, ttl)
                self._parking.discard(key)
                self._leases.record(who.id, pool, tk, ttl, res, opts.priority)
                return Granted(pool, rid, res, ttl, acquired_ms, place)
            if not res.queued:
                final = True  # queue=False and busy: no place was taken
            grace = res.grace_left_ms / 1000
            ra = retry_after_of(
                res.estimated_wait,
                res.retry_after_ms / 1000,
                cap=self.retry_after_max,
                grace_left=grace,
                held=self._clock() - start,
                keep_place=self._parking.places.cap if res.queued else None,
            )
            # a place told to wait out a grace period is kept past its end
            hold = self._parking.places.hold_for(ra, extra=grace)
            self._parking.keep(key, entry, hold)
            return Queued(
                rid, res.queued, res.position, res.queue_length, ra, hold, grace, res.estimated_wait
            )
        except QueueFull as e:
            raise await queue_full(self._pools, pool, e, amount, cap=self.retry_after_max) from e
        except PoolNotFound:
            final = True
            self._tasks.spawn(self._pools.drop_if_idle(pool))
            raise
        except InvalidArgument as e:
            if tk in str(e):  # a reused request id: name it as the client sent it
                raise InvalidArgument(str(e).replace(tk, rid)) from None
            raise
        except PoolClosed:
            final = True
            if self._pools.was_retired(p):  # the pool was deleted while this request waited
                raise PoolNotFound(pool) from None
            raise BackendUnavailable("the lease broker is shutting down") from None
        finally:
            self._parking.detach(key, entry, final=final, pool=p, ttl=ttl)


def _true(f: asyncio.Future | None) -> bool:
    return (
        f is not None
        and f.done()
        and not f.cancelled()
        and f.exception() is None
        and bool(f.result())
    )
