"""Redis clients from URLs: plain ``redis://``/``rediss://``/``unix://`` (redis-py's own
``from_url``), and Redis Sentinel.

A Sentinel URL names the sentinels and the monitored service; the client asks them for the
current primary and asks again after a failover (redis-py's ``Sentinel.master_for``)::

    redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?OPTIONS]

``sentinel://`` is accepted as the same. USER/PASSWORD authenticate to the Redis servers
(the primary); OPTIONS: ``sentinel_username``/``sentinel_password`` (to the sentinels, if
they require it), ``ssl=true`` (TLS to the Redis servers). Ports default to 26379, the
sentinels' port. Writes after a failover may fail once with a connection error while the
client learns the new primary; gpulock's retries (``backend_timeout``) cover that.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis

SENTINEL_SCHEMES = ("redis+sentinel", "sentinel")
DEFAULT_SENTINEL_PORT = 26379


class SentinelURL:
    """A parsed Sentinel URL (see the module docstring). Raises ValueError naming the bad part."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in SENTINEL_SCHEMES:
            raise ValueError(f"not a Sentinel URL (scheme {parts.scheme!r}): expected redis+sentinel://")
        netloc = parts.netloc
        creds, _, hosts = netloc.rpartition("@")
        self.username: str | None = None
        self.password: str | None = None
        if creds:
            user, sep, pw = creds.partition(":")
            self.username = unquote(user) or None
            self.password = unquote(pw) if sep else None
        self.sentinels: list[tuple[str, int]] = []
        for hp in hosts.split(","):
            host, sep, port = hp.strip().rpartition(":") if ":" in hp else (hp.strip(), "", "")
            if not host:
                raise ValueError(f"Sentinel URL {url!r}: empty host in {hosts!r}")
            try:
                self.sentinels.append((host, int(port) if sep else DEFAULT_SENTINEL_PORT))
            except ValueError:
                raise ValueError(f"Sentinel URL: bad port {port!r} in {hp!r}") from None
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ValueError(f"Sentinel URL {_redact(url)!r} names no service: add /SERVICE after the hosts")
        self.service = unquote(path[0])
        try:
            self.db = int(path[1]) if len(path) > 1 else 0
        except ValueError:
            raise ValueError(f"Sentinel URL: bad database number {path[1]!r}") from None
        q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(q) - {"sentinel_username", "sentinel_password", "ssl"}
        if unknown:
            raise ValueError(f"Sentinel URL: unknown option(s) {sorted(unknown)}")
        self.sentinel_kwargs: dict[str, Any] = {}
        if "sentinel_username" in q:
            self.sentinel_kwargs["username"] = q["sentinel_username"]
        if "sentinel_password" in q:
            self.sentinel_kwargs["password"] = q["sentinel_password"]
        self.ssl = q.get("ssl", "false").lower() in ("1", "true", "yes")

    def master_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        kw = dict(defaults)
        kw["db"] = self.db
        if self.username:
            kw["username"] = self.username
        if self.password is not None:
            kw["password"] = self.password
        if self.ssl:
            kw["ssl"] = True
        return kw

    def sentinel_connection_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """Socket settings for the connections to the sentinels themselves."""
        kw = {k: v for k, v in defaults.items() if k in ("socket_timeout", "socket_connect_timeout")}
        return {**kw, **self.sentinel_kwargs}


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return url.replace(parts.netloc, "***@" + parts.netloc.rpartition("@")[2], 1)


def short_error(exc: BaseException) -> str:
    """A Redis error's message for people: redis-py's ``MasterNotFoundError`` ends with the
    repr of every sentinel client it asked (hundreds of characters); this keeps its head and
    says what it means."""
    from redis.sentinel import MasterNotFoundError

    if isinstance(exc, MasterNotFoundError):
        return (str(exc).split(" : ", 1)[0] + " (no sentinel answered, or none knows that service's "
                "primary; check the Sentinel URL's hosts and service name)")
    return str(exc)


def is_sentinel_url(url: str) -> bool:
    return urlsplit(url).scheme in SENTINEL_SCHEMES


def sync_client(url: str, **defaults: Any) -> redis.Redis:
    """A ``redis.Redis`` for ``url`` (plain or Sentinel). No I/O here."""
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **defaults)
    from redis.sentinel import Sentinel

    su = SentinelURL(url)
    s = Sentinel(su.sentinels, sentinel_kwargs=su.sentinel_connection_kwargs(defaults))
    return s.master_for(su.service, **su.master_kwargs(defaults))


def async_client(url: str, **defaults: Any) -> aioredis.Redis:
    """A ``redis.asyncio.Redis`` for ``url`` (plain or Sentinel). No I/O here."""
    if not is_sentinel_url(url):
        return aioredis.from_url(url, **defaults)
    from redis.asyncio.sentinel import Sentinel

    su = SentinelURL(url)
    s = Sentinel(su.sentinels, sentinel_kwargs=su.sentinel_connection_kwargs(defaults))
    return s.master_for(su.service, **su.master_kwargs(defaults))
