"""Turn preemption on in a pool for a test, through configure.lua's ARGV 11 ("<gap>
<yield_grace_ms>") directly: the one place the tests set it, so it can become the library's own
setting (``Pool.configure(preemption=...)``) later without touching the tests that use it."""

from __future__ import annotations

import redis

from gpulock.protocol.keys import pool_key

from support.pools import raw


def set_preemption(client: redis.Redis, pool: str, gap: int, yield_grace_s: float) -> None:
    """Turn preemption on in ``pool`` (configured already): a queued request at the head that
    cannot fit asks holders of a priority at least ``gap`` lower to yield, within
    ``yield_grace_s`` seconds. The pool's capacity and queue bound stay as they are."""
    cfg = pool_key(pool, "cfg")
    capacity, max_waiters = client.hmget(cfg, "capacity", "max_waiters")
    assert capacity is not None, f"pool {pool!r} is not configured"
    setting = f"{gap} {round(yield_grace_s * 1000)}"
    reply = raw(
        client,
        pool,
        "configure",
        int(capacity),
        int(max_waiters or 10_000),
        "set",
        "",
        "0",
        "",
        "",
        "",
        "",
        "",
        setting,
    )
    got = reply[-1].decode() if isinstance(reply[-1], bytes) else reply[-1]
    assert got == setting, reply
