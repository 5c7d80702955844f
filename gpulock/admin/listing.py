"""Listing every pool, also while a shard of a Redis Cluster is down.

On a lone server (plain, Sentinel) a listing is one ``SCAN`` for the pools' configuration keys
(:data:`gpulock.protocol.keys.POOL_CFG_MATCH`); its errors are redis-py's, raised as they come.

On a cluster every master is asked on a connection of its own, all at once, each for at most
``timeout`` seconds (:data:`LIST_TIMEOUT_S`): the masters the client knows are asked for the
slot map (``CLUSTER SLOTS``) and scanned; a master of the first slot map that answers, unknown
to the client (a replica promoted since), is scanned as soon as that map is in. A master that
refuses, fails or has not answered when the time is up (a process stopped with SIGSTOP accepts
connections and never answers) is named in :attr:`Listing.unreachable` with its slot ranges,
and the pools of the others are listed. Only when no node answers the slot map is the whole
listing an error. redis-py's own cluster client is not used for this: it asks one node at a
time, waits its socket timeout on a hung one and retries.

:class:`Plan` decides what to ask and folds the answers, without I/O; :func:`list_pools`
(threads) and :func:`alist_pools` (asyncio tasks) carry it out for a client, :func:`list_seeds`
for a cluster URL before a client is made. :func:`steer` then points a cluster client away
from the masters that did not answer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.retry import Retry

from gpulock.transport.cluster import ClusterURL, is_cluster_client
from gpulock.protocol.keys import POOL_CFG_MATCH, pool_key, pool_name_from_key

__all__ = [
    "LIST_TIMEOUT_S",
    "Listing",
    "Plan",
    "Unreachable",
    "alist_pools",
    "answering_url",
    "list_pools",
    "list_seeds",
    "steer",
]

#: Seconds a listing waits for the masters of a cluster (all asked at once): a master that
#: has not answered by then is named unreachable.
LIST_TIMEOUT_S = 2.0

Addr = tuple[str, int]
Range = tuple[int, int]


@dataclass(frozen=True)
class Unreachable:
    """A shard the listing could not read: ``node`` its master (``"host:port"``; None for
    slots no master serves), ``slots`` its slot ranges (inclusive), ``error`` why."""

    node: str | None
    slots: tuple[Range, ...]
    error: str

    def to_dict(self) -> dict[str, Any]:
        """``{"node": "host:port", "slots": [[lo, hi], ...], "error": "..."}``."""
        return {"node": self.node, "slots": [list(r) for r in self.slots], "error": self.error}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Unreachable:
        """The inverse of :meth:`to_dict` (a broker's JSON)."""
        slots = tuple((int(r[0]), int(r[1])) for r in d.get("slots") or ())
        node = d.get("node")
        return cls(None if node is None else str(node), slots, str(d.get("error", "")))

    def holds(self, pool: str) -> bool:
        """Whether pool ``pool``'s slot is among :attr:`slots`."""
        slot = key_slot(pool_key(pool, "cfg").encode())
        return any(lo <= slot <= hi for lo, hi in self.slots)

    def describe(self) -> str:
        """``127.0.0.1:30001 (slots 0-5460): Connection refused``, for people."""
        ranges = ", ".join(f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in self.slots)
        where = self.node or "no master"
        return f"{where} (slots {ranges}): {self.error}" if ranges else f"{where}: {self.error}"


@dataclass
class Listing:
    """The pools found (``names``, sorted) and the shards that could not be read
    (``unreachable``; empty for a complete answer, always on a lone server). ``masters``:
    each master's slot ranges by ``"host:port"`` (empty on a lone server)."""

    names: list[str]
    unreachable: list[Unreachable] = field(default_factory=list)
    masters: dict[str, tuple[Range, ...]] = field(default_factory=dict)

    @property
    def partial(self) -> bool:
        return bool(self.unreachable)

    def lost(self, pool: str, error: BaseException) -> None:
        """Pool ``pool`` was listed but Redis did not answer for it now (``error``): on a
        cluster its shard is unreachable (named once); on a lone server (no ``masters``)
        nothing can be listed without it, and ``error`` is raised."""
        if not self.masters:
            raise error
        for node, ranges in self.masters.items():
            shard = Unreachable(node, ranges, str(error))
            if shard.holds(pool):
                if all(u.node != node for u in self.unreachable):
                    self.unreachable.append(shard)
                return


def uncovered(ranges: Iterable[Range]) -> list[Range]:
    """The slot ranges of ``[0, 16383]`` that ``ranges`` leave out."""
    out, nxt = [], 0
    for lo, hi in sorted(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    if nxt < REDIS_CLUSTER_HASH_SLOTS:
        out.append((nxt, REDIS_CLUSTER_HASH_SLOTS - 1))
    return out


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _node(addr: Addr) -> str:
    return f"{addr[0]}:{addr[1]}"


def _merge(ranges: Iterable[Range]) -> tuple[Range, ...]:
    """``ranges`` sorted, adjacent and overlapping ones joined."""
    merged: list[Range] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def parse_slots(
    reply: Any, asked: Addr, remap: Callable[[str, int], Addr]
) -> dict[Addr, tuple[Range, ...]]:
    """Each master's slot ranges from a ``CLUSTER SLOTS`` reply (``[[lo, hi, [host, port,
    ...], replicas...], ...]``) of node ``asked`` (a master given without a host is that node),
    through the client's address ``remap``; adjacent ranges are joined."""
    out: dict[Addr, list[Range]] = {}
    for entry in reply:
        lo, hi, primary = int(entry[0]), int(entry[1]), entry[2]
        addr = remap(_text(primary[0]) or asked[0], int(primary[1]))
        out.setdefault((addr[0], int(addr[1])), []).append((lo, hi))
    return {addr: _merge(ranges) for addr, ranges in out.items()}


def pool_names_of(keys: Iterable[Any]) -> set[str]:
    """The pool names of configuration keys found by a scan."""
    names = {pool_name_from_key(k) for k in keys}
    return {n for n in names if n}


@dataclass(frozen=True)
class Ask:
    """Ask node ``addr`` for the slot map (``slots``) and/or for its pools (``scan``)."""

    addr: Addr
    slots: bool
    scan: bool


class Plan:
    """What a cluster listing asks, and its result from the answers (no I/O).

    Args:
        primaries: the masters the client knows (asked first, for the slot map and a scan).
        others: other nodes it knows (replicas, seeds), asked only when no primary answers.
        timeout: the listing's bound, seconds (named in the errors of nodes cut off by it).
        remap: the client's address remap (``(host, port) -> (host, port)``).

    A driver sends :meth:`start`'s asks, then each answer to :meth:`answered` or
    :meth:`failed` and sends the asks they return, until :attr:`done` or the timeout; then
    :meth:`result`.
    """

    def __init__(
        self,
        primaries: Sequence[Addr],
        others: Sequence[Addr],
        timeout: float,
        remap: Callable[[str, int], Addr] = lambda h, p: (h, p),
    ):
        self.timeout = timeout
        self._remap = remap
        self._primaries = list(dict.fromkeys(primaries))
        self._others = [a for a in dict.fromkeys(others) if a not in self._primaries]
        self._asked: set[Addr] = set()
        self._pending: set[Addr] = set()
        self._names: dict[Addr, set[str]] = {}
        self._errors: dict[Addr, str] = {}
        self._last: BaseException | None = None
        self._fell_back = False
        self.masters: dict[Addr, tuple[Range, ...]] | None = None

    def _ask(self, asks: list[Ask]) -> list[Ask]:
        asks = [a for a in asks if a.addr not in self._asked]
        for a in asks:
            self._asked.add(a.addr)
            self._pending.add(a.addr)
        return asks

    def _fall_back(self) -> list[Ask]:
        self._fell_back = True
        return self._ask([Ask(a, True, True) for a in self._others])

    def start(self) -> list[Ask]:
        if not self._primaries:
            return self._fall_back()
        return self._ask([Ask(a, True, True) for a in self._primaries])

    def answered(self, addr: Addr, slots: Any, names: set[str] | None) -> list[Ask]:
        """Node ``addr`` answered: its ``CLUSTER SLOTS`` reply (None if not asked) and the
        pools it holds (None if not asked)."""
        self._pending.discard(addr)
        if names is not None:
            self._names[addr] = names
        if self.masters is None and slots is not None:
            self.masters = parse_slots(slots, addr, self._remap)
            return self._ask([Ask(m, False, True) for m in self.masters])
        return []

    def failed(self, addr: Addr, error: BaseException) -> list[Ask]:
        """Node ``addr`` failed (refused, reset, timed out, an error reply)."""
        self._pending.discard(addr)
        self._errors[addr] = self._error_text(error)
        self._last = error
        if self.masters is None and not self._pending and not self._fell_back:
            return self._fall_back()
        return []

    def _error_text(self, e: BaseException) -> str:
        if isinstance(e, (redis.TimeoutError, TimeoutError)):
            return f"no answer within {self.timeout:g} s"
        return str(e) or type(e).__name__

    @property
    def done(self) -> bool:
        """Every master of the slot map has answered or failed (or no node is left to ask)."""
        if self.masters is None:
            return not self._pending
        return all(m in self._names or m in self._errors for m in self.masters)

    def result(self) -> Listing:
        """The listing (call once :attr:`done`, or when the time is up). Raises
        redis.ConnectionError when no node answered the slot map."""
        if self.masters is None:
            asked = ", ".join(_node(a) for a in sorted(self._asked)) or "none known"
            why = (
                self._error_text(self._last)
                if self._last
                else f"no answer within {self.timeout:g} s"
            )
            raise redis.ConnectionError(
                f"no node of the Redis Cluster answered (asked {asked}): {why}"
            )
        names: set[str] = set()
        unreachable: list[Unreachable] = []
        for m, ranges in sorted(self.masters.items(), key=lambda kv: kv[1]):
            if m in self._names:
                names |= self._names[m]
            else:
                error = self._errors.get(m, f"no answer within {self.timeout:g} s")
                unreachable.append(Unreachable(_node(m), ranges, error))
        gaps = uncovered(r for rs in self.masters.values() for r in rs)
        if gaps:
            unreachable.append(Unreachable(None, tuple(gaps), "no master serves these slots"))
        return Listing(sorted(names), unreachable, {_node(m): rs for m, rs in self.masters.items()})


# ---- the client's nodes and connection settings (no I/O) ------------------------------------
# Connection settings a listing's own connections take from the cluster client's nodes:
# credentials and TLS; timeouts and retries are the listing's.
_KEPT = ("username", "password", "credential_provider")


def _kept(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k in _KEPT or k.startswith("ssl")}


def _nodes(client: Any) -> tuple[list[Addr], list[Addr]]:
    """(known primaries, other known nodes and the seeds) of a cluster client."""
    primaries = [(n.host, int(n.port)) for n in client.get_primaries()]
    others = [(n.host, int(n.port)) for n in client.get_nodes()]
    others += [(n.host, int(n.port)) for n in client.nodes_manager.startup_nodes.values()]
    return primaries, others


def _remap(client: Any) -> Callable[[str, int], Addr]:
    remap: Callable[[str, int], Addr] = client.nodes_manager.remap_host_port
    return remap


def steer(client: Any, listing: Listing) -> None:
    """Point a cluster client away from a master the listing could not reach: redis-py sends
    keyless commands to its *default node*, and asks a node of its own (the default node, or
    the asyncio client's command parser's node) for the keys of every ``FCALL`` (``COMMAND
    GETKEYS``); while that node is down, calls for pools on every shard would fail or hang.
    When it is among ``listing.unreachable``, a master that answered takes its place. No I/O."""
    down = {u.node for u in listing.unreachable}
    if not down:
        return
    up = [n for n in client.get_primaries() if n.name in listing.masters and n.name not in down]
    if not up:
        return
    default = client.get_default_node()
    if default is None or default.name in down:
        client.set_default_node(up[0])
    parser: Any = getattr(client, "commands_parser", None)
    if getattr(getattr(parser, "node", None), "name", None) in down:
        parser.node = up[0]  # the asyncio parser's node (the sync one asks the default node)


def _sync_settings(client: Any) -> tuple[type, dict[str, Any]]:
    for n in client.get_nodes():
        if n.redis_connection is not None:
            pool = n.redis_connection.connection_pool
            return pool.connection_class, _kept(pool.connection_kwargs)
    kw = _kept(client.nodes_manager.connection_kwargs)
    return (redis.SSLConnection if kw.pop("ssl", False) else redis.Connection), kw


def _async_settings(client: Any) -> tuple[type, dict[str, Any]]:
    nodes = client.get_nodes() or list(client.nodes_manager.startup_nodes.values())
    n = nodes[0]
    return n.connection_class, _kept(n.connection_kwargs)


# ---- blocking --------------------------------------------------------------------------------
def _sync_ask(cls: type, kw: dict[str, Any], ask: Ask, timeout: float) -> tuple[Any, Any]:
    pool = redis.ConnectionPool(
        connection_class=cls,
        host=ask.addr[0],
        port=ask.addr[1],
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        **kw,
    )
    r = redis.Redis(connection_pool=pool)
    try:
        slots = r.execute_command("CLUSTER SLOTS") if ask.slots else None  # type: ignore[no-untyped-call]
        names = pool_names_of(r.scan_iter(match=POOL_CFG_MATCH, count=1000)) if ask.scan else None
        return slots, names
    finally:
        r.close()
        pool.disconnect()


def _run(plan: Plan, cls: type, kw: dict[str, Any]) -> Listing:
    """Carry ``plan`` out on threads (one connection per node), for at most its timeout."""
    deadline = time.monotonic() + plan.timeout
    running: dict[concurrent.futures.Future[tuple[Any, Any]], Ask] = {}
    # threads that outlive the deadline end by themselves (socket timeout), unwaited
    ex = concurrent.futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="gpulock-list")

    def send(asks: list[Ask]) -> None:
        for a in asks:
            running[ex.submit(_sync_ask, cls, kw, a, plan.timeout)] = a

    try:
        send(plan.start())
        while running and not plan.done:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            finished, _ = concurrent.futures.wait(
                running, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for f in finished:
                a = running.pop(f)
                try:
                    slots, names = f.result()
                except Exception as e:  # noqa: BLE001 - the node's failure, named in the result
                    send(plan.failed(a.addr, e))
                else:
                    send(plan.answered(a.addr, slots, names))
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
    return plan.result()


def list_pools(client: Any, timeout: float = LIST_TIMEOUT_S) -> Listing:
    """The pools behind ``client`` (a ``redis.Redis`` or ``redis.cluster.RedisCluster``); see
    the module docstring. A cluster client is then :func:`steer`-ed away from the masters that
    did not answer. A lone server's errors are redis-py's; a cluster raises
    redis.ConnectionError only when no node answered."""
    if not is_cluster_client(client):
        return Listing(sorted(pool_names_of(client.scan_iter(match=POOL_CFG_MATCH, count=1000))))
    listing = _run(Plan(*_nodes(client), timeout, _remap(client)), *_sync_settings(client))
    steer(client, listing)
    return listing


def list_seeds(url: str, timeout: float = LIST_TIMEOUT_S) -> Listing:
    """The listing of a ``redis+cluster://`` URL, asked of its seeds before any cluster client
    is made (redis-py's asks the seeds one at a time, in random order, and waits its socket
    timeout on one that hangs): build the client on :func:`answering_url` afterwards. Raises
    ValueError for a bad URL, redis.ConnectionError when no node answered."""
    cu = ClusterURL(url)
    kw = _kept(cu.client_kwargs({}))
    cls = redis.SSLConnection if kw.pop("ssl", False) else redis.Connection
    return _run(Plan([], cu.nodes, timeout), cls, kw)


def answering_url(url: str, listing: Listing) -> str:
    """``url`` (a ``redis+cluster://`` URL) with the masters that answered ``listing`` as its
    seeds (credentials and options kept); ``url`` itself when none did."""
    down = {u.node for u in listing.unreachable}
    up = [m for m in listing.masters if m not in down]
    if not up:
        return url
    parts = urlsplit(url)
    userinfo, at, _ = parts.netloc.rpartition("@")
    hosts = []
    for m in up:
        host, _, port = m.rpartition(":")
        hosts.append(f"[{host}]:{port}" if ":" in host else m)
    return urlunsplit(parts._replace(netloc=userinfo + at + ",".join(hosts)))


# ---- asyncio ---------------------------------------------------------------------------------
async def _async_ask(cls: type, kw: dict[str, Any], ask: Ask, timeout: float) -> tuple[Any, Any]:
    from redis.asyncio.retry import Retry as AsyncRetry

    pool = aioredis.ConnectionPool(
        connection_class=cls,
        host=ask.addr[0],
        port=ask.addr[1],
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=AsyncRetry(NoBackoff(), 0),
        **kw,
    )
    r = aioredis.Redis(connection_pool=pool)
    try:
        slots = await r.execute_command("CLUSTER SLOTS") if ask.slots else None  # type: ignore[no-untyped-call]
        names = None
        if ask.scan:
            names = pool_names_of([k async for k in r.scan_iter(match=POOL_CFG_MATCH, count=1000)])
        return slots, names
    finally:
        await r.aclose()
        await pool.disconnect()


async def alist_pools(client: Any, timeout: float = LIST_TIMEOUT_S) -> Listing:
    """:func:`list_pools` for a ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``
    (tasks instead of threads; the ones still running at the deadline are cancelled)."""
    if not is_cluster_client(client):
        keys = [k async for k in client.scan_iter(match=POOL_CFG_MATCH, count=1000)]
        return Listing(sorted(pool_names_of(keys)))
    plan = Plan(*_nodes(client), timeout, _remap(client))
    cls, kw = _async_settings(client)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    running: dict[asyncio.Task[tuple[Any, Any]], Ask] = {}

    def send(asks: list[Ask]) -> None:
        for a in asks:
            running[loop.create_task(_async_ask(cls, kw, a, timeout))] = a

    try:
        send(plan.start())
        while running and not plan.done:
            left = deadline - loop.time()
            if left <= 0:
                break
            finished, _ = await asyncio.wait(
                running, timeout=left, return_when=asyncio.FIRST_COMPLETED
            )
            for t in finished:
                a = running.pop(t)
                try:
                    slots, names = t.result()
                except Exception as e:  # noqa: BLE001 - the node's failure, named in the result
                    send(plan.failed(a.addr, e))
                else:
                    send(plan.answered(a.addr, slots, names))
    finally:
        for t in running:
            t.cancel()
        if running:
            await asyncio.wait(running)
    listing = plan.result()
    steer(client, listing)
    return listing
