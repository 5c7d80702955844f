"""Turn preemption on for a pool in tests, the raw way: ``configure.lua``'s ARGV 11
(``"<gap> <yield_grace_ms>"``), keeping the pool's capacity and queue bound as the server has
them. One helper for every test that needs a preemptible pool."""

from __future__ import annotations

from typing import Any

import redis

from gpulock.protocol.keys import pool_keys

from support.pools import raw


def _client(pool_or_client: Any) -> redis.Redis:
    """A sync redis client: the object itself, or a sync ``Pool``'s ``redis``."""
    if isinstance(pool_or_client, redis.Redis):
        return pool_or_client
    c = getattr(pool_or_client, "redis", None)
    if not isinstance(c, redis.Redis):
        raise TypeError(f"need a redis.Redis or a sync Pool, got {type(pool_or_client).__name__}")
    return c


def enable_preemption(pool_or_client: Any, pool_name: str, gap: int, grace_s: float) -> str:
    """Turn preemption on in the existing pool ``pool_name``: a queued head whose priority is
    at least ``gap`` above a holder's asks it to yield within ``grace_s`` seconds (sent as
    whole ms). ``pool_or_client``: a ``redis.Redis`` or a sync ``Pool`` (its client). Returns
    the setting the server reports (``"<gap> <yield_grace_ms>"``).

    Raises AssertionError when the pool does not exist (configure would create it: a test
    must make it first, e.g. to keep a grace period), redis.ResponseError when the server
    refuses the values (GPULOCK_BADARG)."""
    c = _client(pool_or_client)
    cfg = c.hgetall(pool_keys(pool_name)[0])
    assert cfg, f"pool {pool_name!r} does not exist (make it before enabling preemption)"
    cap, maxw = int(cfg[b"capacity"]), int(cfg[b"max_waiters"])
    setting = f"{gap} {round(grace_s * 1000)}"
    # ARGV: capacity, max_waiters, 'set', max_ttl ('' unchanged), grace '0', policy,
    # backfill, quotas, devices, placement ('' unchanged), preempt
    r = raw(c, pool_name, "configure", cap, maxw, "set", "", "0", "", "", "", "", "", setting)
    got = r[12].decode() if isinstance(r[12], bytes) else r[12]
    assert got == setting, (got, setting)
    return got
