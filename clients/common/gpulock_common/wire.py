"""The one error table: how each shared error (:mod:`gpulock_common.errors`) is answered over
HTTP, and how an answer is read back into its class. No I/O.

Each row of :data:`ANSWERS` declares one HTTP answer of one class, once: its ``status``, its
``code`` (the ``error`` of the lease API's body ``{"detail": {"error": code, "message": text,
**fields}}``), the exception's attributes the body carries (``fields``, in that order), the
other replies that read back as the class whatever their code (``reads``), and how the class is
made again from a body (``build``). A class's first row is its answer; a second row is another
answer of the same meaning to the caller (403 is an :class:`AuthError` as 401 is; 404
``not_found``, a lease of another token, is a :class:`LeaseLost` to its caller).

Every surface derives its mapping from it:

* error → HTTP: the broker (``gpulock_broker.api``) answers :func:`answer_for` (status, code,
  fields); the FastAPI integration (``gpulock.fastapi``) answers :func:`served` (status and
  reason), because it took the lease on its own client's behalf (below);
* HTTP → error: the SDK (``gpulock_client``) and the CLI through a broker (``gpulock
  --broker-url``) read a reply with :func:`error_from_reply`.

A server that takes a lease on its client's behalf (the FastAPI integration: its client asked
for an embedding, not for a lease) answers the same error, with the same meaning, with its own
status where the lease API's status blames the caller for what the server did
(:data:`SERVED_STATUS`): its pool not there (404), its lease lapsed (410), its credentials
refused (401, 403) are the server's trouble, which passes, so 503 with ``Retry-After``; a lease
request it built that the pool refused (422) is its own bug, so 500. The request's size (413)
and overload (503) are the client's to know as they are. Its ``reason`` is the row's ``code``
unless the row names another: the reasons the service published before this table
(``capacity``, ``quota``, ``backend``) are kept, as its users match them (docs/SERVICE.md).

:class:`PoolClosed` has no row: a pool object raises it in its own process and it never
crosses HTTP. A reply that no row reads is a plain :class:`GpuLockError` ("unexpected HTTP").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

from .errors import (
    AcquireTimeout,
    AuthError,
    BackendUnavailable,
    CapacityExceeded,
    GpuLockError,
    InvalidArgument,
    LeaseLost,
    PoolNotFound,
    QueueFull,
    QuotaExceeded,
    ResizeRefused,
    RoomExceeded,
)
from .validation import describe

__all__ = [
    "ANSWERS",
    "SERVED_STATUS",
    "Answer",
    "answer_for",
    "error_from_reply",
    "reply_message",
    "served",
]

#: ``build(fields, message, pool)``: the exception again, from a body's ``detail`` (its fields),
#: its message, and the pool the request named (None: none, or not known).
Build = Callable[[Mapping[str, Any], str, Optional[str]], GpuLockError]


@dataclass(frozen=True)
class Answer:
    """One HTTP answer of one shared error class (see the module docstring)."""

    cls: type[GpuLockError]
    status: int
    code: str
    build: Build
    fields: tuple[str, ...] = ()
    reads: tuple[int, ...] = ()  # statuses read back as ``cls`` whatever their code
    reason: Optional[str] = None  # the FastAPI integration's reason, where not ``code``

    def body(self, e: GpuLockError) -> dict[str, Any]:
        """The body fields of ``e`` (an instance of ``cls``), in the order of ``fields``."""
        return {f: getattr(e, f) for f in self.fields}


def _int(d: Mapping[str, Any], key: str) -> int:
    return int(d.get(key) or 0)


def _opt_int(d: Mapping[str, Any], key: str) -> Optional[int]:
    v = d.get(key)
    return None if v is None else int(v)


def _opt_float(d: Mapping[str, Any], key: str) -> Optional[float]:
    v = d.get(key)
    return None if v is None else float(v)


def _where(pool: Optional[str]) -> str:
    return f"pool {pool!r}: " if pool else ""


ANSWERS: tuple[Answer, ...] = (
    Answer(
        InvalidArgument,
        422,
        "invalid_argument",
        lambda d, m, p: InvalidArgument(m),
        reads=(400, 422),  # 422: FastAPI's list of errors; 400: the HTTP guards' (bad JSON)
    ),
    Answer(AuthError, 401, "unauthorized", lambda d, m, p: AuthError(m), reads=(401,)),
    Answer(AuthError, 403, "forbidden", lambda d, m, p: AuthError(m), reads=(403,)),
    Answer(
        PoolNotFound,
        404,
        "pool_not_found",
        lambda d, m, p: PoolNotFound(p or "?", m),
        reason="backend",
    ),
    Answer(
        QuotaExceeded,
        413,
        "quota_exceeded",
        lambda d, m, p: QuotaExceeded(
            _int(d, "amount"), _int(d, "quota"), str(d.get("tenant") or ""), m, _int(d, "resident")
        ),
        fields=("amount", "quota", "tenant", "resident"),
        reason="quota",
    ),
    Answer(
        RoomExceeded,
        413,
        "room_exceeded",
        lambda d, m, p: RoomExceeded(
            _int(d, "amount"),
            _int(d, "room"),
            _int(d, "capacity"),
            _int(d, "resident"),
            _opt_int(d, "device"),
            m,
        ),
        fields=("amount", "capacity", "room", "resident", "device"),
        reason="capacity",
    ),
    Answer(
        CapacityExceeded,
        413,
        "capacity_exceeded",
        lambda d, m, p: CapacityExceeded(_int(d, "amount"), _int(d, "capacity"), m),
        fields=("amount", "capacity"),
        reads=(413,),
        reason="capacity",
    ),
    Answer(
        AcquireTimeout,
        503,
        "queue_timeout",
        lambda d, m, p: AcquireTimeout(
            m,
            position=_int(d, "position"),
            queue_length=_int(d, "queue_length"),
            retry_after=_opt_float(d, "retry_after"),
            grace_left=float(d.get("grace_left") or 0.0),
            estimated_wait=_opt_float(d, "estimated_wait_s"),
        ),
        # when to retry is the answer's Retry-After (and the body's retry_after) of the surface
        fields=("position", "queue_length", "grace_left"),
    ),
    Answer(
        QueueFull,
        503,
        "queue_full",
        lambda d, m, p: QueueFull(
            p or "?",
            _int(d, "queue_length"),
            _opt_int(d, "max_waiters"),
            m,
            retry_after=_opt_float(d, "retry_after"),
            estimated_wait=_opt_float(d, "estimated_wait_s"),
        ),
        # as for queue_timeout: retry_after and estimated_wait_s are the surface's to add
        fields=("queue_length", "max_waiters"),
    ),
    Answer(
        ResizeRefused,
        409,
        "resize_refused",
        lambda d, m, p: ResizeRefused(
            str(d.get("lease_id") or "?"), _int(d, "amount"), _int(d, "current"), m
        ),
        fields=("lease_id", "amount", "current"),
    ),
    Answer(
        LeaseLost,
        410,
        "lease_lost",
        lambda d, m, p: LeaseLost(str(d.get("lease_id") or "?"), m),
        fields=("lease_id",),
        reads=(410,),
    ),
    Answer(
        LeaseLost,
        404,
        "not_found",
        lambda d, m, p: LeaseLost(str(d.get("lease_id") or "?"), m),
        fields=("lease_id",),
    ),
    Answer(
        BackendUnavailable,
        503,
        "backend_unavailable",
        lambda d, m, p: BackendUnavailable(_where(p) + m),
        reads=(502, 503, 504),
        reason="backend",
    ),
)

#: The status a server answers for an error of a lease it took on its client's behalf, where it
#: is not the lease API's (see the module docstring).
SERVED_STATUS: dict[int, int] = {401: 503, 403: 503, 404: 503, 409: 503, 410: 503, 422: 500}

_BY_CLASS: dict[type, Answer] = {}
for _a in ANSWERS:
    _BY_CLASS.setdefault(_a.cls, _a)
_BY_REPLY: dict[tuple[int, str], Answer] = {(a.status, a.code): a for a in ANSWERS}
_BY_STATUS: dict[int, Answer] = {s: a for a in ANSWERS for s in a.reads}
del _a


def answer_for(
    error: Union[BaseException, type[BaseException]], code: Optional[str] = None
) -> Optional[Answer]:
    """The answer of ``error`` (an exception or its class): the row of the nearest class in its
    MRO that has one (a subclass of a shared error answers as it, unless it has a row of its
    own); with ``code``, that class's row of that code. None for an exception no row covers
    (not a shared error, or :class:`PoolClosed`)."""
    cls = error if isinstance(error, type) else type(error)
    for k in cls.__mro__:
        a = _BY_CLASS.get(k)
        if a is not None:
            if code is None:
                return a
            return next((b for b in ANSWERS if b.cls is k and b.code == code), None)
    return None


def served(error: Union[BaseException, type[BaseException]]) -> tuple[int, str]:
    """``(status, reason)`` that a server answers for ``error`` from a lease it took on its
    client's behalf (the FastAPI integration): the answer's status through
    :data:`SERVED_STATUS`, and its ``reason`` (else its ``code``).

    Raises: LookupError for an exception no row covers."""
    a = answer_for(error)
    if a is None:
        raise LookupError(f"{error!r} is not a shared error: it has no HTTP answer")
    return SERVED_STATUS.get(a.status, a.status), a.reason or a.code


def reply_message(status: int, body: Any) -> str:
    """The message of an error reply's JSON ``body``: the ``message`` of a ``{"detail": {...}}``
    body; FastAPI's list of validation errors in users' words (``amount: ...``); a plain
    ``detail`` string; else ``HTTP <status>``."""
    d = body.get("detail") if isinstance(body, dict) else None
    if isinstance(d, dict):
        return str(d.get("message", d))
    if isinstance(d, list):
        return describe(d)
    if isinstance(d, str) and d:
        return d
    return f"HTTP {status}"


def error_from_reply(status: int, body: Any, pool: Optional[str] = None) -> GpuLockError:
    """The exception for an error reply of the lease API (``status`` ≥ 400 and its JSON
    ``body``, None when it had none), ``status`` set to the reply's: the row of its status and
    code, else the row that reads its status, else a plain :class:`GpuLockError` naming the
    status. ``pool``: the pool the request named (messages and :class:`PoolNotFound` name it;
    None: none)."""
    d = body.get("detail") if isinstance(body, dict) else None
    fields: Mapping[str, Any] = d if isinstance(d, dict) else {}
    code = fields.get("error")
    message = reply_message(status, body)
    a = _BY_REPLY.get((status, code)) if isinstance(code, str) else None
    a = a or _BY_STATUS.get(status)
    e = (
        a.build(fields, message, pool)
        if a is not None
        else GpuLockError(f"{_where(pool)}unexpected HTTP {status}: {message}")
    )
    e.status = status
    return e
