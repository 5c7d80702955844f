"""Redis Cluster (and Valkey cluster): its URL form, telling a cluster node from a lone server,
and the clients redis-py's cluster support gives for both.

Every key of a pool carries the pool's hash tag (``gpulock:{pool}:...``), so a pool lives on
one shard (one master and its replicas) and a fleet of pools spreads over the shards; no
script or call crosses slots. The forms::

    redis+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][/0][?max_connections=N]
    rediss+cluster://...   (TLS)

name one or more seed nodes (any nodes of the cluster; redis-py discovers the rest, and
gpulock's calls follow MOVED/ASK and failovers slot by slot: :mod:`gpulock.transport.shards`). A plain ``redis://HOST:PORT`` (or ``rediss://``) of any cluster node
works too: :func:`is_cluster_node` asks the node once (``INFO cluster``) when the client is
built. ``max_connections`` caps the connections per node.
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import parse_qs, urlsplit, urlunsplit

import redis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import ClusterNode, RedisCluster

from gpulock.transport.urls import auth_kwargs, credentials_and_hosts

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_CLUSTER_PORT = 6379
#: Seconds the one-time probe of a plain URL waits to connect and for its answer.
PROBE_TIMEOUT_S = 1.0

_known: dict[
    str, bool
] = {}  # URL -> is a cluster node (answers only; an unreachable URL is not kept)
_known_lock = threading.Lock()


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def is_cluster_client(client: Any) -> bool:
    """Whether ``client`` is a redis-py cluster client (sync or asyncio)."""
    return isinstance(client, (RedisCluster, AsyncRedisCluster))


class ClusterURL:
    """A parsed ``redis+cluster://`` URL (see the module docstring). Raises ValueError naming
    the bad part."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in CLUSTER_SCHEMES:
            raise ValueError(f"not a cluster URL (scheme {parts.scheme!r})")
        self.ssl = parts.scheme == "rediss+cluster"
        self.username, self.password, self.nodes = credentials_and_hosts(
            parts.netloc, DEFAULT_CLUSTER_PORT
        )
        path = [p for p in parts.path.split("/") if p]
        if path and path != ["0"]:
            raise ValueError(f"a cluster has only database 0, not /{'/'.join(path)}")
        q = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        unknown = set(q) - {"max_connections"}
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)}")

    def client_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        return auth_kwargs(defaults, self.username, self.password, self.ssl)


def is_cluster_node(url: str, defaults: dict[str, Any]) -> bool:
    """Whether the server of a plain ``redis://``/``rediss://`` URL is a cluster node
    (``INFO cluster`` says ``cluster_enabled:1``): one round trip the first time a URL is
    used in this process, remembered once answered. A server that cannot be asked now
    (down, refusing the credentials) counts as a lone server; should it turn out to be a
    cluster node, its MOVED replies say so (:func:`gpulock.transport.translate.translate`)."""
    with _known_lock:
        if url in _known:
            return _known[url]
    t = min(PROBE_TIMEOUT_S, float(defaults.get("socket_connect_timeout") or PROBE_TIMEOUT_S))
    try:
        # asked without the URL's database: a cluster node refuses SELECT of any but 0
        probe = urlunsplit(urlsplit(url)._replace(path=""))
        c = redis.Redis.from_url(probe, socket_connect_timeout=t, socket_timeout=t)
        try:
            enabled = str(c.info("cluster").get("cluster_enabled", 0)) == "1"
        finally:
            c.close()
    except (redis.RedisError, OSError, ValueError, TypeError):
        return False
    with _known_lock:
        _known[url] = enabled
    return enabled


def _node_kwargs(defaults: dict[str, Any], cap: int) -> dict[str, Any]:
    kw = {k: v for k, v in defaults.items() if k != "timeout"}
    kw["max_connections"] = cap
    return kw


def sync_cluster(url: str, cap: int, defaults: dict[str, Any]) -> RedisCluster:
    """A ``redis.cluster.RedisCluster`` for a cluster URL or a plain URL of a cluster node,
    at most ``cap`` connections per node. redis-py's sync cluster client reads the slot map
    when it is made (I/O here, unlike the asyncio one). Raises ValueError (a bad URL), what
    redis-py raises when no seed answers."""
    kw = _node_kwargs(defaults, cap)
    if is_cluster_url(url):
        cu = ClusterURL(url)
        node: Any = ClusterNode  # redis-py's sync cluster module is unannotated
        nodes = [node(h, p) for h, p in cu.nodes]
        return RedisCluster(startup_nodes=nodes, **cu.client_kwargs(kw))
    return RedisCluster.from_url(url, **kw)


def async_cluster(url: str, cap: int, defaults: dict[str, Any]) -> AsyncRedisCluster:
    """The asyncio twin of :func:`sync_cluster`."""
    kw = _node_kwargs(defaults, cap)
    if is_cluster_url(url):
        cu = ClusterURL(url)
        nodes = [AsyncClusterNode(h, p) for h, p in cu.nodes]
        return AsyncRedisCluster(startup_nodes=nodes, **cu.client_kwargs(kw))
    return AsyncRedisCluster.from_url(url, **kw)


def async_cluster_like(
    client: Any, shared: frozenset[str], cap: int, pool_wait: float
) -> AsyncRedisCluster:
    """An asyncio cluster client that reaches the nodes the sync ``client`` knows, with the
    connection settings in ``shared`` that its nodes' connections were made with."""
    ckw = client.nodes_manager.connection_kwargs
    kw = {k: v for k, v in ckw.items() if k in shared and k not in ("host", "port")}
    nodes = [AsyncClusterNode(n.host, n.port) for n in client.get_nodes()] or [
        AsyncClusterNode(n.host, n.port) for n in client.nodes_manager.startup_nodes.values()
    ]
    if ckw.get("connection_class") is not None and issubclass(
        ckw["connection_class"], redis.SSLConnection
    ):
        kw["ssl"] = True
    return AsyncRedisCluster(startup_nodes=nodes, max_connections=cap, **kw)


async def ready(client: Any) -> None:
    """Make sure an asyncio ``RedisCluster`` has read the cluster (no-op otherwise, and once it
    has). redis-py's own ``initialize()`` reads the slot map and then sends ``COMMAND`` to its
    default node, the first primary it lists: while that one shard has no live master, every
    new client would fail, for pools on the healthy shards too. When that call fails, the
    default node moves to the first primary that answers. Raises what redis-py raises when no
    primary answers (a connection error, which the callers retry)."""
    if not isinstance(client, AsyncRedisCluster) or not getattr(client, "_initialize", False):
        return
    try:
        await client.initialize()
        return
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        err: BaseException = e
    nm = client.nodes_manager
    await nm.initialize()
    for node in nm.get_nodes_by_server_type("primary"):
        try:
            await client.commands_parser.initialize(node)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
            err = e
            continue
        nm.default_node = node
        client._initialize = False  # what redis-py's initialize() sets once it succeeded
        return
    raise err
