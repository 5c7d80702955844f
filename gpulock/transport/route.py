"""How one call on one slot of a Redis Cluster reaches the master that serves the slot, with no
I/O: the redirects it follows, when the slot map is refreshed, and what is left to the
caller's retry. :mod:`gpulock.transport.shards` drives it (sync and asyncio).

Every gpulock call on a cluster touches one slot (a pool's keys share its hash tag), so a call
is sent straight to the node the slot map names for that slot, and only that slot's trouble
can touch it:

* ``MOVED``: the map is corrected for the slot and the call goes at once to the node named;
* ``ASK``: the call goes at once to the node named, after ``ASKING``, without changing the map;
* a connection error or timeout: the map is refreshed for the slot (another node is asked
  who serves it); when the answer names another master (a replica was promoted), the call
  goes there at once, else the error is the caller's to retry;
* ``CLUSTERDOWN``: the map is refreshed, and the error is the caller's to retry;
* ``TRYAGAIN`` (a slot half migrated) is the caller's to retry, as is a call redirected more
  than :data:`MAX_REDIRECTS` times.

Each error left to the caller is a :class:`ShardUnavailable` (a redis-py ``ConnectionError``,
so that gpulock's retry policy retries it) whose message names the slot and the node.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Union

import redis.exceptions as rex

__all__ = [
    "HUNG_CHECK_S",
    "LOOKUP",
    "MAX_REDIRECTS",
    "Lookup",
    "Moved",
    "Refresh",
    "RouteStep",
    "Send",
    "ShardUnavailable",
    "is_shard_error",
    "owner_in",
    "refresh_order",
    "route",
]

#: Redirects (MOVED, ASK, a move found by a refresh) one try of a call follows before it
#: gives the call back to the caller's retry: a slot moves once per failover or migration.
MAX_REDIRECTS = 5

#: Seconds a call waits for its reply before the node it went to is suspected of being hung
#: (its process stopped: connections succeed, replies never come); then, and every as many
#: seconds while the call waits, other nodes are asked who serves its slot
#: (:meth:`gpulock.transport.shards.SyncShards.watch`).
HUNG_CHECK_S = 0.5


@dataclass(frozen=True)
class Lookup:
    """The name (``host:port``) of the node the slot map names for the slot, or None when
    the map has none."""


LOOKUP = Lookup()


@dataclass(frozen=True)
class Send:
    """Send the call to node ``node`` (``host:port``), after ``ASKING`` when ``asking``; the
    reply, or the error the call raised, comes back."""

    node: str
    asking: bool


@dataclass(frozen=True)
class Moved:
    """The slot is served by ``host:port`` now (a ``MOVED`` reply): correct the map."""

    host: str
    port: int


@dataclass(frozen=True)
class Refresh:
    """Ask a node other than ``failed`` which master serves the slot, correct the map, and
    send back that master's name (None when no node answered or none serves it)."""

    failed: str | None


RouteStep = Union[Lookup, Send, Moved, Refresh]


class ShardUnavailable(rex.ConnectionError):
    """The shard of a slot cannot serve a call now: its master is unreachable or hung, a
    failover or a migration is in progress, or the slot has no master. A redis-py
    ``ConnectionError``, so that gpulock's retry policy retries it; ``slot`` and ``node``
    (``host:port``, None when no node is known) name the shard in the message."""

    def __init__(self, slot: int, node: str | None, why: str):
        self.slot, self.node, self.why = slot, node, why
        where = f"cluster slot {slot}" + (f" on {node}" if node else " (no master known)")
        super().__init__(f"{where}: {why}")


def is_shard_error(e: BaseException) -> bool:
    """Whether an error reply is the shard's, for the route to handle (a redirect, TRYAGAIN,
    CLUSTERDOWN), not the call's."""
    return isinstance(e, (rex.AskError, rex.TryAgainError, rex.ClusterDownError))


def _name(host: str, port: int) -> str:
    return f"{host}:{port}"


def route(slot: int) -> Generator[RouteStep, Any, Any]:
    """One try of a call on ``slot`` (see the module docstring): returns the call's reply.

    Raises:
        ShardUnavailable: what the caller's retry should retry (its ``__cause__``: the error).
        other errors of the call (an error reply, ``AuthenticationError``): as they came.
    """
    node: str | None = yield LOOKUP
    asking = False
    moves = 0
    while True:
        if node is None:
            node = yield Refresh(None)
            if node is None:
                raise ShardUnavailable(slot, None, "no master serves it (the slot map has none)")
        try:
            return (yield Send(node, asking))
        except rex.AskError as e:  # MovedError is an AskError: the order of these matters
            if isinstance(e, rex.MovedError):
                yield Moved(e.host, e.port)
                asking = False
            else:
                asking = True
            new: str | None = _name(e.host, e.port)
            why = f"redirected by {e.__class__.__name__} ({e})"
        except rex.TryAgainError as e:
            raise ShardUnavailable(slot, node, f"the slot is being migrated ({e})") from e
        except rex.ClusterDownError as e:
            yield Refresh(node)
            raise ShardUnavailable(slot, node, f"the shard is down ({e})") from e
        except (rex.AuthenticationError, rex.MaxConnectionsError):
            raise  # not the shard's fault: no refresh helps
        except (rex.ConnectionError, rex.TimeoutError, OSError) as e:
            new = yield Refresh(node)
            if new is None or new == node:
                raise ShardUnavailable(slot, node, str(e) or e.__class__.__name__) from e
            asking = False
            why = f"moved to {new} after {e}"
        moves += 1
        if moves > MAX_REDIRECTS:
            raise ShardUnavailable(slot, node, f"redirected {moves} times, last {why}")
        node = new


def refresh_order(
    failed: str | None, slot_nodes: Sequence[str], primaries: Sequence[str], others: Sequence[str]
) -> list[str]:
    """The nodes to ask who serves a slot, in order, without ``failed`` and without repeats:
    the slot's replicas first (a promoted one knows first), then the other masters, then
    every other node."""
    out: list[str] = []
    for n in (*slot_nodes, *primaries, *others):
        if n != failed and n not in out:
            out.append(n)
    return out


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def owner_in(slots_reply: Sequence[Any], slot: int) -> tuple[str, int] | None:
    """The master ``(host, port)`` that a ``CLUSTER SLOTS`` reply names for ``slot``, or None
    when the reply names none. An empty host means the node that answered (redis-py's rule):
    returned as ``""``."""
    for entry in slots_reply:
        lo, hi, primary = int(entry[0]), int(entry[1]), entry[2]
        if lo <= slot <= hi:
            return _text(primary[0]), int(primary[1])
    return None
