"""The I/O-free part of the client, shared by the sync and async shells: request bodies,
reply decoding, error mapping, retry delays, the lease's validity clock and heartbeat schedule.

The acquire, renew and release procedures are generators that *yield* what to do — an
:class:`Http` call, a :class:`Sleep` or an :class:`Enter` — and receive the outcome (a
:class:`Reply`, or the transport exception; for ``Enter`` True or False); ``_sync.py`` and
``_async.py`` only carry the steps out (each step's I/O; the loop is
:func:`gpulock_common.driver.drive`'s and ``adrive``'s). So the retry logic exists once, and
tests drive it with a fake clock and canned replies.
The resize procedure (``lease.resize``) is built the same way, in ``_resize.py``; a held
lease's renewal, the heartbeat's schedule and the release in ``_holding.py``.

Connections: each pool object has one connection pool for the long-polled waits (``lane``
:data:`WAIT`, at most ``max_connections``) and a separate small one for everything else
(:data:`CONTROL`: renewals by hand, release, withdrawing a place, status, configure), plus one
connection for the heartbeat; so no control call ever waits behind the waits. The waits go
through a :class:`Gate` of ``max_connections`` slots, in FIFO order: a waiter beyond the limit
waits in the process (within its acquire timeout) until an earlier wait of the same pool object
ends, and only then sends its request, so it reaches the broker's queue only then.
"""

from __future__ import annotations

import logging
import math
import os
import random
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generator, Optional, Sequence, Union
from urllib.parse import quote

from gpulock_common.lease import CLOCK_DRIFT as CLOCK_DRIFT
from gpulock_common.lease import SAFETY_MARGIN_S as SAFETY_MARGIN_S
from gpulock_common.lease import LeaseView, LocalLeaseState
from gpulock_common.lease import reply_made_after as reply_made_after
from gpulock_common.lease import validity_deadline as validity_deadline

from gpulock_common.options import DEFAULT_TTL_S as DEFAULT_TTL_S
from gpulock_common.queue import QueuePlace
from gpulock_common.options import MAX_DEVICES as MAX_DEVICES
from gpulock_common.options import PRIORITY_MAX as PRIORITY_MAX
from gpulock_common.options import PRIORITY_MIN as PRIORITY_MIN
from gpulock_common.options import AcquireOptions as AcquireOptions
from gpulock_common.options import PoolSettings as PoolSettings
from gpulock_common.grace import grace_note
from gpulock_common import traces
from gpulock_common.wire import error_from_reply, reply_message
from ._gate import Gate as Gate
from ._gate import Waker as Waker
from .errors import (
    AcquireTimeout,
    BackendUnavailable,
    GpuLockError,
    InvalidArgument,
)

DEFAULT_MAX_WAIT_S = 20.0  # longest long-poll per request; the broker caps it too
DEFAULT_BACKEND_TIMEOUT_S = 30.0  # how long an unreachable broker/Redis is retried
CONNECT_TIMEOUT_S = 5.0
READ_SLACK_S = 10.0  # added to `wait` for the read timeout of a long poll
JITTER = (1.0, 1.3)  # Retry-After is multiplied by a uniform factor in this range
RELEASE_TIMEOUT_S = 5.0
# Connections per pool object: the long-polled waits (``max_connections``), the control calls,
# and the heartbeat's own.
DEFAULT_MAX_CONNECTIONS = 64
CONTROL_CONNECTIONS = 4
HEARTBEAT_CONNECTIONS = 1
WAIT = "wait"  # Http.lane of a long-polled acquire
CONTROL = "control"  # Http.lane of everything else

Clock = Callable[[], float]


def env_url(url: Optional[str]) -> str:
    u = url or os.environ.get("GPULOCK_BROKER_URL")
    if not u:
        raise InvalidArgument("no broker URL: pass url= or set GPULOCK_BROKER_URL")
    return u.rstrip("/")


def env_token(token: Optional[str]) -> Optional[str]:
    return token if token is not None else os.environ.get("GPULOCK_TOKEN")


def new_request_id() -> str:
    return secrets.token_hex(16)


_HOST = socket.gethostname()


def holder_meta(holder: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    meta: Dict[str, Any] = {"host": _HOST[:64], "pid": os.getpid()}
    if holder:
        meta.update(holder)
    return meta


# ---- steps ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Http:
    method: str
    path: str
    json: Any = None
    timeout: float = 10.0  # read timeout, seconds
    lane: str = CONTROL  # which connection pool carries it: WAIT (long polls) or CONTROL


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Reply:
    status: int
    headers: Dict[str, str]  # lower-case names
    body: Any
    sent: float  # local monotonic time the request was sent

    def detail(self) -> Dict[str, Any]:
        d = self.body.get("detail") if isinstance(self.body, dict) else None
        return d if isinstance(d, dict) else {}

    def message(self) -> str:
        return reply_message(self.status, self.body)

    def retry_after(self) -> Optional[float]:
        v = self.headers.get("retry-after")
        try:
            return max(0.0, float(v)) if v is not None else None
        except ValueError:
            return None


@dataclass(frozen=True)
class Enter:
    """Wait for a slot of ``gate`` until ``deadline`` (clock time; None: no bound). The outcome
    is True once it holds one (the procedure leaves the gate when it ends), False when the
    deadline passed first."""

    gate: Gate
    deadline: Optional[float]


def _seconds(timeout: Optional[float]) -> str:
    """A timeout as the messages print it: seconds to the millisecond (``0.7s``, not the
    ``0.6995481290000498s`` a computed remainder makes), as the caller's ``2.0s`` reads."""
    return "no timeout" if timeout is None else f"{round(timeout, 3)}s"


def seconds_until(deadline: Optional[float], clock: Clock) -> Optional[float]:
    return None if deadline is None else max(0.0, deadline - clock())


Outcome = Union[Reply, Exception, bool]
Step = Union[Http, Sleep, Enter]
Steps = Generator[Step, Outcome, Any]


def error_for(r: Reply, pool: str) -> GpuLockError:
    """The exception for a non-success reply: the error table's
    (:func:`gpulock_common.wire.error_from_reply`), ``status`` set to the reply's."""
    return error_from_reply(r.status, r.body, pool)


def jittered(seconds: float, rng: random.Random) -> float:
    return seconds * rng.uniform(*JITTER)


def backoff(attempt: int, rng: random.Random, cap: float = 2.0) -> float:
    """Full-jitter exponential backoff for transport errors: 0..min(cap, 0.1*2^attempt)."""
    return rng.uniform(0.0, min(cap, 0.1 * (2**attempt)))


# ---- lease state ---------------------------------------------------------------------------
class LeaseState(LocalLeaseState):
    """A lease's local state (:class:`gpulock_common.lease.LocalLeaseState`: identity, the
    validity deadline, lost/released, the ``on_lost`` callbacks, a yield request and its
    ``on_yield`` callbacks) built from the broker's grant
    ``body`` (a 201's JSON) for a request sent at ``sent`` (local monotonic seconds).
    Thread-safe: the heartbeat runs in another thread or task than the holder.

    Adds: ``request_id``, ``acquired_at`` and ``expires_at`` (Unix seconds, server clock; the
    expiry as last known), ``device`` (the device the lease is on; 0 on a pool of one device,
    and from a broker older than devices), ``next_renew`` (local monotonic seconds), ``renew_failures`` (since
    the last successful renewal). ``valid_until`` counts from the earliest instant the reply can
    have been made: ``sent`` plus the broker's ``held_ms`` (how long it held a long poll)."""

    unreachable = "broker"
    log = logging.getLogger("gpulock_client")

    def __init__(self, pool: str, body: Dict[str, Any], sent: float, clock: Clock):
        held_s = max(0.0, float(body.get("held_ms") or 0)) / 1000
        expires_in = float(body["expires_in"])
        super().__init__(
            pool,
            body["lease_id"],
            int(body["amount"]),
            int(body["token"]),
            float(body["ttl"]),
            validity_deadline(sent, expires_in, held_s),
            clock,
        )
        self.request_id: str = body["request_id"]
        self.expires_at: float = float(body["expires_at"])
        self.acquired_at: float = float(body["acquired_at"])
        self.device: int = int(body.get("device") or 0)
        self.next_renew = reply_made_after(sent, held_s) + min(self.ttl_s, expires_in) / 3
        self.renew_failures = 0

    def renewed(self, sent: float, body: Dict[str, Any]) -> None:
        """The broker's answer ``body`` to a renewal or a resize sent at ``sent``: the
        expiry it read (``expires_in``, counted from ``sent`` plus its ``held_ms``, which a
        renewal's answer does not have) is the lease's now, and the next renewal is due a
        third of it later. A renewal's ``yield_requested`` (with ``yield_deadline_s``, seconds
        left on the server's clock) marks the lease asked to yield (once: ``on_yield``)."""
        held_s = max(0.0, float(body.get("held_ms") or 0)) / 1000
        exp_in = float(body["expires_in"])
        self.expires_at = float(body["expires_at"])
        self.ttl_s = float(body.get("ttl", self.ttl_s))
        self.valid_until = validity_deadline(sent, exp_in, held_s)
        self.next_renew = reply_made_after(sent, held_s) + min(self.ttl_s, exp_in) / 3
        self.renew_failures = 0
        if self.span is not None:
            traces.renewed(self)
        left = body.get("yield_deadline_s")
        if body.get("yield_requested") and left is not None:
            # asked to yield (preemption): the deadline on the local clock, counted as the
            # validity is, so it ends before the server's
            self.mark_yield(validity_deadline(sent, float(left), held_s))


class LeaseBase(LeaseView):
    """What sync and async leases share (:class:`gpulock_common.lease.LeaseView`: ``id``,
    ``pool``, ``amount`` in bytes, ``token`` (fencing token, strictly increasing per pool),
    ``ttl`` in seconds, ``valid_until``, ``lost``, ``released``, ``ensure_valid``,
    ``on_lost``), plus ``request_id``, ``acquired_at`` and ``expires_at`` (Unix seconds, server
    clock; the expiry as last known) and ``device`` (the index of the device it is on; 0 on a
    pool of one device)."""

    request_id = property(lambda self: self._state.request_id)
    device = property(lambda self: self._state.device)
    expires_at = property(lambda self: self._state.expires_at)
    acquired_at = property(lambda self: self._state.acquired_at)


# ---- procedures ----------------------------------------------------------------------------
@dataclass
class PoolConfig:
    name: str
    default_ttl: float = DEFAULT_TTL_S
    max_wait: float = DEFAULT_MAX_WAIT_S
    backend_timeout: float = DEFAULT_BACKEND_TIMEOUT_S
    clock: Clock = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    gate: Optional[Gate] = None  # the wait connections' FIFO; None: unbounded (tests of the core)
    # when the pool's restart grace period ends (clock), as the broker's last 503 said; 0: none
    grace_until: float = 0.0

    @property
    def base(self) -> str:
        return f"/v1/pools/{quote(self.name, safe='')}"

    def grace_left(self) -> float:
        """Seconds left in the pool's restart grace period as last seen (0: none)."""
        return max(0.0, self.grace_until - self.clock())


def checked_settings(settings: PoolSettings) -> PoolSettings:
    """``configure``'s settings after the checks made before anything is sent: the
    vocabulary's (:meth:`PoolSettings.checked`: the queue bound, ``max_ttl``, the policy, the
    backfill window, the placement) and that ``devices`` is a list (the broker takes each
    device's capacity; the sizes are the broker's to parse, and a 422 names a bad one).
    Raises InvalidArgument naming the bad value."""
    devices = settings.devices
    if devices is not None and (
        isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence)
    ):
        raise InvalidArgument(
            f"devices must be a list of each device's capacity, e.g. ['80GiB', '80GiB'], got "
            f"{devices!r:.80} (auto is the CLI's: gpulock pool set NAME --devices auto)"
        )
    return settings.checked()


def configure_body(
    settings: PoolSettings, current: Optional[Dict[str, Any]] = None
) -> Dict[str, Any]:
    """The body of ``PUT /v1/pools/{pool}`` for ``settings`` (:func:`checked_settings`):
    what is None is left out, so the pool keeps it. The PUT needs a capacity or devices: when
    neither is given they are the pool's own, from ``current`` (its status, None for a pool
    that does not exist).

    Raises InvalidArgument: neither given for a new pool."""
    if settings.capacity is None and settings.devices is None:
        if current is None:
            raise InvalidArgument("a new pool needs capacity or devices (each device's capacity)")
        have = current.get("devices") or []
        settings = settings._replace(
            capacity=current["capacity"],  # kept as it is
            devices=[int(d["capacity"]) for d in have] if len(have) > 1 else None,
        )
    return settings.given()


def granted_place(body: Any) -> Optional[QueuePlace]:
    """The place a granted request took in the queue, from its 201 ``body``'s ``queued``
    (``{"position", "queue_length", "estimated_wait_s"}``: the broker enqueued it, it waited,
    and the same long poll ended in the grant); None when it was granted at once, or from a
    broker older than the field."""
    q = body.get("queued") if isinstance(body, dict) else None
    if not isinstance(q, dict) or not q.get("position"):
        return None
    est, length = q.get("estimated_wait_s"), q.get("queue_length")
    return QueuePlace(
        int(q["position"]),
        estimated_wait=None if est is None else float(est),
        queue_length=None if length is None else int(length),
    )


def acquire_steps(
    cfg: PoolConfig,
    amount: Union[int, str],
    options: AcquireOptions,
    on_queued: Optional[Callable[[int], Any]] = None,
    on_granted_place: Optional[Callable[[QueuePlace], Any]] = None,
) -> Steps:
    """Acquire with long polls and retries; returns ``(reply body, sent)`` of the 201.

    One request id for every attempt (the broker keeps the place for it); ``Retry-After`` is
    honoured with jitter; transport errors and 503 backend_unavailable are retried for
    ``backend_timeout`` seconds (or until the timeout); on giving up the place is withdrawn.

    With ``cfg.gate``, a waiting acquire first takes a wait connection's slot (waiting in FIFO
    order within its timeout: AcquireTimeout with position 0 if none frees in time) and holds it
    to the end; ``timeout=0`` (one try, no long poll) goes on the control connections.

    ``options`` (the acquire's keywords; a tenant and ``resident`` are the broker's to set, not
    the client's): checked first, by the broker's bounds too (InvalidArgument before anything
    is sent: ``AcquireOptions.checked(remote=True)``); ``priority`` is
    sent only when it is not 0, ``device`` only when it is not None, ``preemptible`` only
    when False (a broker older than the field refuses it).

    ``on_queued(place)``: at each new place a ``queued`` answer reports (the request still
    waits). ``on_granted_place(place)``: once, before returning, with the place a request that
    no ``queued`` answer placed took before its grant (:func:`granted_place`; not called
    when it was granted at once): what the acquire's span records; the request no longer
    waits, so it is never ``on_queued``'s."""
    options = options.checked(remote=True)
    timeout = options.timeout
    start = cfg.clock()
    deadline = None if timeout is None else start + max(0.0, timeout)
    try_once = timeout is not None and timeout <= 0
    polls = _acquire_polls(
        cfg,
        amount,
        options,
        on_queued=on_queued,
        on_granted_place=on_granted_place,
        start=start,
        deadline=deadline,
        try_once=try_once,
    )
    return (
        yield from _gated(cfg, polls, start, deadline, try_once, f"no grant of {amount}", timeout)
    )


def _gated(
    cfg: PoolConfig,
    polls: Steps,
    start: float,
    deadline: Optional[float],
    try_once: bool,
    what: str,
    timeout: Optional[float],
) -> Steps:
    """Run ``polls`` (long polls on the WAIT lane) holding a slot of ``cfg.gate``, taken in
    FIFO order within ``deadline`` and left when they end; ``try_once`` (one answer at once,
    on the control connections) takes none. Raises AcquireTimeout ("``what`` within
    ``timeout``s") when no slot freed in time: nothing reached the broker."""
    gate = None if try_once else cfg.gate
    entered = False
    try:
        if gate is not None:
            entered = (yield Enter(gate, deadline)) is True
            if not entered or (deadline is not None and cfg.clock() >= deadline):
                raise AcquireTimeout(
                    f"pool {cfg.name!r}: {what} within {_seconds(timeout)}: it waited in this process "
                    f"for one of its {gate.slots} connections for waits (max_connections), all taken by "
                    f"earlier waits, and never reached the broker's queue",
                    waited=cfg.clock() - start,
                )
        return (yield from polls)
    finally:
        polls.close()
        if entered:
            assert gate is not None
            gate.leave()


def _acquire_polls(
    cfg: PoolConfig,
    amount: Union[int, str],
    options: AcquireOptions,
    *,
    on_queued: Optional[Callable[[int], Any]],
    on_granted_place: Optional[Callable[[QueuePlace], Any]] = None,
    start: float,
    deadline: Optional[float],
    try_once: bool,
) -> Steps:
    clock, rng = cfg.clock, cfg.rng
    lane = CONTROL if try_once else WAIT
    timeout, rid = options.timeout, options.request_id or new_request_id()
    body: Dict[str, Any] = {
        "amount": amount,
        "ttl": cfg.default_ttl if options.ttl is None else options.ttl,
        "holder": holder_meta(options.holder),
        "request_id": rid,
    }
    if options.priority:
        body["priority"] = options.priority
    if options.device is not None:
        body["device"] = options.device
    if not options.preemptible:
        body["preemptible"] = False
    position, queue_length, last_ra = 0, 0, None
    down_since: Optional[float] = None
    attempt = 0
    queued = False
    last_err: Optional[GpuLockError] = None
    while True:
        now = clock()
        remaining = math.inf if deadline is None else deadline - now
        final = try_once or remaining <= 0
        wait = 0.0 if final else min(cfg.max_wait, remaining)
        out = yield Http(
            "POST",
            cfg.base + "/leases",
            {**body, "wait": round(wait, 3), "queue": not try_once},
            timeout=wait + READ_SLACK_S,
            lane=lane,
        )
        assert isinstance(out, (Reply, Exception))  # an Http step's outcome
        attempt += 1
        if isinstance(out, Reply) and out.status == 201:
            cfg.grace_until = 0.0  # granted: no grace period (nothing is granted in one)
            if position == 0 and on_granted_place is not None:  # no queued answer placed it
                place = granted_place(out.body)
                if place is not None:  # queued and granted within one long poll
                    on_granted_place(place)
            return out.body, out.sent
        if (
            isinstance(out, Reply)
            and out.status == 503
            and out.detail().get("error") in ("queued", "busy")
        ):
            d = out.detail()
            down_since, last_err = None, None
            grace = float(d.get("grace_left") or 0.0)  # a broker older than it sends none
            cfg.grace_until = now + grace if grace > 0 else 0.0
            queued = d.get("error") == "queued"
            queue_length = int(d.get("queue_length") or 0)
            last_ra = out.retry_after()
            pos = int(d.get("position") or 0)
            if queued and pos != position:
                position = pos
                if on_queued is not None:  # the int position, with the broker's estimate
                    est = d.get("estimated_wait_s")  # a broker older than it sends none
                    on_queued(
                        QueuePlace(
                            pos,
                            estimated_wait=None if est is None else float(est),
                            queue_length=queue_length,
                        )
                    )
            delay = jittered(last_ra if last_ra is not None else 1.0, rng)
        elif isinstance(out, Exception) or out.status in (502, 503, 504):
            last_err, down_since, given_up, delay = _unreachable(
                cfg, out, now, down_since, attempt, deadline
            )
            final = final or given_up
        else:
            err = error_for(out, cfg.name)
            if queued:  # e.g. a pool reset while we waited: do not leave a place behind
                yield from _cancel_steps(cfg, rid)
            raise err
        if final:
            if queued or last_err is not None:
                yield from _cancel_steps(cfg, rid)
            if last_err is not None:
                raise last_err
            grace = cfg.grace_left()
            raise AcquireTimeout(
                (
                    f"pool {cfg.name!r}: no grant of {amount} within {_seconds(timeout)} "
                    f"(position {position} of {queue_length})"
                    if queued
                    else f"pool {cfg.name!r}: {amount} not available now ({queue_length} queued)"
                )
                + (f": {grace_note(cfg.name, grace)}" if grace > 0 else ""),
                position=position,
                queue_length=queue_length,
                retry_after=last_ra,
                waited=clock() - start,
                grace_left=grace,
            )
        yield Sleep(delay if deadline is None else max(0.0, min(delay, deadline - clock())))


def _unreachable(
    cfg: PoolConfig,
    out: Union[Reply, Exception],
    now: float,
    down_since: Optional[float],
    attempt: int,
    deadline: Optional[float],
) -> tuple:
    """A waiting call's answer when the broker could not be reached or answered 502/503/504
    (not a queue answer): ``(error, down_since, given_up, delay)``: the error to raise if the
    call gives up, when the trouble began (``now`` for the first), whether a call with no
    deadline has been down for ``cfg.backend_timeout`` seconds (it gives up), and the seconds
    to sleep before trying again (the broker's ``Retry-After``, jittered, else a backoff)."""
    err = (
        BackendUnavailable(f"pool {cfg.name!r}: broker unreachable: {out!r}")
        if isinstance(out, Exception)
        else error_for(out, cfg.name)
    )
    down_since = now if down_since is None else down_since
    given_up = deadline is None and cfg.clock() - down_since >= cfg.backend_timeout
    ra = out.retry_after() if isinstance(out, Reply) else None
    delay = jittered(ra, cfg.rng) if ra is not None else backoff(attempt, cfg.rng)
    return err, down_since, given_up, delay


def _cancel_steps(cfg: PoolConfig, rid: str) -> Steps:
    """Withdraw the request (leave the queue, release a grant that raced in); best effort:
    if it fails, the broker withdraws it after its hold window."""
    yield Http("DELETE", f"{cfg.base}/requests/{rid}", timeout=2.0)
