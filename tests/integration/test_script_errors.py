"""Redis errors inside the Lua scripts: a key of the wrong type planted under the pool's prefix,
and maxmemory reached (issue 5 item 4; SEMANTICS.md invariant 6: Redis does not roll back a script
that fails halfway, so a script must fail before its first write or not at all).

* Wrong type: every script checks the type of the pool's seven keys before anything else
  (``lua/lib.lua``), so it fails with ``GPULOCK_KEYTYPE <key> ...`` and writes nothing; the
  Python API raises BackendUnavailable naming the key. Without that check, reaping writes
  first and the script dies on the planted key later, leaving ``used`` out of step with the
  holder records (seen before the check was added).
* maxmemory with ``noeviction``: Redis 7.0 and Valkey 8 refuse a write that may grow memory
  inside a script (not flagged with a shebang) only while the script has written nothing yet
  (``scriptVerifyOOM``), so an OOM error can only come before the first write. A script either
  runs whole or fails with nothing written. ``renew`` starts with a write that cannot grow
  memory, so heartbeats and releases keep working when Redis is full while new grants fail
  with BackendUnavailable("... maxmemory ...").

Run on every server kind (Redis 7 and the embedded Valkey).
"""

from __future__ import annotations

import time

import pytest
import redis

from gpulock import AsyncPool, BackendUnavailable, GpuLockError, Pool
from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys
from support.pools import RAW_FORMS, check_consistent, raw, raw_acquire, raw_configure, snapshot


pytestmark = pytest.mark.timeout(60)

KEY_NAMES = ["cfg", "leases", "holders", "queue", "waiters", "wexp", "tickets"]


def _busy_pool(c: redis.Redis, pool: str) -> dict:
    """A pool where every script has work to do before it would reach a late key: an expired
    lease and a dead waiter to reap, a live holder, and a live waiter that fits once the
    expired lease is reaped."""
    raw_configure(c, pool, 100)
    raw_acquire(c, pool, 50, ticket="expiring", ttl_ms=100)
    g = raw_acquire(c, pool, 30, ticket="holder")
    raw_acquire(c, pool, 40, ticket="waiter")
    raw_acquire(c, pool, 10, ticket="deadwaiter", waiter_ttl_ms=100)
    time.sleep(0.15)
    return {"lid": g[1].decode(), "token": int(g[2])}


def _all_ops(h: dict) -> list[tuple[str, list]]:
    return [
        ("acquire", ["newticket", new_id(), 5, 5000, 5000, "wait", "{}", "test"]),
        ("acquire", ["newticket2", new_id(), 5, 5000, 5000, "try", "{}", "test"]),
        ("renew", [1, h["lid"], h["token"], 5000, 1, "waiter", 5000]),
        ("release", [h["lid"], h["token"]]),
        ("cancel", ["waiter"]),
        ("reap", []),
        ("status", [100]),
        ("configure", [200, 100, "set"]),
        ("configure", [200, 100, "create"]),
        ("external", ["sampler1", 3000, "report", 10, 5000, "[]"]),
    ]


@pytest.mark.parametrize("form", list(RAW_FORMS))
@pytest.mark.parametrize("which", KEY_NAMES)
def test_wrong_type_key_fails_before_any_write(redis_proc, rclient, which, form):
    pool = "wt"
    run = RAW_FORMS[form]
    if form == "function":
        run(rclient, "other", "reap")  # the library loaded before the snapshots
    h = _busy_pool(rclient, pool)
    key = pool_keys(pool)[KEY_NAMES.index(which)]
    rclient.delete(key)
    if which in ("queue", "tickets"):
        rclient.rpush(key, "planted")  # a list
    else:
        rclient.set(key, "planted")  # a string
    for op, argv in _all_ops(h):
        before = snapshot(rclient)
        with pytest.raises(redis.ResponseError) as ei:
            run(rclient, pool, op, *argv)
        msg = str(ei.value)
        assert msg.startswith("GPULOCK_KEYTYPE") and key in msg, (op, msg)
        assert snapshot(rclient) == before, f"{op} wrote before failing on the planted {which} key"

    # The Python API: a GpuLockError naming the key, nothing written (its cancel fails too).
    before = snapshot(rclient)
    with Pool.from_url(redis_proc.url, pool, capacity=100) as p:
        for call in (
            lambda: p.acquire(5, timeout=1),
            lambda: p.acquire(5, timeout=0),
            p.status,
            p.reap,
            lambda: p.configure(100),
        ):
            with pytest.raises(BackendUnavailable) as ei:
                call()
            assert key in str(ei.value) and "not a" in str(ei.value), str(ei.value)
    assert snapshot(rclient) == before


async def test_wrong_type_key_async(redis_proc, rclient):
    pool = "wta"
    _busy_pool(rclient, pool)
    key = pool_keys(pool)[5]
    rclient.delete(key)
    rclient.sadd(key, "planted")  # a set
    before = snapshot(rclient)
    p = AsyncPool.from_url(redis_proc.url, pool, capacity=100)
    try:
        for coro in (p.acquire(5, timeout=1), p.acquire(5, timeout=0), p.status(), p.reap()):
            with pytest.raises(BackendUnavailable, match="wexp"):
                await coro
    finally:
        await p.aclose()
    assert snapshot(rclient) == before
    # Removing the planted key repairs the pool: the scripts work again.
    rclient.delete(key)
    raw(rclient, pool, "reap")
    check_consistent(rclient, pool)


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_maxmemory_reached_fails_cleanly_or_runs_whole(redis_proc, rclient, form):
    """A script fails at its first write that may grow memory (only before any write); a
    function without the allow-oom flag is refused whole; those with it (release, renew,
    cancel, reap, status) run. Either way: whole, or nothing written."""
    pool = "oom"
    run = RAW_FORMS[form]
    if form == "function":
        run(rclient, "other", "reap")  # the library loaded before Redis is full
    h = _busy_pool(rclient, pool)
    rclient.config_set("maxmemory-policy", "noeviction")
    rclient.config_set("maxmemory", 1)  # every write that may grow memory is refused
    try:
        outcomes = []
        for op, argv in _all_ops(h):
            before = snapshot(rclient)
            try:
                run(rclient, pool, op, *argv)
                outcomes.append((op, "ran"))
            except redis.ResponseError as e:
                assert "maxmemory" in str(e), (op, str(e))
                assert snapshot(rclient) == before, f"{op} failed on OOM after writing"
                outcomes.append((op, "OOM"))
            check_consistent(rclient, pool)  # ran whole, or wrote nothing
        print(f"\nunder maxmemory ({form}s): {outcomes}")
        assert ("configure", "OOM") in outcomes  # its first write may grow memory: refused
        if form == "function":
            ran = {op for op, what in outcomes if what == "ran"}
            assert {"release", "renew", "cancel", "reap", "status"} <= ran, outcomes
        # Now nothing is left to reap: a new grant is refused before its first write.
        before = snapshot(rclient)
        with Pool.from_url(redis_proc.url, pool, capacity=100) as p:
            with pytest.raises(BackendUnavailable, match="maxmemory") as ei:
                p.acquire(1, timeout=0)
            assert isinstance(ei.value, GpuLockError)
        assert snapshot(rclient) == before
    finally:
        rclient.config_set("maxmemory", 0)
    check_consistent(rclient, pool)


def test_holders_keep_their_leases_while_redis_is_full(redis_proc, rclient):
    """A full Redis must not make every holder lose its lease: renewals (and releases) need no
    new memory, and go through."""
    pool = "full"
    with Pool.from_url(redis_proc.url, pool, capacity=100) as p:
        lease = p.acquire(60, ttl=0.6)
        lost = []
        lease.on_lost(lost.append)
        rclient.config_set("maxmemory-policy", "noeviction")
        rclient.config_set("maxmemory", 1)
        try:
            first = lease.expires_at
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2.0:  # > 3 ttls
                lease.ensure_valid()
                time.sleep(0.05)
            assert not lost and lease.expires_at > first + 1.0, (
                "renewals failed while Redis was full"
            )
            with pytest.raises(BackendUnavailable, match="maxmemory"):
                p.acquire(10, timeout=0)
            lease.release()  # a release frees memory: allowed
        finally:
            rclient.config_set("maxmemory", 0)
        assert check_consistent(rclient, pool) == {"used": 0, "leases": 0, "queued": 0}


def test_acquire_that_reaps_grants_nothing_in_a_grace_period(rclient):
    """The hot path reads the pool's counters once and again after a reap; the grace period
    (no grant until ``grace_until``) must hold on both paths. Found by the restart-grace
    fault test when the second read dropped ``grace_until``."""
    pool = "grace-reap"
    raw_configure(rclient, pool, 100)
    raw_acquire(rclient, pool, 50, ticket="expiring", ttl_ms=100)
    time.sleep(0.15)  # the lease's ttl passes: the next acquire reaps it
    rclient.hset(pool_keys(pool)[0], "grace_until", str(int(rclient.time()[0]) * 1000 + 60_000))
    r = raw_acquire(rclient, pool, 10, ticket="in-grace")
    assert int(r[0]) == 0, r  # queued, not granted
    st = raw(rclient, pool, "status", 10)
    assert int(st[3]) == 0 and int(st[7]) == 0 and int(st[8]) == 1, st  # nothing used or held
    rclient.hset(pool_keys(pool)[0], "grace_until", "0")
    r = raw_acquire(rclient, pool, 10, ticket="after-grace", mode="try")
    assert int(r[0]) == 2, r  # the queued one is ahead: not granted to a newcomer
    check_consistent(rclient, pool)
