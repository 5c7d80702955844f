"""Factories for pools bound to the per-test Redis server (closed at teardown)."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis

from gpulock import AsyncPool, Pool


@pytest.fixture
async def make_apool(redis_proc, pool_name):
    made = []

    def make(name: str | None = None, **kw) -> AsyncPool:
        client = aioredis.Redis.from_url(redis_proc.url, socket_timeout=5, socket_connect_timeout=2)
        p = AsyncPool(client, name or pool_name, **kw)
        made.append((p, client))
        return p

    yield make
    for p, client in made:
        await p.aclose()
        await client.aclose()


@pytest.fixture
def make_pool(redis_proc, pool_name):
    made = []

    def make(name: str | None = None, **kw) -> Pool:
        client = redis.Redis.from_url(redis_proc.url, socket_timeout=5, socket_connect_timeout=2)
        p = Pool(client, name or pool_name, **kw)
        made.append((p, client))
        return p

    yield make
    for p, client in made:
        p.close()
        client.close()
