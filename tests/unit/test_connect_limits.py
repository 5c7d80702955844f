"""Connecting from URLs (no I/O): a URL gpulock cannot use raises InvalidArgument naming it
and the accepted schemes, on every surface; and every client gpulock builds from a URL has a
*blocking* connection pool capped at ``max_connections``, so that a process with many waiters
queues for a connection instead of opening more (or failing with "Too many connections")."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelConnectionPool
from redis.sentinel import SentinelConnectionPool

from gpulock import AsyncPool, GpuLockError, InvalidArgument, Pool
from gpulock.transport.connect import DEFAULT_MAX_CONNECTIONS, async_client, sync_client


@pytest.mark.parametrize(
    "url",
    [
        "garbage",
        "http://h:6379/0",
        "redis://h:notaport/0",
        "redis+sentinel://h1:26379",
        "redis://h/0?max_connections=x",
        "",
    ],
)
@pytest.mark.parametrize("make", [Pool.from_url, AsyncPool.from_url], ids=["Pool", "AsyncPool"])
def test_a_bad_url_is_an_invalid_argument_naming_it(make, url):
    with pytest.raises(InvalidArgument) as ei:
        make(url, "gpu0")
    msg = str(ei.value)
    assert isinstance(ei.value, GpuLockError)
    assert repr(url) in msg
    for scheme in ("redis://", "rediss://", "unix://", "redis+sentinel://"):
        assert scheme in msg


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2@h:notaport/0",
        "redis+sentinel://:hunter2@h1,/svc",
        "redis+sentinel://u:hunter2@h1",
    ],
)
def test_a_bad_url_does_not_show_its_password(url):
    for make in (sync_client, async_client):
        with pytest.raises(InvalidArgument) as ei:
            make(url)
        assert "hunter2" not in str(ei.value)


URLS = [
    "redis://127.0.0.1:1/0",
    "rediss://127.0.0.1:1/0",
    "unix:///tmp/nothing-here.sock",
    "redis+sentinel://127.0.0.1:1/svc",
    "redis+sentinel://127.0.0.1:1/svc?ssl=true",
]


@pytest.mark.parametrize("url", URLS)
def test_clients_from_urls_have_a_bounded_blocking_pool(url):
    for c, blocking in (
        (sync_client(url), redis.BlockingConnectionPool),
        (async_client(url), aioredis.BlockingConnectionPool),
    ):
        assert isinstance(c.connection_pool, blocking), type(c.connection_pool)
        assert c.connection_pool.max_connections == DEFAULT_MAX_CONNECTIONS
    assert sync_client(url, max_connections=3).connection_pool.max_connections == 3
    assert async_client(url, max_connections=3).connection_pool.max_connections == 3


def test_sentinel_and_tls_keep_their_connection_classes():
    c = async_client("redis+sentinel://127.0.0.1:1/svc?ssl=true")
    assert "SentinelManagedSSLConnection" in c.connection_pool.connection_class.__name__
    assert isinstance(
        c.connection_pool, AsyncSentinelConnectionPool
    )  # asks the sentinels for the primary
    assert isinstance(
        sync_client("redis+sentinel://127.0.0.1:1/svc").connection_pool, SentinelConnectionPool
    )
    s = sync_client("rediss://127.0.0.1:1/0")
    assert issubclass(s.connection_pool.connection_class, redis.SSLConnection)


@pytest.mark.parametrize("bad", [0, 1, -3, 2.5, "8", True])
def test_max_connections_is_checked(bad):
    with pytest.raises(InvalidArgument, match="max_connections"):
        AsyncPool.from_url("redis://127.0.0.1:1/0", "gpu0", max_connections=bad)
    with pytest.raises(InvalidArgument, match="max_connections"):
        Pool.from_url("redis://127.0.0.1:1/0", "gpu0", max_connections=bad)
