"""Sentinel URLs: parsed into sentinels, service, database and credentials; bad ones refused
with a message naming the bad part (no I/O)."""

from __future__ import annotations

import pytest

from gpulock._connect import SentinelURL, async_client, is_sentinel_url, sync_client


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

    from gpulock._connect import short_error

    e = MasterNotFoundError(
        "No master found for 'svc' : <redis.client.Redis(<...very long repr...>)> - x"
    )
    assert short_error(e).startswith("No master found for 'svc' (no sentinel answered")
    assert "repr" not in short_error(e)
    assert short_error(RedisConnectionError("Connection refused")) == "Connection refused"
