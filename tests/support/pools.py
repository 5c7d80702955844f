"""A pool's raw Redis keys, read and checked without the code under test: a type-aware snapshot
of every gpulock key, direct calls of the Lua scripts (bypassing the Python validation), the
pool's counters, the emptiness and consistency checks, and the server's clock."""

from __future__ import annotations

import re
import time

from typing import Any

import redis

from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys
from gpulock.transport.scripts import library, scripts

GiB = 1 << 30
MiB = 1 << 20


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def snapshot(client: redis.Redis, pattern: str = "gpulock:*") -> dict[str, tuple]:
    """Every key matching ``pattern`` with its type, full content and ttl, read type-aware so
    two snapshots compare equal exactly when the data is the same."""
    out: dict[str, tuple] = {}
    for k in sorted(client.scan_iter(match=pattern, count=1000)):
        key = _s(k)
        t = _s(client.type(k))
        if t == "string":
            v: Any = client.get(k)
        elif t == "hash":
            v = sorted(client.hgetall(k).items())
        elif t == "zset":
            v = client.zrange(k, 0, -1, withscores=True)
        elif t == "list":
            v = client.lrange(k, 0, -1)
        elif t == "set":
            v = sorted(client.smembers(k))
        else:
            v = client.dump(k)
        out[key] = (t, v, client.pttl(k))
    return out


def raw(client: redis.Redis, pool: str, op: str, *argv: Any) -> Any:
    """Run one gpulock script directly (EVAL of the full source), with raw ARGV."""
    sc = scripts()[op]
    keys = pool_keys(pool)
    return client.eval(sc.source, len(keys), *keys, *[str(a) for a in argv])


def raw_fcall(client: redis.Redis, pool: str, op: str, *argv: Any) -> Any:
    """Run one gpulock operation directly as a function of the library (``FCALL``; the
    library is loaded first if the server lacks it), with raw ARGV."""
    sc = scripts()[op]
    keys = pool_keys(pool)
    args = [str(a) for a in argv]
    try:
        return client.fcall(sc.function, len(keys), *keys, *args)
    except redis.ResponseError as e:
        if "function not found" not in str(e).lower():
            raise
    client.function_load(library().code, replace=True)
    return client.fcall(sc.function, len(keys), *keys, *args)


#: The two forms of every operation (gpulock/transport/scripts.py): a script, a function.
RAW_FORMS = {"script": raw, "function": raw_fcall}


def raw_configure(client: redis.Redis, pool: str, capacity: int, max_waiters: int = 1000) -> list:
    return raw(client, pool, "configure", capacity, max_waiters, "set")


def raw_acquire(
    client: redis.Redis,
    pool: str,
    amount: int,
    *,
    ticket: str | None = None,
    lease_id: str | None = None,
    ttl_ms: int = 60_000,
    waiter_ttl_ms: int = 600_000,
    mode: str = "wait",
    meta: str = "{}",
    channel: str = "test",
    priority: int | None = None,
) -> list:
    extra = [] if priority is None else [priority]
    return raw(
        client,
        pool,
        "acquire",
        ticket or new_id(),
        lease_id or new_id(),
        amount,
        ttl_ms,
        waiter_ttl_ms,
        mode,
        meta,
        channel,
        *extra,
    )


def config(client: redis.Redis, pool: str) -> dict[str, int]:
    """The integer fields of the pool's config hash (capacity, used, epoch, ...)."""
    raw = client.hgetall(pool_keys(pool)[0])
    return {_s(k): int(v) for k, v in raw.items() if _s(v).lstrip("-").isdigit()}


def used(client: redis.Redis, pool: str) -> int:
    return config(client, pool).get("used", 0)


def holder_tokens(client: redis.Redis, pool: str) -> dict[str, int]:
    """lease id -> fencing token, from the raw holder records."""
    return {_s(k): int(_s(v).split("|")[1]) for k, v in client.hgetall(pool_keys(pool)[2]).items()}


def server_ms(client: redis.Redis) -> float:
    """The server's clock (``TIME``) in milliseconds, to the microsecond."""
    s, us = client.time()
    return int(s) * 1000 + int(us) / 1000


def server_us(client: redis.Redis) -> int:
    """The server's clock (``TIME``) in microseconds."""
    s, us = client.time()
    return int(s) * 1_000_000 + int(us)


def assert_empty(client: redis.Redis, pool: str) -> None:
    """Nothing held and nothing queued, checked on the raw keys (not only the counter)."""
    k = pool_keys(pool)
    assert used(client, pool) == 0
    assert client.zcard(k[1]) == 0, "leases left"
    assert client.hlen(k[2]) == 0, "holders left"
    assert client.zcard(k[3]) == 0, "queue not empty"
    assert client.hlen(k[4]) == 0, "waiter records left"
    assert client.zcard(k[5]) == 0, "waiter expiries left"
    assert client.hlen(k[6]) == 0, "ticket grants left"


class AmountsDisagree(AssertionError):
    """A lease's ``amount`` on the client is not its amount on the server (its holder
    record); raised by tests, so that an xfail can name exactly this failure."""


#: The fields the tickets hash keeps per lease next to ``ticket -> lease id``: its place
#: (lua/lib.lua lease_place), its preemption field and its yield mark (lua/lib.lua "Preemption").
LEASE_FIELD_PREFIXES = ("place:", "pr:", "y:")


def is_lease_field(field: str) -> bool:
    """Whether a tickets-hash field is one of a lease's own (:data:`LEASE_FIELD_PREFIXES`)."""
    return field.startswith(LEASE_FIELD_PREFIXES)


def ticket_grants(fields: dict[str, str]) -> dict[str, str]:
    """The ``ticket -> lease id`` entries of a tickets hash read as text, without the per-lease
    fields."""
    return {t: v for t, v in fields.items() if not is_lease_field(t)}


def check_consistent(c: redis.Redis, pool: str) -> dict[str, int]:
    """Every structure of a pool agrees with the others (read on the raw keys, not through
    the code under test): ``used`` is the sum of the holder records, every lease has a holder
    record and the other way round, every queued ticket has a waiter record and an expiry,
    and every ticket grant and lease place points at a live holder. Returns the counts."""
    k = pool_keys(pool)
    cfg = {_s(a): _s(b) for a, b in c.hgetall(k[0]).items()}
    holders = {_s(a): _s(b) for a, b in c.hgetall(k[2]).items()}
    leases = {_s(m) for m in c.zrange(k[1], 0, -1)}
    queue = {_s(m) for m in c.zrange(k[3], 0, -1)}
    waiters = {_s(m) for m in c.hkeys(k[4])}
    wexp = {_s(m) for m in c.zrange(k[5], 0, -1)}
    tickets = {_s(a): _s(b) for a, b in c.hgetall(k[6]).items()}
    # a lease's place (lua/lib.lua lease_place) and its preemption fields (lua/lib.lua
    # "Preemption") are kept for a live lease only
    per_lease = {t.split(":", 1)[1] for t in tickets if is_lease_field(t)}
    tickets = ticket_grants(tickets)
    assert per_lease <= set(holders), (per_lease, set(holders))
    asked = {t[2:] for t in tickets if t.startswith("y:")}
    assert asked <= {t[3:] for t in tickets if t.startswith("pr:")}, asked
    total = sum(int(v.split("|", 1)[0]) for v in holders.values())
    assert int(cfg.get("used", 0)) == total, (cfg.get("used"), total)
    assert leases == set(holders), (leases, set(holders))
    assert queue == waiters == wexp, (queue, waiters, wexp)
    assert set(tickets.values()) <= set(holders), (tickets, set(holders))
    # Tenants (lua/lib.lua "Tenant quotas"): tused:<tenant> is the sum of that tenant's holder
    # records (absent at 0), and nquotas counts the quota fields.
    by_tenant: dict[str, int] = {}
    for v in holders.values():
        parts = v.split("|")
        if len(parts) >= 7 and re.fullmatch(r"[A-Za-z0-9._:-]+", parts[5]):
            by_tenant[parts[5]] = by_tenant.get(parts[5], 0) + int(parts[0])
    tused = {f[6:]: int(v) for f, v in cfg.items() if f.startswith("tused:")}
    assert tused == by_tenant, (tused, by_tenant)
    nq = sum(1 for f in cfg if f.startswith("quota:"))
    assert int(cfg.get("nquotas", 0)) == nq, (cfg.get("nquotas"), nq)
    # Devices (lua/lib.lua "Devices"): on a pool of several, dused:<i> is the sum of the holder
    # records on device i and never more than dcap:<i>; capacity is the sum of the dcap:<i>.
    n = int(cfg.get("devices", 0))
    if n >= 2:
        by_dev = [0] * n
        for v in holders.values():
            parts = v.split("|")
            # every lease is on a device (the index, then 'r' for a resident lease)
            assert len(parts) >= 8 and re.fullmatch(r"\d+r?", parts[6]), v
            by_dev[int(parts[6].rstrip("r"))] += int(parts[0])
        dused = [int(cfg.get(f"dused:{i}", 0)) for i in range(n)]
        dcap = [int(cfg[f"dcap:{i}"]) for i in range(n)]
        assert dused == by_dev, (dused, by_dev)
        assert sum(dcap) == int(cfg["capacity"]), (dcap, cfg["capacity"])
    else:
        assert not [f for f in cfg if f.startswith(("dcap:", "dused:", "dres:"))], cfg
    # Resident leases (lua/lib.lua "Resident leases"): resident, tres:<tenant> and dres:<i> are
    # the sums of the resident holder records (device field ending in 'r'), rqueued of the
    # resident waiter records (absent at 0).
    res_total, res_tenant, res_dev = 0, {}, {}
    for v in holders.values():
        parts = v.split("|")
        if len(parts) >= 8 and re.fullmatch(r"\d*r", parts[6]):
            a = int(parts[0])
            res_total += a
            if parts[5]:
                res_tenant[parts[5]] = res_tenant.get(parts[5], 0) + a
            if parts[6] != "r":
                res_dev[int(parts[6][:-1])] = res_dev.get(int(parts[6][:-1]), 0) + a
    assert int(cfg.get("resident", 0)) == res_total, (cfg.get("resident"), res_total)
    tres = {f[5:]: int(v) for f, v in cfg.items() if f.startswith("tres:")}
    assert tres == res_tenant, (tres, res_tenant)
    dres = {int(f[5:]): int(v) for f, v in cfg.items() if f.startswith("dres:")}
    assert dres == res_dev, (dres, res_dev)
    queued_res = queued_grow = 0
    for v in c.hvals(k[4]):
        parts = _s(v).split("|")
        if len(parts) >= 9 and re.fullmatch(r"\d*r", parts[7]):
            queued_res += int(parts[0])
        if len(parts) >= 9 and re.fullmatch(r"\d*g", parts[7]):
            queued_grow += 1
    assert int(cfg.get("rqueued", 0)) == queued_res, (cfg.get("rqueued"), queued_res)
    # Growths (lua/lib.lua "Leases that wait to grow"): gqueued counts the growth waiter
    # records (device field ending in 'g'), absent at 0.
    assert int(cfg.get("gqueued", 0)) == queued_grow, (cfg.get("gqueued"), queued_grow)
    return {"used": total, "leases": len(holders), "queued": len(queue)}


async def status_once(url: str, pool: str) -> Any:
    """Pool ``pool``'s status at ``url``, read once through a fresh AsyncPool (no leases
    listed)."""
    from gpulock import AsyncPool

    p = AsyncPool.from_url(url, pool)
    try:
        return await p.status(limit=0)
    finally:
        await p.aclose()


async def status_until(url: str, pool: str, pred: Any, timeout: float = 10.0) -> Any:
    """Read pool ``pool``'s status at ``url`` (through a fresh AsyncPool) until ``pred(status)``
    holds, and return that status; fails after ``timeout`` seconds naming the last one."""
    import asyncio
    import time

    from gpulock import AsyncPool

    p = AsyncPool.from_url(url, pool)
    try:
        deadline = time.monotonic() + timeout
        while True:
            st = await p.status()
            if pred(st):
                return st
            assert time.monotonic() < deadline, f"pool {pool}: not met within {timeout}s: {st}"
            await asyncio.sleep(0.01)
    finally:
        await p.aclose()


def settle(client: redis.Redis) -> None:
    """Return once Redis has run every command a stopped or killed client had already written
    (instead of sleeping and hoping): on loopback a send lands in the server's socket buffer at
    once, and Redis handles every readable connection of an event-loop turn before it answers
    a command that arrived later, so two round trips on our own connection are enough."""
    client.ping()
    client.ping()


def lease_expiries_ms(client: redis.Redis, pool: str, lease_ids: list[str]) -> dict[str, float]:
    """lease id -> its expiry on the server (Unix ms, the server's clock), exactly as Redis
    keeps it; a lease no longer there is left out."""
    scores = client.zmscore(pool_keys(pool).leases, lease_ids) if lease_ids else []
    return {lid: float(s) for lid, s in zip(lease_ids, scores) if s is not None}


def monotonic_of_wall(tight_s: float = 0.001, timeout: float = 30.0) -> float:
    """The offset to add to a wall-clock instant (``time.time()`` seconds: CLOCK_REALTIME, the
    clock Redis ``TIME`` reads on this host) to get the earliest ``time.monotonic()`` instant
    it can be. Read as monotonic, wall, monotonic, again until the two monotonic reads lie at
    most ``tight_s`` apart (a process descheduled between them widens the bracket; this waits
    for a read that was not), so the offset is exact to ``tight_s``, and never late: a
    deadline compared with it is compared with the earliest instant the other could be.
    Raises AssertionError when no such read came within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m1 = time.monotonic()
        w = time.time()
        m2 = time.monotonic()
        if m2 - m1 <= tight_s:
            return m1 - w
        if m2 > deadline:
            raise AssertionError(f"no clock read within {tight_s}s in {timeout}s")
