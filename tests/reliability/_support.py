"""Helpers of the reliability tests (not collected by pytest)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

import redis

from gpulock._keys import pool_keys


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def check_consistent(c: redis.Redis, pool: str) -> dict[str, int]:
    """Every structure of a pool agrees with the others (read on the raw keys, not through
    the code under test): ``used`` is the sum of the holder records, every lease has a holder
    record and the other way round, every queued ticket has a waiter record and an expiry,
    and every ticket grant points at a live holder. Returns the counts."""
    k = pool_keys(pool)
    cfg = {_s(a): _s(b) for a, b in c.hgetall(k[0]).items()}
    holders = {_s(a): _s(b) for a, b in c.hgetall(k[2]).items()}
    leases = {_s(m) for m in c.zrange(k[1], 0, -1)}
    queue = {_s(m) for m in c.zrange(k[3], 0, -1)}
    waiters = {_s(m) for m in c.hkeys(k[4])}
    wexp = {_s(m) for m in c.zrange(k[5], 0, -1)}
    tickets = {_s(a): _s(b) for a, b in c.hgetall(k[6]).items()}
    total = sum(int(v.split("|", 1)[0]) for v in holders.values())
    assert int(cfg.get("used", 0)) == total, (cfg.get("used"), total)
    assert leases == set(holders), (leases, set(holders))
    assert queue == waiters == wexp, (queue, waiters, wexp)
    assert set(tickets.values()) <= set(holders), (tickets, set(holders))
    return {"used": total, "leases": len(holders), "queued": len(queue)}


def wait_for(pred: Callable[[], Any], timeout: float = 10.0, every: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(every)


def server_us(c: redis.Redis) -> int:
    s, us = c.time()
    return int(s) * 1_000_000 + int(us)


def proc_state(pid: int) -> str:
    """One letter of /proc/PID/stat: R, S, T (stopped), Z (zombie), ...; "" when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def max_concurrent(intervals: list[tuple[int, int, int]]) -> tuple[int, int]:
    """Largest sum of amounts held at one instant over half-open intervals [start, end) (a
    release at t frees before a grant at t takes), and that instant."""
    events = []
    for start, end, amount in intervals:
        if end < start:
            continue
        events.append((start, 1, amount))
        events.append((end, 0, -amount))
    events.sort()
    held = peak = at = 0
    for t, _, d in events:
        held += d
        if held > peak:
            peak, at = held, t
    return peak, at
