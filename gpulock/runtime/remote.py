"""Places kept for remote holders: :class:`RemoteHolders`, what a proxy (the HTTP broker) uses of
an :class:`gpulock.AsyncPool` on behalf of clients on other hosts.

Each call runs a flow of :mod:`gpulock.protocol.remote` or :mod:`gpulock.protocol.flow` through the
pool object's own driver (its script calls, retries, error translation); the places themselves
are kept by the pool object's runtime (:meth:`gpulock.runtime.runtime.Runtime.keep_place`). A
place queued by :meth:`RemoteHolders.enqueue` is kept until :meth:`RemoteHolders.wait` hands its
grant over or :meth:`RemoteHolders.cancel` withdraws it: the caller must do one of the two.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from gpulock.protocol import flow, remote
from gpulock.protocol.resize import resize, resize_args
from gpulock_common.options import check_priority

from gpulock.protocol.args import validate_lease_id, validate_token
from gpulock.protocol.replies import Grant, NotGranted, Renewal
from gpulock.protocol.request import AcquireOptions, AcquireRequest
from gpulock.protocol.steps import Flow, PoolView
from gpulock.runtime.runtime import Runtime

__all__ = ["DrivenPool", "RemoteHolders"]

_T = TypeVar("_T")


class DrivenPool(PoolView, Protocol):
    """What :class:`RemoteHolders` uses of its pool object (an :class:`gpulock.AsyncPool`): its
    settings, its runtime and its driver (``_run``: carry out a flow, return its result)."""

    waiter_ttl: float
    default_ttl: float

    @property
    def waiting(self) -> int: ...

    @property
    def _runtime(self) -> Runtime: ...

    def _run(self, steps: Flow[_T]) -> Awaitable[_T]: ...


_P = TypeVar("_P", bound=DrivenPool)


class RemoteHolders(Generic[_P]):
    """The requests and leases of holders on other hosts on ``pool`` (an
    :class:`gpulock.AsyncPool`, kept as :attr:`pool`): its grants are not heartbeated here (the remote holder renews
    through :meth:`renew`, or the lease expires after its ttl), and a queued request keeps its
    place across the holder's retries."""

    def __init__(self, pool: _P):
        self.pool = pool

    @property
    def waiting(self) -> int:
        """How many requests the pool object has queued and waits for now (its own acquires
        and remote holders' places alike)."""
        return self.pool.waiting

    async def enqueue(
        self,
        amount: int | str,
        options: AcquireOptions,
        *,
        queue: bool = True,
        retry_for: float | None = None,
    ) -> Grant | NotGranted:
        """Send one acquire for ``options.request_id`` on behalf of a remote holder, retried
        for ``retry_for`` seconds (default ``backend_timeout``) while Redis is unreachable
        (:func:`gpulock.protocol.remote.enqueue`).

        Args: ``amount`` as :meth:`gpulock.AsyncPool.acquire`; ``options``
            (:class:`gpulock_common.options.AcquireOptions`) its keywords: ``request_id`` the
            holder's key, ``timeout`` unused; ``queue=False`` never queues (``timeout=0``).

        Returns: a :class:`Grant` (server-clock milliseconds), or a :class:`NotGranted` with
            ``position``, ``queue_length`` and ``retry_after_ms`` (to the nearest lease expiry,
            -1 when none); when ``queued`` the place is kept here until :meth:`wait` returns
            its grant or :meth:`cancel` is called.

        Raises: InvalidArgument, CapacityExceeded, PoolNotFound, QueueFull, BackendUnavailable.
        """
        p = self.pool
        req = AcquireRequest.build(
            p.name, amount, options, waiter_ttl=p.waiter_ttl, default_ttl=p.default_ttl
        )
        deadline = None if retry_for is None else p.clock() + retry_for
        return await p._run(remote.enqueue(p, p._runtime, req, queue, deadline))

    async def wait(self, request_id: str, timeout: float) -> Grant | None:
        """Wait up to ``timeout`` seconds for the grant of a request queued by :meth:`enqueue`.
        Returns the grant (and stops keeping the place here), or None when the timeout passes
        or the request is not queued here; the place is kept.

        Raises: InvalidArgument, BackendUnavailable (re-queueing a request the server had
        dropped failed), PoolClosed."""
        return await self.pool._run(remote.wait_place(self.pool._runtime, request_id, timeout))

    async def cancel(self, request_id: str) -> int:
        """Withdraw a request: leave the queue, or release the grant made to it. Idempotent.
        Returns 0 (nothing to do), 1 (left the queue) or 2 (its grant was released).

        Raises: InvalidArgument, BackendUnavailable."""
        return await self.pool._run(flow.cancel(self.pool._runtime, request_id))

    async def renew(self, lease_id: str, token: int, ttl: float) -> Renewal:
        """Extend a remote holder's lease to ``ttl`` seconds from now (server clock). Never
        re-acquires. Returns a :class:`~gpulock.protocol.replies.Renewal`: ``(expires_ms,
        server_now_ms, yield_deadline_ms)``, the last the deadline by which the server takes
        the lease back when it asked its holder to yield it (preemption), else 0.

        Raises: LeaseLost (expired, released, unknown, or another token), InvalidArgument,
        BackendUnavailable."""
        return await self.pool._run(flow.renew(lease_id, token, ttl))

    async def resize(
        self,
        lease_id: str,
        amount: int | str,
        timeout: float | None,
        *,
        priority: int = 0,
        on_queued: Callable[[int], Any] | None = None,
    ) -> Grant:
        """Resize a remote holder's lease ``lease_id`` to ``amount`` (bytes or a size string),
        a growth waiting up to ``timeout`` seconds (None: forever; 0: never queued) while the
        lease keeps its bytes (docs/SEMANTICS.md, "Resizing a lease"). The lease id is the
        capability (no token); a growth queues at the lease's place (the lease's ``priority``,
        when the caller knows it, default 0, counts only where the server keeps no place), with
        the lease's tenant and on its device. A reply that
        answered at once renewed the lease to its ttl (a hand-off grant of a growth did not).
        ``on_queued(position)``: called when the growth queues (its 1-based place, a
        :class:`gpulock_common.queue.QueuePlace` with the estimated wait), and when a refresh
        finds its place changed.

        Returns: a :class:`Grant`: the lease as the server has it now (``amount``, ``token``,
        unchanged, ``expires_ms``, ``now_ms``: server-clock milliseconds).

        Raises: InvalidArgument (a bad amount, timeout or lease id; a resident lease),
        LeaseLost (expired, released or unknown), CapacityExceeded (QuotaExceeded,
        RoomExceeded: the new amount can never fit), ResizeRefused (waiting could only
        deadlock), QueueFull, AcquireTimeout (not granted within ``timeout``: the lease
        keeps its amount), PoolNotFound, BackendUnavailable, PoolClosed."""
        p = self.pool
        n, timeout_s = resize_args(amount, timeout)
        lid = validate_lease_id(lease_id)
        grant, _ = await p._run(
            resize(
                p,
                p._runtime,
                lid,
                None,
                n,
                timeout_s,
                p.clock(),
                priority=check_priority(priority),
                waiter_ttl_s=p.waiter_ttl,
                on_queued=on_queued,
            )
        )
        return grant

    async def release(
        self, lease_id: str, token: int, retry_for: float | None = None
    ) -> tuple[bool, int]:
        """Release a remote holder's lease, retried for ``retry_for`` s (default
        ``backend_timeout``). Returns ``(released, server_now_ms)``; False: the server no
        longer had it (lost), and nothing of others was freed. A retry after a connection
        error counts as released, as in :meth:`gpulock.AsyncLease.release`.

        Raises: InvalidArgument, BackendUnavailable."""
        token = validate_token(token)
        return await self.pool._run(flow.release(self.pool.name, lease_id, token, retry_for))
