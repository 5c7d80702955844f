"""Sentinel URLs: parsed into sentinels, service, database and credentials; bad ones refused
with a message naming the bad part (no I/O)."""

from __future__ import annotations

import pytest

from gpulock.transport.connect import SentinelURL, async_client, is_sentinel_url, sync_client


def test_sentinel_url_parts():
    u = SentinelURL(
        "redis+sentinel://app:s3cr%40t@h1:26380,h2,10.0.0.3:5000/gpu-redis/2"
        "?sentinel_password=sp&ssl=true"
    )
    assert u.sentinels == [("h1", 26380), ("h2", 26379), ("10.0.0.3", 5000)]
    assert (u.service, u.db, u.username, u.password, u.ssl) == (
        "gpu-redis",
        2,
        "app",
        "s3cr@t",
        True,
    )
    assert u.sentinel_connection_kwargs({"socket_timeout": 5.0, "health_check_interval": 10}) == {
        "socket_timeout": 5.0,
        "password": "sp",
    }
    kw = u.master_kwargs({"socket_timeout": 5.0})
    assert kw == {
        "socket_timeout": 5.0,
        "db": 2,
        "username": "app",
        "password": "s3cr@t",
        "ssl": True,
    }
    assert SentinelURL("sentinel://:pw@h/svc").password == "pw"
    assert is_sentinel_url("redis+sentinel://h/s") and not is_sentinel_url("redis://h:6379/0")


@pytest.mark.parametrize(
    "url, part",
    [
        ("redis+sentinel://h1:26379", "names no service"),
        ("redis+sentinel://h1:x/svc", "bad port 'x'"),
        ("redis+sentinel://h1/svc/zero", "bad database number 'zero'"),
        ("redis+sentinel://h1/svc?timeout=3", "unknown option"),
        ("redis+sentinel://:pw@h1,/svc", "empty host"),
    ],
)
def test_bad_sentinel_urls_name_the_bad_part(url, part):
    with pytest.raises(ValueError, match=part):
        SentinelURL(url)


def test_clients_are_built_without_io():
    c = sync_client(
        "redis+sentinel://127.0.0.1:1/svc", socket_timeout=1.0
    )  # nothing listens on port 1
    assert "SentinelConnectionPool" in type(c.connection_pool).__name__
    a = async_client("redis+sentinel://127.0.0.1:1/svc", socket_timeout=1.0)
    assert "SentinelConnectionPool" in type(a.connection_pool).__name__
    assert (
        type(sync_client("redis://127.0.0.1:1/0").connection_pool).__name__
        == "BlockingConnectionPool"
    )


def test_short_error_keeps_the_head_of_a_sentinel_error():
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.sentinel import MasterNotFoundError

    from gpulock.transport.connect import short_error

    e = MasterNotFoundError(
        "No master found for 'svc' : <redis.client.Redis(<...very long repr...>)> - x"
    )
    assert short_error(e).startswith("No master found for 'svc' (no sentinel answered")
    assert "repr" not in short_error(e)
    assert short_error(RedisConnectionError("Connection refused")) == "Connection refused"


def test_an_asyncio_client_like_a_sync_one_carries_the_shared_settings_only():
    import redis
    import redis.asyncio as aioredis
    from redis.sentinel import Sentinel

    from gpulock.transport.connect import async_client_like

    tls = redis.Redis(
        host="h",
        port=6380,
        db=3,
        password="pw",
        socket_timeout=4.0,
        ssl=True,
        ssl_ca_certs="/ca.crt",
        ssl_validate_ocsp=True,  # the sync class's only: it must not reach the asyncio one
    )
    a = async_client_like(tls, max_connections=3)
    pool = a.connection_pool
    assert isinstance(pool, aioredis.BlockingConnectionPool) and pool.max_connections == 3
    assert pool.connection_class is aioredis.SSLConnection
    kw = pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"], kw["password"], kw["socket_timeout"]) == (
        "h",
        6380,
        3,
        "pw",
        4.0,
    )
    assert kw["ssl_ca_certs"] == "/ca.crt" and "ssl_validate_ocsp" not in kw
    assert pool.timeout == 4.0  # waits for a free connection up to the socket timeout
    unix = async_client_like(redis.Redis(unix_socket_path="/tmp/r.sock"), max_connections=2)
    assert unix.connection_pool.connection_class is aioredis.UnixDomainSocketConnection
    assert unix.connection_pool.connection_kwargs["path"] == "/tmp/r.sock"
    managed = Sentinel([("s1", 26379)], sentinel_kwargs={"password": "sp"}).master_for(
        "gl", socket_timeout=2.0, password="pw"
    )
    am = async_client_like(managed, max_connections=2)
    assert am.connection_pool.service_name == "gl"
    assert am.connection_pool.connection_kwargs["password"] == "pw"
    assert [
        (c.connection_pool.connection_kwargs["host"], c.connection_pool.connection_kwargs["port"])
        for c in am.connection_pool.sentinel_manager.sentinels
    ] == [("s1", 26379)]


@pytest.mark.parametrize("client", [object(), None], ids=["no-connection-pool", "none"])
def test_a_client_without_a_connection_pool_is_refused(client):
    from gpulock.transport.connect import check_supported_client
    from gpulock.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"or a redis\.cluster\.RedisCluster, not a"):
        check_supported_client(client)
