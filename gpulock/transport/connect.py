"""Redis clients from URLs: plain ``redis://``/``rediss://``/``unix://`` (redis-py's own
``from_url``), Redis Sentinel, and Redis Cluster (``redis+cluster://``, or a plain URL of any
cluster node: :mod:`gpulock.transport.cluster`).

A Sentinel URL names the sentinels and the monitored service; the client asks them for the
current primary and asks again after a failover (redis-py's ``Sentinel.master_for``)::

    redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?OPTIONS]

``sentinel://`` is accepted as the same. USER/PASSWORD authenticate to the Redis servers
(the primary); OPTIONS: ``sentinel_username``/``sentinel_password`` (to the sentinels, if
they require it), ``ssl=true`` (TLS to the Redis servers). Ports default to 26379, the
sentinels' port. Writes after a failover may fail once with a connection error while the
client learns the new primary; gpulock's retries (``backend_timeout``) cover that.

**Connections.** Every client built here has a *blocking* connection pool of at most
``max_connections`` connections (default :data:`DEFAULT_MAX_CONNECTIONS`, 16; at least 2,
since a pool object's hand-off subscription keeps one): a call that finds them all busy waits
for one (up to the socket timeout, then a connection error that gpulock's retries cover)
instead of opening another. A waiting acquire holds no connection, so a process with 10,000
waiters needs no more connections than one with 10. The URL's own ``?max_connections=N``
(any scheme, Sentinel included) wins over the argument, as in redis-py. Connections to the
sentinels themselves (discovery only) are not counted.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelConnectionPool
from redis.sentinel import SentinelConnectionPool

from gpulock.transport.urls import auth_kwargs, credentials_and_hosts
from gpulock.errors import BackendUnavailable, InvalidArgument

SENTINEL_SCHEMES = ("redis+sentinel", "sentinel")
DEFAULT_SENTINEL_PORT = 26379
#: Connections one client built here opens at most (``max_connections``'s default).
DEFAULT_MAX_CONNECTIONS = 16
#: Seconds a call waits for a free connection when none is given by ``socket_timeout``.
DEFAULT_POOL_WAIT_S = 5.0
ACCEPTED_SCHEMES = (
    "redis://, rediss://, unix://, redis+sentinel:// (also sentinel://) or "
    "redis+cluster:// (also rediss+cluster://)"
)


class SentinelURL:
    """A parsed Sentinel URL (see the module docstring). Raises ValueError naming the bad part."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in SENTINEL_SCHEMES:
            raise ValueError(
                f"not a Sentinel URL (scheme {parts.scheme!r}): expected redis+sentinel://"
            )
        try:
            self.username, self.password, self.sentinels = credentials_and_hosts(
                parts.netloc, DEFAULT_SENTINEL_PORT
            )
        except ValueError as e:
            raise ValueError(f"Sentinel URL {_redact(url)!r}: {e}") from None
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ValueError(
                f"Sentinel URL {_redact(url)!r} names no service: add /SERVICE after the hosts"
            )
        self.service = unquote(path[0])
        try:
            self.db = int(path[1]) if len(path) > 1 else 0
        except ValueError:
            raise ValueError(f"Sentinel URL: bad database number {path[1]!r}") from None
        q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(q) - {"sentinel_username", "sentinel_password", "ssl", "max_connections"}
        if unknown:
            raise ValueError(f"Sentinel URL: unknown option(s) {sorted(unknown)}")
        self.sentinel_kwargs: dict[str, Any] = {}
        if "sentinel_username" in q:
            self.sentinel_kwargs["username"] = q["sentinel_username"]
        if "sentinel_password" in q:
            self.sentinel_kwargs["password"] = q["sentinel_password"]
        self.ssl = q.get("ssl", "false").lower() in ("1", "true", "yes")

    def master_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        return auth_kwargs({**defaults, "db": self.db}, self.username, self.password, self.ssl)

    def sentinel_connection_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """Socket settings for the connections to the sentinels themselves."""
        kw = {
            k: v for k, v in defaults.items() if k in ("socket_timeout", "socket_connect_timeout")
        }
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
        return (
            str(exc).split(" : ", 1)[0] + " (no sentinel answered, or none knows that service's "
            "primary; check the Sentinel URL's hosts and service name)"
        )
    return str(exc)


def is_sentinel_url(url: str) -> bool:
    return urlsplit(url).scheme in SENTINEL_SCHEMES


def check_max_connections(value: Any) -> int:
    """``value`` as a connection cap: an int of at least 2 (one for the hand-off subscription,
    one for calls). Raises InvalidArgument."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise InvalidArgument(
            f"max_connections must be an integer of at least 2 (one connection is the "
            f"hand-off subscription's), not {value!r}"
        )
    return value


def _bad_url(url: str, err: BaseException) -> InvalidArgument:
    from gpulock.transport.cluster import CLUSTER_SCHEMES

    scheme = urlsplit(url).scheme if "://" in url else ""
    if scheme not in ("redis", "rediss", "unix", *SENTINEL_SCHEMES, *CLUSTER_SCHEMES):
        what = f"scheme {scheme!r} is not supported" if scheme else "it has no scheme"
    else:
        what = str(err)
    return InvalidArgument(
        f"Redis URL {_redact(url)!r}: {what}; the forms are {ACCEPTED_SCHEMES}, "
        f"e.g. redis://HOST:6379/0"
    )


def _url_max_connections(url: str, default: int) -> int:
    """The URL's ``?max_connections=`` if it has one (it wins, as in redis-py), else ``default``.
    Raises InvalidArgument (a bad ``default``) or ValueError (a bad value in the URL)."""
    q = parse_qs(urlsplit(url).query).get("max_connections")
    if not q:
        return check_max_connections(default)
    try:
        return check_max_connections(int(q[-1]))
    except (ValueError, InvalidArgument):
        raise ValueError(
            f"max_connections must be an integer of at least 2, not {q[-1]!r}"
        ) from None


def _pool_wait(defaults: dict[str, Any]) -> float:
    t = defaults.get("socket_timeout")
    return float(t) if t else DEFAULT_POOL_WAIT_S


class BlockingSentinelConnectionPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's Sentinel pool (asks the sentinels for the primary, drops connections to a
    former one) with the blocking pool's cap: callers wait for one of ``max_connections``."""


class AsyncBlockingSentinelConnectionPool(
    AsyncSentinelConnectionPool, aioredis.BlockingConnectionPool
):
    """The asyncio twin of :class:`BlockingSentinelConnectionPool`."""


def sync_client(
    url: str, *, max_connections: int = DEFAULT_MAX_CONNECTIONS, **defaults: Any
) -> redis.Redis:
    """A ``redis.Redis`` for ``url`` (plain or Sentinel) with a blocking pool of at most
    ``max_connections`` connections (see the module docstring), or a
    ``redis.cluster.RedisCluster`` (same command API; typed as ``redis.Redis`` here) for a
    cluster URL or a plain URL of a cluster node (``max_connections`` per node). No I/O here,
    but for one ``INFO cluster`` the first time a plain ``redis://`` URL is used.

    Raises:
        InvalidArgument: the URL cannot be used (naming it, password hidden, and the accepted
            schemes), or ``max_connections`` is not an integer ≥ 2.
    """
    from redis.sentinel import Sentinel

    client: redis.Redis = _client(
        url, max_connections, defaults, redis, Sentinel, BlockingSentinelConnectionPool
    )
    return client


def async_client(
    url: str, *, max_connections: int = DEFAULT_MAX_CONNECTIONS, **defaults: Any
) -> aioredis.Redis:
    """A ``redis.asyncio.Redis`` for ``url`` (plain or Sentinel) with a blocking pool of at
    most ``max_connections`` connections (see the module docstring), or a
    ``redis.asyncio.cluster.RedisCluster`` as :func:`sync_client` says. No I/O here, but for the
    one ``INFO cluster`` of :func:`sync_client`.

    Raises:
        InvalidArgument: as :func:`sync_client`.
    """
    from redis.asyncio.sentinel import Sentinel

    client: aioredis.Redis = _client(
        url, max_connections, defaults, aioredis, Sentinel, AsyncBlockingSentinelConnectionPool
    )
    return client


def _client(
    url: str,
    max_connections: int,
    defaults: dict[str, Any],
    mod: Any,
    sentinel_cls: Any,
    sentinel_pool_cls: type,
) -> Any:
    """The one connect path of both shells: ``mod`` is ``redis`` or ``redis.asyncio``."""
    if not isinstance(url, str):
        raise _bad_url(repr(url), TypeError(f"a URL is a str, not {type(url).__name__}"))
    cap = check_max_connections(max_connections)
    try:
        cap = _url_max_connections(url, cap)
        if urlsplit(url).scheme in ("redis", "rediss", "unix"):
            _check_plain(url)
        if _is_cluster(url, defaults):
            from gpulock.transport import cluster as _cluster

            build = _cluster.async_cluster if mod is aioredis else _cluster.sync_cluster
            try:
                return build(url, cap, defaults)
            except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
                # redis-py's sync cluster client reads the slot map when it is made
                raise BackendUnavailable(
                    f"Redis Cluster at {_redact(url)} is unavailable: {short_error(e)}"
                ) from e
        if not is_sentinel_url(url):
            pool = mod.BlockingConnectionPool.from_url(
                url, **{**defaults, "max_connections": cap, "timeout": _pool_wait(defaults)}
            )
            return mod.Redis.from_pool(pool)
        su = SentinelURL(url)
        s = sentinel_cls(su.sentinels, sentinel_kwargs=su.sentinel_connection_kwargs(defaults))
        return s.master_for(
            su.service,
            connection_pool_class=sentinel_pool_cls,
            max_connections=cap,
            timeout=_pool_wait(defaults),
            **su.master_kwargs(defaults),
        )
    except ValueError as e:
        raise _bad_url(url, e) from None


#: The connection settings redis-py's sync connection classes (``redis.Connection``,
#: ``redis.UnixDomainSocketConnection``) take with the same name and meaning as their asyncio
#: counterparts: what :func:`async_client_like` carries over. Others stay behind: objects of
#: the sync client (``retry``, ``credential_provider``, ``event_dispatcher``, ``cache``, the
#: maintenance-notification handlers, ``redis_connect_func``) and settings the asyncio classes
#: lack (``command_packer``).
SHARED_CONNECTION_SETTINGS = frozenset(
    {
        "host",
        "port",
        "path",
        "db",
        "username",
        "password",
        "client_name",
        "lib_name",
        "lib_version",
        "driver_info",
        "encoding",
        "encoding_errors",
        "decode_responses",
        "protocol",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "socket_keepalive_options",
        "socket_type",
        "socket_read_size",
        "health_check_interval",
        "retry_on_timeout",
        "retry_on_error",
    }
)
#: The TLS settings ``redis.SSLConnection`` shares with ``redis.asyncio.SSLConnection`` (not
#: the OCSP options, which only the sync class has).
SHARED_SSL_SETTINGS = frozenset(
    {
        "ssl_keyfile",
        "ssl_certfile",
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_data",
        "ssl_ca_path",
        "ssl_check_hostname",
        "ssl_ciphers",
        "ssl_min_version",
        "ssl_password",
        "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
    }
)


def check_url(url: str) -> str:
    """``url`` if it is a URL of a form :func:`sync_client` takes, with no I/O (no cluster
    probe, no connection). Raises InvalidArgument naming the bad part."""
    from gpulock.transport.cluster import ClusterURL, is_cluster_url

    if not isinstance(url, str):
        raise _bad_url(repr(url), TypeError(f"a URL is a str, not {type(url).__name__}"))
    try:
        _url_max_connections(url, DEFAULT_MAX_CONNECTIONS)
        if is_cluster_url(url):
            ClusterURL(url)
        elif is_sentinel_url(url):
            SentinelURL(url)
        else:
            _check_plain(url)
    except ValueError as e:
        raise _bad_url(url, e) from None
    return url


def _check_plain(url: str) -> None:
    """Raise ValueError for a plain URL redis-py would refuse only when it connects: a port out
    of range, an option no connection takes (redis-py passes unknown ``?name=`` options to the
    connection class). Makes a connection object, opens nothing."""
    urlsplit(url).port  # noqa: B018 - raises ValueError for a port out of range
    try:
        redis.ConnectionPool.from_url(url).make_connection()
    except TypeError as e:
        raise ValueError(f"unknown option in the URL ({e})") from None


def _is_cluster(url: str, defaults: dict[str, Any]) -> bool:
    """Whether ``url`` is served by a cluster client. Raises ValueError for a plain URL of a
    cluster node that names a database other than 0."""
    from gpulock.transport.cluster import is_cluster_node, is_cluster_url

    if is_cluster_url(url):
        return True
    if urlsplit(url).scheme not in ("redis", "rediss") or not is_cluster_node(url, defaults):
        return False
    db = [p for p in urlsplit(url).path.split("/") if p]
    if db and db != ["0"]:
        raise ValueError(
            f"the server is a Redis Cluster node, and a cluster has only database 0, not /{db[0]}"
        )
    return True


def check_supported_client(client: Any) -> None:
    """Raise InvalidArgument, naming the client's type, when ``client`` is neither a client
    of one server (or Sentinel) with a ``connection_pool``, as ``redis.Redis`` is, nor a
    ``redis.cluster.RedisCluster``."""
    from redis.cluster import RedisCluster

    if not isinstance(client, RedisCluster) and getattr(client, "connection_pool", None) is None:
        what = f"{type(client).__module__}.{type(client).__qualname__}"
        raise InvalidArgument(
            f"gpulock.Pool needs a redis.Redis client (one server, or Sentinel) or a "
            f"redis.cluster.RedisCluster, not a {what}"
        )


def async_client_like(client: redis.Redis, *, max_connections: int) -> aioredis.Redis:
    """An asyncio client with the connection settings of the sync ``client``: the
    :data:`SHARED_CONNECTION_SETTINGS` (and, for TLS, :data:`SHARED_SSL_SETTINGS`) its pool's
    connections were made with, the matching asyncio connection class (TCP, TLS or Unix
    socket), and a blocking pool of at most ``max_connections`` connections that waits up to
    the socket timeout (else :data:`DEFAULT_POOL_WAIT_S`) for a free one. No I/O here.

    A Sentinel-managed client (``Sentinel.master_for``) gets one too: it asks the same
    sentinels (with the shared settings of their connections) for the same service's primary;
    and a ``RedisCluster`` an asyncio ``RedisCluster`` seeded with the nodes it knows.
    """
    from redis.cluster import RedisCluster

    if isinstance(client, RedisCluster):
        from gpulock.transport.cluster import async_cluster_like

        shared_all = SHARED_CONNECTION_SETTINGS | SHARED_SSL_SETTINGS
        cluster: aioredis.Redis = async_cluster_like(  # same command API as redis.asyncio.Redis
            client, shared_all, check_max_connections(max_connections), DEFAULT_POOL_WAIT_S
        )
        return cluster
    pool = client.connection_pool
    cls = pool.connection_class
    tls = issubclass(cls, redis.SSLConnection)
    shared = SHARED_CONNECTION_SETTINGS | SHARED_SSL_SETTINGS if tls else SHARED_CONNECTION_SETTINGS
    kw = {k: v for k, v in pool.connection_kwargs.items() if k in shared}
    cap = check_max_connections(max_connections)
    if isinstance(pool, SentinelConnectionPool):
        from redis.asyncio.sentinel import Sentinel

        manager = pool.sentinel_manager
        hosts = [
            (
                c.connection_pool.connection_kwargs["host"],
                c.connection_pool.connection_kwargs["port"],
            )
            for c in manager.sentinels
        ]
        skw = {k: v for k, v in manager.sentinel_kwargs.items() if k in SHARED_CONNECTION_SETTINGS}
        # redis-py < 8.2 leaves Sentinel unannotated and later releases annotate it: called
        # through Any, the line checks under both. master_for returns its redis_class, a Redis.
        sentinel_class: Any = Sentinel
        sentinel = sentinel_class(hosts, sentinel_kwargs=skw)
        primary: aioredis.Redis = sentinel.master_for(
            pool.service_name,
            connection_pool_class=AsyncBlockingSentinelConnectionPool,
            max_connections=cap,
            timeout=_pool_wait(kw),
            ssl=tls,
            **kw,
        )
        return primary
    conn: type = aioredis.Connection
    if tls:
        conn = aioredis.SSLConnection
    elif issubclass(cls, redis.UnixDomainSocketConnection):
        conn = aioredis.UnixDomainSocketConnection
    return aioredis.Redis(
        connection_pool=aioredis.BlockingConnectionPool(
            connection_class=conn,
            max_connections=cap,
            timeout=_pool_wait(kw),
            **kw,
        )
    )


def subscription_client(client: Any, channel: str) -> redis.Redis:
    """A sync client with one connection of its own, to the server that serves ``channel``
    (a cluster client: the primary the slot map names for its slot; Sentinel: the service's
    primary), made with every setting ``client``'s connections to that server are made with:
    the hand-off subscription of a sync Pool, which holds its connection while it lives and so
    must not take one of ``client``'s. No I/O.

    Raises:
        ShardUnavailable: a cluster whose slot map names no master for the slot.
    """
    from gpulock.transport.route import ShardUnavailable
    from gpulock.transport.shards import SyncShards, shards_of, slot_of

    base: Any = client
    shards = shards_of(client)
    node: str | None = None
    if isinstance(shards, SyncShards):
        slot = slot_of(channel)
        node = shards.node_name(slot)
        if node is None:
            raise ShardUnavailable(slot, None, "no master serves it (the slot map has none)")
        base = shards.node_client(node)
    pool = base.connection_pool
    kw = dict(pool.connection_kwargs)
    new: redis.ConnectionPool
    if isinstance(pool, SentinelConnectionPool):
        kw.pop("connection_pool", None)  # the old pool's proxy: the new pool sets its own
        new = SentinelConnectionPool(  # type: ignore[no-untyped-call]  # redis-py: unannotated
            pool.service_name,
            pool.sentinel_manager,
            connection_class=pool.connection_class,
            max_connections=1,
            **kw,
        )
    else:
        new = redis.ConnectionPool(connection_class=pool.connection_class, max_connections=1, **kw)
    if isinstance(shards, SyncShards) and node is not None:
        import weakref

        shards.subscriptions.setdefault(node, weakref.WeakSet()).add(new)
    return redis.Redis(connection_pool=new)
