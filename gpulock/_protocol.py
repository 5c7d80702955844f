"""The I/O-free core shared by the sync and async shells: argument validation and
encoding, reply decoding, error translation, and the lease's local validity clock.

Nothing here touches the network; ``_flow.py`` builds the operations from these, and
``_sync.py`` and ``_async.py`` add only the I/O.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

import redis.exceptions as rex
from gpulock_common.lease import CLOCK_DRIFT as CLOCK_DRIFT
from gpulock_common.lease import SAFETY_MARGIN_S as SAFETY_MARGIN_S
from gpulock_common.lease import LeaseView, LocalLeaseState
from gpulock_common.lease import default_clock as default_clock
from gpulock_common.lease import validity_deadline as lease_validity_deadline

from .errors import (
    BackendUnavailable,
    CapacityExceeded,
    GpuLockError,
    InvalidArgument,
    PoolNotFound,
    QueueFull,
)
from ._keys import POOL_NAME_RE
from .units import parse_seconds, parse_size

log = logging.getLogger("gpulock")

_TICKET_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_META_BYTES = 512

# Lease and waiter timing (seconds). Sources: etcd and Redisson renew at ttl/3, which survives
# two lost heartbeats before expiry.
DEFAULT_TTL_S = 30.0
MIN_TTL_S, MAX_TTL_S = 0.1, 86400.0
DEFAULT_WAITER_TTL_S = 5.0
# Waiters refresh their expiry (and re-poll as a backstop for a lost pub/sub message) this often.
DEFAULT_POLL_INTERVAL_S = 1.0
DEFAULT_MAX_WAITERS = 10_000
# The longest ttl a lease may have in a pool this library creates (``max_ttl``), unless the
# pool object is given another: also the length of the grace period after Redis lost a pool
# (docs/SEMANTICS.md), during which nothing new is granted. Twice the default ttl.
DEFAULT_MAX_TTL_S = 60.0


def validate_pool_name(name: object) -> str:
    """Pool names: 1-64 characters of ``[A-Za-z0-9._-]``. No braces (they would break the
    hash tag), colons (the key separator) or spaces."""
    if not isinstance(name, str) or not POOL_NAME_RE.fullmatch(name):
        raise InvalidArgument(f"pool name must be 1-64 characters of [A-Za-z0-9._-], got {name!r}")
    return name


def validate_request_id(rid: object) -> str:
    if not isinstance(rid, str) or not _TICKET_RE.fullmatch(rid):
        raise InvalidArgument(
            f"request_id must be 1-128 characters of [A-Za-z0-9._:-], got {rid!r}"
        )
    return rid


def validate_token(token: object) -> int:
    """A fencing token from outside (a remote holder's): a non-negative integer, or its
    decimal digits."""
    if isinstance(token, str) and token.isascii() and token.isdigit() and len(token) <= 16:
        token = int(token)
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= 2**53 - 1:
        raise InvalidArgument(f"token must be a non-negative integer, got {token!r:.80}")
    return token


def pool_settings(
    name: str,
    *,
    capacity,
    default_ttl: float,
    waiter_ttl: float,
    poll_interval: float,
    max_waiters: int,
    backend_timeout: float,
    max_ttl: float | None,
    sync_replicas: int,
    sync_timeout: float,
) -> dict[str, Any]:
    """Validate a pool object's settings, for both shells (see ``AsyncPool`` for their meaning
    and units). Returns the attribute values; raises InvalidArgument naming a bad one."""
    dttl = parse_seconds(default_ttl, name="default_ttl", minimum=MIN_TTL_S, maximum=MAX_TTL_S)
    mttl = parse_seconds(
        max(DEFAULT_MAX_TTL_S, dttl) if max_ttl is None else max_ttl,
        name="max_ttl",
        minimum=MIN_TTL_S,
        maximum=MAX_TTL_S,
    )
    if dttl > mttl:
        raise InvalidArgument(f"default_ttl {default_ttl!r} is longer than max_ttl {mttl!r}")
    if (
        not isinstance(sync_replicas, int)
        or isinstance(sync_replicas, bool)
        or not 0 <= sync_replicas <= 16
    ):
        raise InvalidArgument(f"sync_replicas must be an integer in [0, 16], got {sync_replicas!r}")
    return {
        "name": validate_pool_name(name),
        "capacity": None if capacity is None else parse_size(capacity, name="capacity"),
        "default_ttl": default_ttl,
        "waiter_ttl": waiter_ttl,
        "poll_interval": poll_interval,
        "max_waiters": max_waiters,
        "backend_timeout": backend_timeout,
        "max_ttl": mttl,
        "sync_replicas": sync_replicas,
        "sync_timeout": parse_seconds(
            sync_timeout, name="sync_timeout", minimum=0.001, maximum=60.0
        ),
    }


def configure_capacity(capacity: int | str | None, current: int | None) -> int:
    """The capacity a pool object's ``configure`` sets (bytes): the one given, else the pool
    object's own. Raises InvalidArgument for a bad one, or when neither is there."""
    value = capacity if capacity is not None else current
    if value is None:
        raise InvalidArgument("capacity must be a size in bytes, got None")
    return parse_size(value, name="capacity")


def new_id() -> str:
    """A 128-bit random id as 32 hex digits (lease ids and default tickets)."""
    return secrets.token_hex(16)


_HOST = socket.gethostname()
_DEFAULT_META: dict[int, str] = {}


def encode_meta(holder: dict[str, Any] | None) -> str:
    """Holder metadata as compact JSON (at most 512 bytes). Host and pid are added unless
    given, so ``gpulock status`` can say who holds what."""
    if not holder:
        pid = os.getpid()  # cached per process (the pid changes across fork)
        cached = _DEFAULT_META.get(pid)
        if cached is None:
            cached = _DEFAULT_META[pid] = json.dumps(
                {"host": _HOST, "pid": pid}, separators=(",", ":")
            )
        return cached
    meta = {"host": _HOST, "pid": os.getpid()}
    if holder:
        if not isinstance(holder, dict):
            raise InvalidArgument(f"holder must be a dict of metadata, got {holder!r}")
        meta.update(holder)
    try:
        s = json.dumps(meta, separators=(",", ":"), default=str, ensure_ascii=True)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"holder metadata is not JSON-serialisable: {e}") from None
    # ensure_ascii writes a lone surrogate ("\ud800") as its escape, which every reader then
    # decodes back to a str that cannot be encoded as UTF-8 (the broker's status was a 500 for
    # as long as the lease lived). Escapes of surrogates only appear for such text or for
    # characters outside the BMP (json writes lower-case hex), so the exact check runs only then.
    if "\\ud" in s:
        bad = meta_unicode_error(meta)
        if bad:
            raise InvalidArgument(bad)
    if len(s) > MAX_META_BYTES:
        raise InvalidArgument(
            f"holder metadata is {len(s)} bytes as JSON; at most {MAX_META_BYTES}"
        )
    return s


def meta_unicode_error(holder: dict[str, Any]) -> str | None:
    """None when every key and value of ``holder`` can be written as JSON in UTF-8, else a
    message naming the first one that cannot (it holds a lone surrogate such as ``"\\ud800"``,
    which Python's JSON parser accepts in input). The one check of every surface: the core's
    :func:`encode_meta` and the broker's request model."""
    for k, v in holder.items():
        try:
            str(k).encode("utf-8")
        except UnicodeEncodeError:
            return (
                f"holder metadata key {k!r} is not valid Unicode (a lone surrogate); "
                f"JSON in UTF-8 cannot carry it"
            )
        try:
            json.dumps(v, default=str, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return (
                f"holder metadata {k!r} has a value that is not valid Unicode (a lone surrogate, "
                f"such as '\\ud800'); JSON in UTF-8 cannot carry it"
            )
        except (TypeError, ValueError, RecursionError):
            pass  # not JSON at all: the caller says so
    return None


def _printable(x: Any, depth: int = 0) -> Any:
    """Decoded metadata with lone surrogates written as their escapes (bounded depth)."""
    if isinstance(x, str):
        try:
            x.encode("utf-8")
            return x
        except UnicodeEncodeError:
            return x.encode("utf-8", "backslashreplace").decode("utf-8")
    if depth > 32:
        return x
    if isinstance(x, dict):
        return {_printable(k, depth + 1): _printable(v, depth + 1) for k, v in x.items()}
    if isinstance(x, list):
        return [_printable(v, depth + 1) for v in x]
    return x


def decode_meta(s: str | bytes) -> dict[str, Any]:
    if isinstance(s, bytes):
        s = s.decode("utf-8", "replace")
    try:
        v = json.loads(s) if s else {}
    except (ValueError, RecursionError):
        return {"raw": s}
    if "\\ud" in s.lower():  # metadata stored before encode_meta refused lone surrogates
        v = _printable(v)
    return v if isinstance(v, dict) else {"value": v}


def ttl_ms(ttl_s: float) -> int:
    return max(int(MIN_TTL_S * 1000), int(round(ttl_s * 1000)))


@dataclass(frozen=True)
class AcquireRequest:
    """A validated acquire: everything the script needs, plus the caller's timeout."""

    pool: str
    amount: int
    ttl_s: float
    timeout_s: float | None
    ticket: str
    lease_id: str
    meta: str
    waiter_ttl_s: float

    @classmethod
    def build(
        cls,
        pool: str,
        amount: int | float | str,
        *,
        ttl: float | None,
        timeout: float | None,
        holder: dict[str, Any] | None,
        request_id: str | None,
        waiter_ttl: float,
        default_ttl: float,
    ) -> "AcquireRequest":
        amt = parse_size(amount)
        ttl_s = parse_seconds(
            default_ttl if ttl is None else ttl, name="ttl", minimum=MIN_TTL_S, maximum=MAX_TTL_S
        )
        timeout_s = parse_seconds(
            timeout, name="timeout", minimum=0.0, maximum=1e9, allow_none=True
        )
        ticket = new_id() if request_id is None else validate_request_id(request_id)
        return cls(pool, amt, ttl_s, timeout_s, ticket, new_id(), encode_meta(holder), waiter_ttl)

    def argv(self, mode: str, channel: str) -> list[str]:
        """ARGV of ``acquire.lua``; ``channel`` is the caller runtime's pub/sub channel id."""
        return [
            self.ticket,
            self.lease_id,
            str(self.amount),
            str(ttl_ms(self.ttl_s)),
            str(ttl_ms(self.waiter_ttl_s)),
            mode,
            self.meta,
            channel,
        ]


@dataclass(frozen=True)
class Grant:
    """A lease granted by the server. Times are server milliseconds."""

    ticket: str
    lease_id: str
    token: int
    expires_ms: int
    amount: int
    now_ms: int
    epoch: int = 0
    capacity: int = 0


@dataclass(frozen=True)
class NotGranted:
    """An acquire that did not grant: queued (``queued`` true) or, for ``try``, refused."""

    queued: bool
    position: int
    retry_after_ms: int  # to the nearest lease expiry; -1 when no lease exists
    queue_length: int
    now_ms: int
    epoch: int
    capacity: int
    used: int


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def decode_acquire(ticket: str, r: list) -> Grant | NotGranted:
    if int(r[0]) == 1:
        return Grant(
            ticket, _s(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]), int(r[6]), int(r[7])
        )
    return NotGranted(
        int(r[0]) == 0, int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]), int(r[6]), int(r[7])
    )


def decode_events(data: str | bytes) -> list[Grant]:
    """Parse a hand-off message from the pool's channel (format in ``lua/lib.lua``)."""
    text = _s(data)
    lines = text.split("\n")
    head = lines[0].split(" ")
    if head[0] != "g":
        return []
    now = int(head[1])
    out = []
    for line in lines[1:]:
        p = line.split(" ")
        if len(p) == 5:
            out.append(Grant(p[0], p[1], int(p[2]), int(p[3]), int(p[4]), now))
    return out


@dataclass(frozen=True)
class LeaseInfo:
    lease_id: str
    amount: int
    token: int
    expires_in: float  # seconds, on the server clock
    held_for: float  # seconds since the grant
    ttl: float
    request_id: str
    holder: dict[str, Any]


@dataclass(frozen=True)
class WaiterInfo:
    position: int
    request_id: str
    amount: int
    waited: float  # seconds in the queue
    expires_in: float  # seconds until dropped if not refreshed
    holder: dict[str, Any]


@dataclass(frozen=True)
class PoolStatus:
    """A snapshot of a pool, read from Redis by one script (so self-consistent).
    Amounts are bytes; times are seconds."""

    pool: str
    capacity: int
    used: int
    epoch: int
    fence: int
    max_waiters: int
    lease_count: int
    waiter_count: int
    grants: int
    reaped_leases: int
    reaped_waiters: int
    leases: list[LeaseInfo] = field(default_factory=list)
    waiters: list[WaiterInfo] = field(default_factory=list)
    grace_left: float = 0.0  # seconds of grace period left (no new grants until then)
    max_ttl: float = 0.0  # seconds: the longest ttl a lease may have (0: unbounded)
    reasserted: int = 0  # leases put back by their holders after Redis lost the pool

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.used)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


def decode_status(pool: str, r: list) -> PoolStatus | None:
    if int(r[0]) == 0:
        return None
    now = int(r[1])
    leases = [
        LeaseInfo(
            _s(x[0]),
            int(x[1]),
            int(x[2]),
            (int(x[3]) - now) / 1000,
            (now - int(x[4])) / 1000,
            int(x[5]) / 1000,
            _s(x[6]),
            decode_meta(x[7]),
        )
        for x in r[12]
    ]
    waiters = [
        WaiterInfo(
            i + 1,
            _s(x[0]),
            int(x[1]),
            (now - int(x[2])) / 1000,
            (int(x[3]) - now) / 1000,
            decode_meta(x[4]),
        )
        for i, x in enumerate(r[13])
    ]
    (
        capacity,
        used,
        epoch,
        fence,
        max_waiters,
        lease_count,
        waiter_count,
        grants,
        reaped_leases,
        reaped_waiters,
    ) = (int(v) for v in r[2:12])
    extra = [int(v) for v in r[14:17]] + [0, 0, 0]
    return PoolStatus(
        pool,
        capacity,
        used,
        epoch,
        fence,
        max_waiters,
        lease_count,
        waiter_count,
        grants,
        reaped_leases,
        reaped_waiters,
        leases=leases,
        waiters=waiters,
        grace_left=extra[0] / 1000,
        max_ttl=extra[1] / 1000,
        reasserted=extra[2],
    )


def translate(exc: BaseException, pool: str) -> BaseException:
    """Map a redis-py error to gpulock's tree (the caller raises it ``from exc``)."""
    if isinstance(exc, GpuLockError):
        return exc
    if isinstance(exc, rex.ResponseError):
        msg = str(exc)
        code, _, rest = msg.partition(" ")
        if code == "GPULOCK_BADARG":
            return InvalidArgument(rest)
        if code == "GPULOCK_CONFLICT":
            return InvalidArgument(rest)
        if code == "GPULOCK_NOPOOL":
            return PoolNotFound(pool)
        if code == "GPULOCK_CAPACITY":
            a, c = rest.split()
            return CapacityExceeded(int(a), int(c))
        if code == "GPULOCK_QUEUEFULL":
            q, m = rest.split()
            return QueueFull(pool, int(q), int(m))
        if code == "GPULOCK_KEYTYPE":
            key, found, expected = (rest.split() + ["?", "?", "?"])[:3]
            return BackendUnavailable(
                f"pool {pool!r} is damaged: Redis key {key} is a {found}, not a {expected} (something "
                f"other than gpulock wrote under its prefix); nothing was changed. Delete that key, "
                f"or the pool's keys, to repair it"
            )
        if isinstance(exc, rex.OutOfMemoryError) or "maxmemory" in msg:
            return BackendUnavailable(
                f"Redis is out of memory (maxmemory reached with a no-eviction policy); pool {pool!r} "
                f"was not changed: {msg}"
            )
        if isinstance(exc, rex.NoPermissionError):
            return BackendUnavailable(
                f"Redis refused a gpulock script on pool {pool!r} for lack of permission (ACL; see "
                f"docs/RELIABILITY.md for the ACL gpulock needs): {msg}"
            )
        return BackendUnavailable(f"Redis refused a gpulock script on pool {pool!r}: {msg}")
    if isinstance(exc, rex.AuthenticationError):
        return BackendUnavailable(
            f"Redis refused gpulock's credentials for pool {pool!r} ({exc}); check the password or the "
            f"ACL user in the Redis URL (GPULOCK_REDIS_URL / --redis-url)"
        )
    if isinstance(exc, (rex.ConnectionError, rex.TimeoutError, OSError)):
        from ._connect import short_error

        return BackendUnavailable(f"Redis unavailable for pool {pool!r}: {short_error(exc)}")
    if isinstance(exc, rex.RedisError):
        return BackendUnavailable(f"Redis error on pool {pool!r}: {exc}")
    return exc


# Why reassert.lua refused to put a lease back (its negative result codes).
REASSERT_REFUSED = {
    -1: "Redis lost the pool more than one max_ttl ago; the lease cannot be put back",
    -2: "Redis lost the pool, and the lease does not fit next to the leases put back or granted since",
    -3: "Redis lost the pool, and the lease's token is not older than the pool made again",
    -4: "Redis lost the pool, and the lease's ttl is longer than the new pool's max_ttl",
    -5: "Redis lost the pool, and its lease id or request id is taken by another lease",
}


def retry_bound(backend_timeout: float, timeout: float | None) -> float:
    """Seconds an acquire retries connection errors: ``backend_timeout``, shortened to the
    caller's own ``timeout`` (at least 1 s, so a try-once acquire still rides out a dropped
    connection): a caller that would wait 0.5 s for a grant should not wait 5 s for Redis."""
    if timeout is None:
        return backend_timeout
    return min(backend_timeout, max(1.0, timeout))


# Errors worth retrying for idempotent operations: the request may or may not have run.
RETRYABLE = (rex.ConnectionError, rex.TimeoutError, ConnectionError, OSError)

# The retry schedule (seconds): full jitter over 0.05 s doubling per attempt, capped at 1 s.
RETRY_BASE_S, RETRY_CAP_S = 0.05, 1.0


def retry_delay(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (1: the first retry) of a Redis call
    that failed with a :data:`RETRYABLE` error: uniform in [0, min(1 s, 0.05 s × 2^(attempt-1))].
    The one schedule of every retry gpulock makes, foreground calls and background loops alike."""
    return random.uniform(0.0, min(RETRY_CAP_S, RETRY_BASE_S * 2.0 ** min(max(attempt, 1) - 1, 30)))


def retrying(bound: float, *, asynchronous: bool) -> Any:
    """The one retry policy of gpulock's idempotent Redis calls, for foreground and background
    calls alike: retry :data:`RETRYABLE` errors on the :func:`retry_delay` schedule for at most
    ``bound`` seconds, then re-raise the last error. Returns a tenacity ``AsyncRetrying``
    (``asynchronous``) or ``Retrying``; use it as ``for attempt in retrying(...): with attempt:``
    (``async for`` for the asynchronous one)."""
    from tenacity import AsyncRetrying, Retrying, retry_if_exception_type, stop_after_delay

    kw: dict[str, Any] = dict(
        retry=retry_if_exception_type(RETRYABLE),
        stop=stop_after_delay(bound),
        wait=lambda rs: retry_delay(rs.attempt_number),
        reraise=True,
    )
    return AsyncRetrying(**kw) if asynchronous else Retrying(**kw)


class LeaseState(LocalLeaseState):
    """A lease's local state (:class:`gpulock_common.lease.LocalLeaseState`: identity, the
    validity deadline, lost/released, the ``on_lost`` callbacks) with what a Redis grant adds,
    shared by both shells and the heartbeat. Thread-safe: the heartbeat may run in another
    thread than the holder.

    Adds: ``ticket`` (the request id), ``expires_ms`` (server-clock expiry, Unix ms),
    ``epoch`` (the pool's epoch at the grant), ``meta`` (holder metadata as sent to acquire,
    kept to re-assert the lease), ``next_renew`` (local monotonic seconds). ``valid_until``
    comes from :func:`validity_deadline` of the last successful grant or renewal, so it always
    ends before the server's expiry (invariant 5 in docs/SEMANTICS.md).
    """

    __slots__ = ("ticket", "expires_ms", "epoch", "meta", "next_renew")
    unreachable = "Redis"
    log = logging.getLogger("gpulock")

    def __init__(
        self, pool: str, grant: Grant, ttl_s: float, valid_until: float, clock: Callable[[], float]
    ):
        super().__init__(pool, grant.lease_id, grant.amount, grant.token, ttl_s, valid_until, clock)
        self.ticket = grant.ticket
        self.expires_ms = grant.expires_ms
        self.epoch = grant.epoch
        self.meta = ""
        self.next_renew = clock() + ttl_s / 3

    def renewed(self, sent: float, now_ms: int, expires_ms: int) -> None:
        self.expires_ms = expires_ms
        self.valid_until = validity_deadline(sent, now_ms, expires_ms)
        self.next_renew = sent + self.ttl_s / 3

    def _report_lost(self, reason: str) -> None:
        log.warning(
            "gpulock: lease %s… on pool %s (token %d, %d bytes) lost: %s",
            self.lease_id[:8],
            self.pool,
            self.token,
            self.amount,
            reason,
        )


def validity_deadline(sent: float, now_ms: int, expires_ms: int) -> float:
    """The local validity deadline (monotonic seconds) of a call sent at ``sent`` whose reply
    gave the Redis server's time ``now_ms`` and the lease's expiry ``expires_ms`` (both Unix ms
    on the server's clock): :func:`gpulock_common.lease.validity_deadline` of that span."""
    return lease_validity_deadline(sent, (expires_ms - now_ms) / 1000.0)


class LeaseBase(LeaseView):
    """What sync and async leases share (:class:`gpulock_common.lease.LeaseView`: ``id``,
    ``pool``, ``amount`` in bytes, ``token``, ``ttl`` in seconds, ``valid_until``, ``lost``,
    ``released``, ``ensure_valid``, ``on_lost``), plus ``request_id`` and ``expires_at``."""

    __slots__ = ()

    request_id = property(lambda self: self._state.ticket)

    @property
    def expires_at(self) -> float:
        """Server-clock expiry of the last grant/renewal, as a Unix timestamp (seconds)."""
        return self._state.expires_ms / 1000.0


def check_amount_vs_capacity(amount: int, capacity: int | None) -> None:
    if capacity is not None and amount > capacity:
        raise CapacityExceeded(amount, capacity)
