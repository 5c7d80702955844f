"""Helpers shared by the unit and integration tests: a type-aware snapshot of every gpulock
key, direct calls of the Lua scripts (bypassing the Python validation), and small waits."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import redis

from gpulock._protocol import new_id
from gpulock._keys import pool_keys
from gpulock._scripts import scripts

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
) -> list:
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
    )


def cfg(client: redis.Redis, pool: str) -> dict[str, int]:
    return {_s(k): int(v) for k, v in client.hgetall(pool_keys(pool)[0]).items()}


def used(client: redis.Redis, pool: str) -> int:
    return cfg(client, pool).get("used", 0)


def server_ms(client: redis.Redis) -> int:
    s, us = client.time()
    return int(s) * 1000 + int(us) // 1000


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


def consistent(client: redis.Redis, pool: str) -> None:
    """The running ``used`` equals the sum of the amounts of the holder records, and every
    lease has a holder record."""
    k = pool_keys(pool)
    holders = client.hgetall(k[2])
    total = sum(int(_s(v).split("|", 1)[0]) for v in holders.values())
    assert used(client, pool) == total
    assert client.zcard(k[1]) == len(holders)


def wait_until(pred: Callable[[], Any], timeout: float = 5.0, interval: float = 0.005) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


async def async_wait_until(
    pred: Callable[[], Any], timeout: float = 5.0, interval: float = 0.005
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)


class Running:
    """``async with Running(app) as client``: the app's lifespan entered (GpuLimiter started)
    and an httpx client on it in-process (ASGITransport); both closed on exit."""

    def __init__(self, app: Any):
        self.app = app

    async def __aenter__(self) -> Any:
        import httpx

        self._cm = self.app.router.lifespan_context(self.app)
        await self._cm.__aenter__()
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app), base_url="http://t", timeout=30
        )
        return self.client

    async def __aexit__(self, *exc: Any) -> None:
        await self.client.aclose()
        await self._cm.__aexit__(*exc)
