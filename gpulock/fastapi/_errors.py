"""HTTP error mapping: the exception the integration raises, and the answer to each way a
guarded call can fail (status, ``detail``, ``Retry-After`` and ``X-Queue-Position``). The
status and reason of each of gpulock's errors are the error table's
(:mod:`gpulock_common.wire`); the messages and headers are the integration's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from fastapi import HTTPException
from gpulock_common.grace import grace_note
from gpulock_common.wire import answer_for, served

from gpulock.errors import (
    AcquireTimeout,
    BackendUnavailable,
    CapacityExceeded,
    InvalidArgument,
    LeaseLost,
    PoolNotFound,
    QueueFull,
    QuotaExceeded,
    RoomExceeded,
)
from gpulock.units import format_size
from ._metrics import metrics
from ._settings import Settings

if TYPE_CHECKING:
    from ._retry_after import RetryAnswer


class GpuLockHTTPException(HTTPException):
    """An HTTPException raised by the integration; ``reason`` is a short machine-readable
    cause (``queue_timeout``, ``queue_full``, ``capacity``, ``inference_timeout``,
    ``cuda_oom``, ``cuda_error``, ``lease_lost``, ``backend``, ``not_ready``, ``conflict``,
    ``invalid_argument``, ``invalid_priority``, ``invalid_request_id``; ``preempted`` ends a
    preemptible route's stream whose lease the pool asked back).
    ``estimated_wait_s``: a 503's wait estimate in seconds (the one its Retry-After came from;
    docs/SERVICE.md, "Retry-After"), None for none; the error handlers put it in the body
    (:func:`gpulock.http.guards.install_error_handlers`: ``{"detail": ...,
    "estimated_wait_s": ...}``; the service's OpenAI-shaped body: in its ``error``)."""

    def __init__(
        self,
        status_code: int,
        detail: str,
        reason: str,
        headers: dict[str, str] | None = None,
        *,
        estimated_wait_s: float | None = None,
    ):
        super().__init__(status_code=status_code, detail=detail, headers=headers)
        self.reason = reason
        self.estimated_wait_s = None if estimated_wait_s is None else round(estimated_wait_s, 3)

    @classmethod
    def of(
        cls,
        error: BaseException | type[BaseException],
        detail: str,
        headers: dict[str, str] | None = None,
        *,
        estimated_wait_s: float | None = None,
    ) -> GpuLockHTTPException:
        """The answer to a shared gpulock error (an exception or its class): the status and
        reason the error table gives a lease taken on the client's behalf
        (:func:`gpulock_common.wire.served`), with ``detail``, ``headers`` and the 503's
        ``estimated_wait_s``."""
        status, reason = served(error)
        return cls(status, detail, reason, headers, estimated_wait_s=estimated_wait_s)


class CudaOOM(Exception):
    """Replaces a CUDA OOM (whose traceback pinned tensors) once it left the thread."""


class CudaFatal(Exception):
    """Replaces a sticky CUDA error once it left the thread."""


def bytes_asked(amount: int, batch: int | None = None) -> str:
    """A request's bytes as its 503 names them: ``amount`` (its own estimate); with
    ``batch``, the bytes of the batch it waited in, when they differ, labelled as such:
    ``"2.0MiB (this request's own; the batch it waited in needs 1.4GiB in all)"``."""
    if batch is None or batch == amount:
        return format_size(amount)
    return (
        f"{format_size(amount)} (this request's own; the batch it waited in needs "
        f"{format_size(batch)} in all)"
    )


def not_ready(why: str) -> GpuLockHTTPException:
    """503 ``not_ready`` with ``Retry-After: 1``: this worker takes no guarded calls now."""
    return GpuLockHTTPException(503, f"worker not ready: {why}", "not_ready", {"Retry-After": "1"})


class HttpErrors:
    """The answers of one limiter's failed calls.

    Args:
        settings: the limiter's settings (pool name, idempotency header, reaper interval).
        answer: ``answer(position, server_hint=None, *, tail=False, amount=0) ->``
            :class:`~gpulock.fastapi._retry_after.RetryAnswer`, the limiter's Retry-After and
            wait estimate for a request at ``position`` in the pool's queue
            (``RetryAfterEstimator.answer``).
    """

    def __init__(
        self,
        settings: Settings,
        answer: Callable[..., RetryAnswer],
        on_event: Callable[[str], None] = lambda event: None,
    ):
        self._settings = settings
        self._answer = answer
        # the pool's counters in Redis (gpulock.admin.samples), shown by the dashboard
        self._on_event = on_event

    def count(self, e: GpuLockHTTPException, route: str) -> None:
        """Count a guarded route's error answer, the one place that does: in
        ``gpulock_requests_total`` (``route``, status) and in the pool's counters the dashboard
        shows (every 503 as ``rejected``, a CUDA OOM, a 503 too, also as ``oom``), so that
        ``/metrics`` and the dashboard count the same answers."""
        metrics().requests.labels(route, str(e.status_code)).inc()
        if e.status_code == 503:
            self._on_event("rejected")
        if e.reason == "cuda_oom":
            self._on_event("oom")

    def conflict(self, request_id: str) -> GpuLockHTTPException:
        """409: the idempotency key was used for a request with other parameters."""
        return GpuLockHTTPException(
            409,
            f"{self._settings.request_id_header} {request_id!r} was already used for a "
            f"different request; use a new id for new work",
            "conflict",
        )

    def client_gone(self, route: str, phase: str) -> GpuLockHTTPException:
        """499 for a client that closed its connection while its request was at ``phase``
        (``waiting`` or ``running``); counted in ``gpulock_client_disconnected_total`` (whose
        third phase, ``streaming``, :mod:`gpulock.fastapi._stream` counts)."""
        metrics().disconnected.labels(route, phase).inc()
        what = (
            "it left the queue and will not run"
            if phase == "waiting"
            else "its work goes on until it returns (the lease is held until then); the result is dropped"
        )
        return GpuLockHTTPException(
            499, f"the client closed the connection: {what}", "client_disconnected"
        )

    def too_large(self, exc: CapacityExceeded) -> NoReturn:
        """413 for a request the pool can never grant: more than its capacity, than the room
        its resident leases leave (:class:`RoomExceeded`), or than the tenant's quota (less
        its resident leases: :class:`QuotaExceeded`)."""
        pool_name = self._settings.pool_name
        need = (
            f"this request needs {format_size(exc.amount)} ({exc.amount} bytes) of GPU memory but"
        )
        if isinstance(exc, QuotaExceeded):
            left = (
                f", less {format_size(exc.resident)} ({exc.resident} bytes) of its workers' "
                f"resident leases (their models)"
                if exc.resident
                else ""
            )
            raise GpuLockHTTPException.of(
                exc,
                f"{need} this service's tenant {exc.tenant!r} has a quota of {format_size(exc.quota)} "
                f"({exc.quota} bytes) on pool {pool_name!r}{left}; send a smaller batch",
            ) from None
        if isinstance(exc, RoomExceeded):
            room = max(0, exc.room)
            raise GpuLockHTTPException.of(
                exc,
                f"{need} pool {pool_name!r} leaves {format_size(room)} ({room} bytes) for requests: "
                f"a capacity of {format_size(exc.capacity)} ({exc.capacity} bytes) minus "
                f"{format_size(exc.resident)} held or being taken by the workers' resident leases "
                f"(their models); send a smaller batch",
            ) from None
        raise GpuLockHTTPException.of(
            exc,
            f"{need} pool {pool_name!r} has a capacity of {format_size(exc.capacity)} "
            f"({exc.capacity} bytes); send a smaller batch",
        ) from None

    def outcome(
        self,
        out: asyncio.Future[Any],
        route: str,
        amount: int,
        position: Callable[[], int],
        batch: int | None = None,
    ) -> object:
        """The result of a finished job's ``out``, or raise its error as HTTP. gpulock's errors
        get the status and reason of the error table (:func:`gpulock_common.wire.served`):
        :class:`CapacityExceeded` (and its :class:`QuotaExceeded` and :class:`RoomExceeded`) →
        413; :class:`QueueFull` and :class:`AcquireTimeout` → 503 with ``Retry-After`` and
        ``X-Queue-Position``; :class:`LeaseLost` → 503; Redis unreachable or the pool gone →
        503 with ``Retry-After`` of two reaper intervals; :class:`InvalidArgument` → 500
        naming it. The integration's own: cancelled → 503 ``not_ready``; a CUDA OOM → 503
        with ``Retry-After``; a sticky CUDA error → 500. Anything else is re-raised.
        ``position()`` is the job's place in the queue, when the error does not carry it.
        ``amount``: the request's own bytes; ``batch``: its batch's, when it ran in one
        (:func:`bytes_asked`)."""
        assert out.done()
        if out.cancelled():
            raise GpuLockHTTPException(
                503,
                "the request was cancelled (worker shutting down)",
                "not_ready",
                {"Retry-After": "1"},
            )
        exc = out.exception()
        if exc is None:
            return out.result()
        m = metrics()
        pool_name = self._settings.pool_name
        if isinstance(exc, CapacityExceeded):
            self.too_large(exc)
        if isinstance(exc, QueueFull):
            m.queue_full.labels(route).inc()
            a = self._answer(exc.queue_length + 1, amount=amount, tail=True)
            raise GpuLockHTTPException.of(
                exc,
                f"GPU queue is full ({exc.queue_length} waiting)",
                {"Retry-After": str(a.retry_after), "X-Queue-Position": str(exc.queue_length + 1)},
                estimated_wait_s=a.estimated_wait,
            ) from None
        if isinstance(exc, AcquireTimeout):
            m.timeouts.labels(route).inc()
            pos = exc.position or position()
            a = self._answer(pos, exc.retry_after, amount=amount)
            raise GpuLockHTTPException.of(
                exc,
                f"no GPU memory granted in time (queue position {pos}): "
                f"{grace_note(pool_name, exc.grace_left)}"
                if exc.grace_left > 0
                else f"no GPU memory for {bytes_asked(amount, batch)} in time (queue position {pos})",
                {"Retry-After": str(a.retry_after), "X-Queue-Position": str(pos)},
                estimated_wait_s=a.estimated_wait,
            ) from None
        if isinstance(exc, LeaseLost):
            raise GpuLockHTTPException.of(
                exc,
                f"the GPU lease was lost before the work ran ({exc.reason}); retry",
                {"Retry-After": str(self._answer(1).retry_after)},
            ) from None
        if isinstance(exc, CudaOOM):
            a = self._answer(position())
            raise GpuLockHTTPException(
                503,
                "the GPU ran out of memory for this request; retry later",
                "cuda_oom",
                {"Retry-After": str(a.retry_after)},
                estimated_wait_s=a.estimated_wait,
            ) from None
        if isinstance(exc, CudaFatal):
            raise GpuLockHTTPException(
                500, f"CUDA error; this worker restarts: {exc}", "cuda_error"
            ) from None
        if isinstance(exc, (BackendUnavailable, PoolNotFound)):
            raise GpuLockHTTPException.of(
                exc,
                f"GPU budget unavailable: {exc}",
                {"Retry-After": str(max(1, int(self._settings.reaper_interval * 2)))},
            ) from None
        if isinstance(exc, InvalidArgument):  # never a bare 500: say what the pool refused
            raise GpuLockHTTPException.of(
                exc, f"pool {pool_name!r} refused the lease request: {exc}"
            ) from None
        if answer_for(exc) is not None:  # another of gpulock's errors: the table's answer too
            later = {"Retry-After": str(max(1, int(self._settings.reaper_interval * 2)))}
            raise GpuLockHTTPException.of(
                exc, f"pool {pool_name!r}: {exc}", later if served(exc)[0] == 503 else None
            ) from None
        raise exc
