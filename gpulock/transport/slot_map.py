"""What gpulock's two cluster drivers (:mod:`gpulock.transport.shards`, sync;
:mod:`gpulock.transport.shards_async`) share, without I/O: a pool's hash slot, the slot map they
route on, and how a batch of commands is framed and its replies read."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.crc import key_slot
from redis.exceptions import MovedError

from gpulock.transport.lane import encode
from gpulock.transport.route import is_shard_error, owner_in, refresh_order

ASKING = encode(("ASKING",))
CLUSTER_SLOTS = encode(("CLUSTER", "SLOTS"))
#: Where a cluster client keeps its driver (one per client, shared by its pool objects).
DRIVER_ATTR = "_gpulock_shards"


def slot_of(key: str) -> int:
    """The hash slot of ``key`` (its hash tag's, as every gpulock key of a pool has)."""
    return int(key_slot(key.encode()))


def batch_words(commands: Sequence[Sequence[Any]], asking: bool) -> list[bytes]:
    """``commands`` (each a sequence of words: str, bytes, int) encoded, each after ``ASKING``
    when ``asking`` (an ASK redirect covers the next command only)."""
    out: list[bytes] = []
    for c in commands:
        if asking:
            out.append(ASKING)
        out.append(encode(c))
    return out


def batch_replies(replies: list[Any], asking: bool) -> list[Any]:
    """The replies of :func:`batch_words`'s commands (an error reply as its
    ``ResponseError``), raising the first error that is the shard's (a redirect, TRYAGAIN,
    CLUSTERDOWN) for the route to handle."""
    out = replies[1::2] if asking else replies
    for r in out:
        if isinstance(r, Exception) and is_shard_error(r):
            raise r
    return out


def checked(replies: list[Any]) -> list[Any]:
    """``replies`` (of :func:`on_key`), raising the first error reply among them."""
    for r in replies:
        if isinstance(r, Exception):
            raise r
    return replies


class SlotMap:
    """What both drivers share, without I/O: the slots gpulock routes on the client, when the
    map was last refreshed, and the nodes suspected of being down or hung."""

    def __init__(self, client: Any):
        self.client = client
        self.nm: Any = client.nodes_manager
        self.tracked: set[int] = set()
        self.refreshed_at = 0.0  # time.monotonic() of the last refresh's end
        # Nodes that failed a call or hung since they last answered one: asked last.
        self.suspects: set[str] = set()

    def node_name(self, slot: int) -> str | None:
        nodes = self.nm.slots_cache.get(slot)
        return nodes[0].name if nodes else None

    def candidates(self, slot: int, failed: str | None) -> list[str]:
        """The nodes a refresh asks, in order (:func:`gpulock.transport.route.refresh_order`), the
        suspects last."""
        if failed is not None:
            self.suspects.add(failed)
        order = refresh_order(
            failed,
            [n.name for n in self.nm.slots_cache.get(slot, ())],
            [n.name for n in self.nm.get_nodes_by_server_type("primary")],
            list(self.nm.nodes_cache),
        )
        return [n for n in order if n not in self.suspects] + [
            n for n in order if n in self.suspects
        ]

    def changes(self, reply: Any, asked: str) -> list[tuple[int, str, int]]:
        """The tracked slots whose master in a ``CLUSTER SLOTS`` reply of node ``asked``
        (``host:port``) is not the map's: ``(slot, host, port)`` each."""
        out = []
        for s in sorted(self.tracked):
            owner = owner_in(reply, s)
            if owner is None:
                continue
            host, port = owner[0] or asked.rpartition(":")[0], owner[1]
            if self.node_name(s) != f"{host}:{port}":
                out.append((s, host, port))
        return out


def moved_error(slot: int, host: str, port: int) -> MovedError:
    """The redirect that moves ``slot`` to ``host:port`` in redis-py's slot map."""
    return MovedError(f"{slot} {host}:{port}")
