"""The resize procedure of the client, shared by the sync and async shells: ``lease.resize``
through the broker (``POST /v1/pools/{pool}/leases/{lease_id}/resize``), a growth's long polls
and retries, and its withdrawal. Like ``_core``'s procedures it is a generator of steps
(:class:`~gpulock_client._core.Http`, :class:`~gpulock_client._core.Sleep`,
:class:`~gpulock_client._core.Enter`) that ``_sync.py`` and ``_async.py`` carry out; it uses
``_core``'s wait gate, retry delays and error mapping.
"""

from __future__ import annotations

import math
from typing import Optional, Union

from gpulock_common.options import AcquireOptions
from gpulock_common import traces
from gpulock_common.sizes import parse_size
from ._holding import _GONE
from ._core import (
    CONTROL,
    READ_SLACK_S,
    WAIT,
    Http,
    LeaseState,
    PoolConfig,
    Reply,
    Sleep,
    Steps,
    _gated,
    _seconds,
    _unreachable,
    error_for,
    jittered,
)
from .errors import AcquireTimeout, GpuLockError, InvalidArgument, LeaseLost


def resize_steps(
    cfg: PoolConfig, s: LeaseState, amount: Union[int, str], timeout: Optional[float]
) -> Steps:
    """``lease.resize(amount, timeout=...)`` through the broker (``POST .../resize``): checks
    ``amount`` (bytes or a size, :func:`gpulock_common.sizes.parse_size`) and ``timeout`` (as
    an acquire's, :meth:`AcquireOptions.checked`) before anything is sent; the same amount
    sends nothing; a lease released or lost here raises LeaseLost without a request. A growth
    that waits is long-polled as an acquire is (a wait connection's slot, ``Retry-After``
    with jitter, the broker unreachable retried for ``backend_timeout`` or until the
    timeout), the same resize sent again each time; the broker's own timeout answers
    AcquireTimeout, and one that does not come within :data:`RESIZE_SLACK_S` after the
    timeout is withdrawn from here (:func:`withdraw_growth_steps`). On success ``s.amount``
    is the new amount and its validity counts from the answer (:meth:`LeaseState.renewed`).

    Raises: InvalidArgument, LeaseLost (marks the lease lost), ResizeRefused,
    CapacityExceeded (QuotaExceeded, RoomExceeded), AcquireTimeout (the lease keeps its
    amount), QueueFull, BackendUnavailable, AuthError, PoolNotFound."""
    n = parse_size(amount)
    timeout = AcquireOptions(timeout=timeout).checked(remote=True).timeout
    if s.released:
        raise LeaseLost(s.lease_id, "it was released")
    s.check()
    if n == s.amount:
        return None
    start = cfg.clock()
    deadline = None if timeout is None else start + timeout
    try_once = timeout == 0
    polls = _resize_polls(cfg, s, n, timeout, start, deadline, try_once)
    what = f"lease {s.lease_id[:8]}… not grown to {n} bytes"
    before = s.amount
    try:
        out = yield from _gated(cfg, polls, start, deadline, try_once, what, timeout)
    except BaseException as e:
        if s.span is not None:  # a traced lease: a gpulock.resize event (a loss ended it)
            traces.resized(s, before, n, e, cfg.clock() - start)
        raise
    if s.span is not None:
        traces.resized(s, before, n, None, cfg.clock() - start)
    return out


#: Seconds a growth's long polls go on past its timeout for the broker's own answer to it.
RESIZE_SLACK_S = 2.0


def _resize_polls(
    cfg: PoolConfig,
    s: LeaseState,
    n: int,
    timeout: Optional[float],
    start: float,
    deadline: Optional[float],
    try_once: bool,
) -> Steps:
    clock, rng = cfg.clock, cfg.rng
    lane = CONTROL if try_once else WAIT
    path = f"{cfg.base}/leases/{s.lease_id}/resize"
    down_since: Optional[float] = None
    position, attempt = 0, 0
    last_err: Optional[GpuLockError] = None
    waiting = False  # the broker said the growth waits: withdraw it when giving up
    while True:
        now = clock()
        left = math.inf if deadline is None else deadline - now
        wait = 0.0 if try_once else min(cfg.max_wait, max(0.0, left) + RESIZE_SLACK_S)
        body = {
            "amount": n,
            "timeout": None if timeout is None else max(0.0, left),
            "wait": round(wait, 3),
        }
        out = yield Http("POST", path, body, timeout=wait + READ_SLACK_S, lane=lane)
        assert isinstance(out, (Reply, Exception))  # an Http step's outcome
        attempt += 1
        code = out.detail().get("error") if isinstance(out, Reply) else None
        if isinstance(out, Reply) and out.status == 200:
            if s.active:
                s.amount = int(out.body["amount"])
                s.renewed(out.sent, out.body)
            return None
        final = try_once or left <= -RESIZE_SLACK_S
        if isinstance(out, Reply) and out.status == 503 and code == "queued":
            down_since, last_err, waiting = None, None, True
            position = int(out.detail().get("position") or position)
            ra = out.retry_after()
            delay = jittered(ra if ra is not None else 1.0, rng)
        elif isinstance(out, Exception) or (
            out.status in (502, 503, 504) and code != "queue_timeout"
        ):
            last_err, down_since, given_up, delay = _unreachable(
                cfg, out, now, down_since, attempt, deadline
            )
            final = final or given_up
        else:
            err = error_for(out, cfg.name)
            if isinstance(err, _GONE):
                s.mark_lost(f"the broker says it is gone: {out.message()}")
            if isinstance(err, AcquireTimeout):
                err.waited = clock() - start
            raise err
        if final:
            if waiting or last_err is not None:
                yield from withdraw_growth_steps(cfg, s)
            if last_err is not None:
                raise last_err
            raise AcquireTimeout(
                f"pool {cfg.name!r}: lease {s.lease_id[:8]}… not grown to {n} bytes within "
                f"{_seconds(timeout)} (position {position}); it keeps its amount",
                position=position,
                waited=clock() - start,
            )
        end = None if deadline is None else deadline + RESIZE_SLACK_S
        yield Sleep(delay if end is None else max(0.0, min(delay, end - clock())))


def grows(amount: Union[int, str], current: int) -> bool:
    """Whether a resize to ``amount`` grows a lease of ``current`` bytes (False for a bad
    amount: nothing was sent)."""
    try:
        return parse_size(amount) > current
    except InvalidArgument:
        return False


def withdraw_growth_steps(cfg: PoolConfig, s: LeaseState) -> Steps:
    """Withdraw a growth of ``s`` sent from here (given up, or interrupted): a resize back to
    the amount it holds here, never waiting, which ends the growth at the broker and undoes a
    grant that raced in; best effort (else the broker withdraws it when nobody comes back)."""
    yield Http(
        "POST",
        f"{cfg.base}/leases/{s.lease_id}/resize",
        {"amount": s.amount, "timeout": 0, "wait": 0},
        timeout=2.0,
    )
