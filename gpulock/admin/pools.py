"""Pool administration: list the pools a Redis holds and delete one. Used by ``gpulock pool
list``/``pool delete`` and ``gpulock status`` (blocking client), and by the HTTP broker
(``DELETE /v1/pools/{pool}``, ``GET /v1/pools``; asyncio client).

Pools are found by their configuration key ``gpulock:{NAME}:cfg`` (one per pool; the other
keys exist only while the pool has leases or waiters), by :mod:`gpulock.admin.listing` (which also
names the shards of a cluster that do not answer). :func:`delete_pool` and
:func:`adelete_pool` run the same script.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpulock.protocol.keys import pool_key, pool_keys
from gpulock.protocol.args import validate_pool_name
from gpulock.transport.translate import translate
from gpulock.errors import BackendUnavailable

__all__ = [
    "DeleteResult",
    "adelete_pool",
    "delete_pool",
    "pool_names",
]


def pool_names(client: Any) -> list[str]:
    """Every pool configured in the Redis behind ``client`` (a ``redis.Redis`` or a cluster
    client), sorted: :func:`gpulock.admin.listing.list_pools`, all or nothing. Raises the core's
    errors (BackendUnavailable, also naming the shards of a cluster that did not answer)."""
    from gpulock.admin.listing import list_pools

    try:
        listing = list_pools(client)
    except Exception as e:  # noqa: BLE001 - translated to gpulock's tree
        raise translate(e, "*") from e
    if listing.partial:
        raise BackendUnavailable(
            "shards of the Redis Cluster did not answer: "
            + "; ".join(u.describe() for u in listing.unreachable)
        )
    return listing.names


# KEYS: the pool's first seven keys (pool_keys() order; the eighth is a channel prefix).
# ARGV: 1 force ('1': delete even with live leases or waiters)
# Reply: {state, live_leases, live_waiters}; state 0: no such pool, -1: refused (in use),
# 1: deleted. Counts only leases and waiters not yet expired on the server clock, so a dead
# holder's leftovers do not block a delete.
_DELETE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0, 0} end
local leases = redis.call('ZCOUNT', KEYS[2], '(' .. string.format('%d', now), '+inf')
local waiters = redis.call('ZCOUNT', KEYS[6], '(' .. string.format('%d', now), '+inf')
if ARGV[1] ~= '1' and (leases > 0 or waiters > 0) then return {-1, leases, waiters} end
redis.call('DEL', unpack(KEYS))
return {1, leases, waiters}
"""


@dataclass(frozen=True)
class DeleteResult:
    """``state``: ``"deleted"``, ``"missing"`` (no such pool) or ``"in_use"`` (refused: live
    leases or waiters and no ``force``). ``leases``/``waiters``: the live ones at that moment."""

    state: str
    leases: int
    waiters: int


def _rest_match(name: str) -> str:
    """SCAN pattern of every key under the pool's hash tag (stored results, estimates, ...)."""
    return pool_key(name, "*")


def _result(reply: Any) -> DeleteResult:
    state, leases, waiters = (int(x) for x in reply)
    return DeleteResult({1: "deleted", 0: "missing", -1: "in_use"}[state], leases, waiters)


def _delete_words(name: str, force: bool) -> tuple[Any, ...]:
    keys = pool_keys(name)[:7]
    return ("EVAL", _DELETE_LUA, len(keys), *keys, "1" if force else "0")


def _scan_words(name: str, cursor: Any) -> tuple[Any, ...]:
    return ("SCAN", cursor, "MATCH", _rest_match(name), "COUNT", 1000)


def _scanned(reply: Any) -> tuple[Any, list[Any]]:
    """``(next cursor, keys)`` of a SCAN reply; the cursor is ``b"0"``/``"0"`` at the end."""
    cursor, keys = reply
    return cursor, list(keys)


def _done(cursor: Any) -> bool:
    return cursor in (0, b"0", "0")


def delete_pool(client: Any, name: str, *, force: bool = False) -> DeleteResult:
    """Delete pool ``name``: its configuration, leases and queue in one atomic script, then
    the keys that other parts of gpulock keep under the pool's hash tag (stored results,
    calibrated estimates, samples), found by SCAN on the pool's own server. Every command
    goes to the pool's server only (:func:`gpulock.transport.shards.on_key`: on a cluster, the master
    of the pool's slot; no other master is asked). Refused while leases or waiters are live
    unless ``force``. ``client``: a ``redis.Redis`` or a sync cluster client. Raises the
    core's errors (InvalidArgument for a bad name, BackendUnavailable, ...).

    A holder still running when a pool is deleted by force sees what it sees after Redis
    lost its data: it puts its lease back (and so makes the pool again) at its next renewal.
    Stop the holders first.
    """
    from gpulock.transport.shards import checked, on_key

    validate_pool_name(name)
    k = pool_keys(name).cfg
    try:
        r = _result(checked(on_key(client, k, _delete_words(name, force)))[0])
        if r.state == "deleted":
            cursor: Any = 0
            while True:
                cursor, rest = _scanned(checked(on_key(client, k, _scan_words(name, cursor)))[0])
                if rest:
                    checked(on_key(client, k, ("DEL", *rest)))
                if _done(cursor):
                    break
    except Exception as e:  # noqa: BLE001 - translated to gpulock's tree
        raise translate(e, name) from e
    return r


async def adelete_pool(client: Any, name: str, *, force: bool = False) -> DeleteResult:
    """:func:`delete_pool` over a ``redis.asyncio.Redis`` or asyncio cluster client (the
    same commands, :func:`gpulock.transport.shards_async.aon_key`)."""
    from gpulock.transport.shards import checked
    from gpulock.transport.shards_async import aon_key

    validate_pool_name(name)
    k = pool_keys(name).cfg
    try:
        r = _result(checked(await aon_key(client, k, _delete_words(name, force)))[0])
        if r.state == "deleted":
            cursor: Any = 0
            while True:
                reply = checked(await aon_key(client, k, _scan_words(name, cursor)))[0]
                cursor, rest = _scanned(reply)
                if rest:
                    checked(await aon_key(client, k, ("DEL", *rest)))
                if _done(cursor):
                    break
    except Exception as e:  # noqa: BLE001 - translated to gpulock's tree
        raise translate(e, name) from e
    return r
