"""Preemption read and driven on a pool's raw keys (lua/lib.lua "Preemption"): acquire with its
preemption arguments, the yield marks of the tickets hash, a lease's token and grant ms, the
counters, and renew of leases, all without the code under test."""

from __future__ import annotations

from typing import Any, Callable

import redis

from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys

from support.pools import _s, raw

Call = Callable[..., Any]


def acquire(
    c: redis.Redis,
    pool: str,
    amount: int,
    prio: int,
    *,
    ticket: str | None = None,
    lid: str | None = None,
    ttl_ms: int = 600_000,
    wttl_ms: int = 600_000,
    mode: str = "wait",
    tenant: str = "",
    device: str = "",
    kind: str = "",
    preemptible: str = "",
    call: Call = raw,
) -> list:
    """acquire.lua with every argument (ARGV 1-13); channel 'm'."""
    return call(
        c,
        pool,
        "acquire",
        ticket or new_id(),
        lid or new_id(),
        amount,
        ttl_ms,
        wttl_ms,
        mode,
        "{}",
        "m",
        prio,
        tenant,
        device,
        kind,
        preemptible,
    )


def asked(c: redis.Redis, pool: str) -> dict[str, tuple[int, int]]:
    """lease id -> (asked_ms, deadline_ms) of every lease asked to yield (its y: field)."""
    out = {}
    for k, v in c.hgetall(pool_keys(pool)[6]).items():
        f = _s(k)
        if f.startswith("y:"):
            a, d = _s(v).split("|")
            out[f[2:]] = (int(a), int(d))
    return out


def holder(c: redis.Redis, pool: str, lid: str) -> tuple[int, int] | None:
    """(token, acquired_ms) of lease ``lid`` from its holder record; None when it is gone."""
    rec = c.hget(pool_keys(pool)[2], lid)
    if rec is None:
        return None
    f = _s(rec).split("|")
    return int(f[1]), int(f[2])


def lease_of(c: redis.Redis, pool: str, ticket: str) -> str | None:
    """The lease id ticket ``ticket`` holds, or None."""
    v = c.hget(pool_keys(pool)[6], ticket)
    return None if v is None else _s(v)


def counters(c: redis.Redis, pool: str) -> dict[str, int]:
    """y_asked, y_done, y_done_ms, y_taken (0 when absent)."""
    names = ("y_asked", "y_done", "y_done_ms", "y_taken")
    return {n: int(v or 0) for n, v in zip(names, c.hmget(pool_keys(pool)[0], *names))}


def release(c: redis.Redis, pool: str, lid: str, call: Call = raw) -> list:
    """release.lua of lease ``lid`` with its own token."""
    h = holder(c, pool, lid)
    assert h is not None, lid
    return call(c, pool, "release", lid, h[0])


def renew(
    c: redis.Redis,
    pool: str,
    leases: list[tuple[str, int, int]],
    tickets: list[tuple[str, int]] = (),  # type: ignore[assignment]
    call: Call = raw,
) -> list:
    """renew.lua of (lease id, token, ttl_ms) triples and (ticket, waiter_ttl_ms) pairs."""
    args: list[Any] = [len(leases)]
    for lid, tok, ttl in leases:
        args += [lid, tok, ttl]
    args.append(len(tickets))
    for t, w in tickets:
        args += [t, w]
    return call(c, pool, "renew", *args)
