"""A held lease's calls to the broker, as steps without I/O (see :mod:`._core`): its renewal
and the heartbeat's schedule of renewals (which leases are due, how long one request may take,
when a failed renewal is tried again), and its release with retries. ``_sync.py`` and
``_async.py`` carry the steps out."""

from __future__ import annotations

import random
from typing import List, Optional

from gpulock_common import traces

from ._core import (
    RELEASE_TIMEOUT_S,
    Http,
    LeaseState,
    PoolConfig,
    Reply,
    Sleep,
    Steps,
    backoff,
    error_for,
    jittered,
)
from .errors import AuthError, BackendUnavailable, InvalidArgument, LeaseLost, PoolNotFound

# Replies to a renewal or a release that end the lease: the broker says it is gone (410
# lease_lost; 404: a lease of another token, or its pool deleted) or refuses the call for good.
_GONE = (LeaseLost, PoolNotFound)
_REFUSED = (AuthError, InvalidArgument)


def renew_steps(
    cfg: PoolConfig, s: LeaseState, request_timeout: float, ttl: Optional[float] = None
) -> Steps:
    """One renewal. Returns True (renewed), or None (failed for now: retry later). Marks the
    lease lost (and returns False) when the broker says it is gone."""
    out = yield Http(
        "PUT", f"{cfg.base}/leases/{s.lease_id}", {"ttl": ttl or s.ttl_s}, timeout=request_timeout
    )
    if isinstance(out, Reply) and out.status == 200:
        if s.active:
            s.renewed(out.sent, out.body)
        return True
    if isinstance(out, Reply):
        err = error_for(out, cfg.name)
        if isinstance(err, _GONE):
            s.mark_lost(f"the broker says it is gone: {out.message()}")
            return False
        if isinstance(err, _REFUSED):
            s.mark_lost(f"the broker refused the renewal: HTTP {out.status}: {out.message()}")
            return False
    s.renew_failures += 1
    return None


def release_steps(cfg: PoolConfig, s: LeaseState, was_lost: Optional[str]) -> Steps:
    """DELETE with retries for up to RELEASE_TIMEOUT_S. Raises LeaseLost when the lease was
    lost (by the broker's answer, or locally before), BackendUnavailable when unreachable."""
    try:
        yield from _release(cfg, s, was_lost)
    except BaseException as e:
        if s.span is not None:
            traces.lost(s, f"its release failed ({e}); it expires on the server")
        raise
    if s.span is not None:
        traces.released(s)


def _release(cfg: PoolConfig, s: LeaseState, was_lost: Optional[str]) -> Steps:
    clock, start, attempt = cfg.clock, cfg.clock(), 0
    while True:
        out = yield Http("DELETE", f"{cfg.base}/leases/{s.lease_id}", timeout=RELEASE_TIMEOUT_S)
        attempt += 1
        if isinstance(out, Reply) and out.status == 200:
            break
        if isinstance(out, Reply) and isinstance(error_for(out, cfg.name), _GONE):
            if was_lost is None:
                raise LeaseLost(
                    s.lease_id, f"the broker no longer had it at release: {out.message()}"
                )
            break
        if isinstance(out, Reply) and out.status not in (502, 503, 504):
            raise error_for(out, cfg.name)
        if clock() - start >= RELEASE_TIMEOUT_S:
            raise BackendUnavailable(
                f"pool {cfg.name!r}: could not release lease {s.lease_id[:8]}… "
                f"({out!r}); it expires after its ttl"
            )
        ra = out.retry_after() if isinstance(out, Reply) else None
        yield Sleep(jittered(ra, cfg.rng) if ra is not None else backoff(attempt, cfg.rng))
    if was_lost is not None:
        raise LeaseLost(s.lease_id, was_lost)


def heartbeat_plan(leases: List[LeaseState], now: float) -> tuple:
    """Which leases to renew now, and until when the heartbeat may sleep or block in one
    request (the earliest validity deadline, so ``on_lost`` fires on time)."""
    due = [s for s in leases if s.active and s.next_renew <= now]
    wake = now + 60.0
    for s in leases:
        if s.active:
            wake = min(wake, s.next_renew, s.valid_until)
    return due, wake


def request_budget(leases: List[LeaseState], now: float, cap: float = 10.0) -> float:
    """Read timeout for one renewal: it must return before any lease's validity deadline, so
    the heartbeat is free to mark that lease lost (and fire on_lost) on time."""
    deadlines = [s.valid_until for s in leases if s.active]
    return max(0.05, min([cap, *(d - now for d in deadlines)]))


def retry_later(s: LeaseState, now: float, rng: random.Random) -> None:
    """After a failed renewal: try again soon, but never after the deadline."""
    s.next_renew = min(
        now + 0.1 + backoff(s.renew_failures, rng, cap=1.0), max(now, s.valid_until - 0.01)
    )
