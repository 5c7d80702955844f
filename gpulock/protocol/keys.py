"""The Redis key layout: the one place that knows how a pool's keys are named.

Every key of a pool shares the hash tag ``{NAME}`` (``gpulock:{gpu0}:cfg``), so a pool lives in
one Redis Cluster slot and its scripts touch keys of one slot only. The scripts take
:func:`pool_keys` in :class:`PoolKeys` order; ``lua/lib.lua`` documents each key's fields.
Keys the service keeps next to a pool (calibrated estimates, the OOM back-off, the
calibration lock; the dashboard's history ``samples``, its ``sampler`` lease and the
``counters`` of 503s and OOMs, see :mod:`gpulock.admin.samples`) are built with :func:`pool_key`,
so they share the slot too.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = [
    "KEY_PREFIX",
    "POOL_CFG_MATCH",
    "POOL_NAME_RE",
    "PoolKeys",
    "pool_key",
    "pool_keys",
    "pool_name_from_key",
]

KEY_PREFIX = "gpulock"
# A pool name: what fits in a key, a URL path segment and a metric label without escaping.
POOL_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


class PoolKeys(NamedTuple):
    """A pool's keys, in the order every script takes them as ``KEYS``."""

    cfg: str  # hash: capacity, used, fence, epoch, queue sequence, settings, counters
    leases: str  # zset: lease id -> server expiry (ms)
    holders: str  # hash: lease id -> holder record (amount, token, times, ticket, meta)
    queue: str  # zset: ticket -> arrival sequence number (FIFO order)
    waiters: str  # hash: ticket -> waiter record (amount, ttl, enqueued, channel, meta)
    wexp: str  # zset: ticket -> waiter expiry (ms)
    tickets: str  # hash: ticket -> lease id of the grant made to that ticket
    events: str  # prefix of the pub/sub channels grants are published on (not a key)


def pool_key(pool: str, suffix: str) -> str:
    """``gpulock:{pool}:<suffix>``: a key in the pool's slot (``suffix`` e.g. ``estimates``)."""
    return f"{KEY_PREFIX}:{{{pool}}}:{suffix}"


def pool_keys(pool: str) -> PoolKeys:
    """The eight keys of ``pool`` (a tuple: pass ``*pool_keys(p)`` as a script's KEYS)."""
    return PoolKeys(*(pool_key(pool, s) for s in PoolKeys._fields))


# SCAN pattern matching every pool's configuration key (one per configured pool; the other
# keys exist only while the pool has leases or waiters).
POOL_CFG_MATCH = pool_key("*", "cfg")
_CFG_HEAD, _CFG_TAIL = pool_key("", "cfg").split("{}")
_CFG_HEAD += "{"
_CFG_TAIL = "}" + _CFG_TAIL


def pool_name_from_key(key: str | bytes) -> str | None:
    """The pool name in a configuration key (``gpulock:{gpu0}:cfg`` -> ``gpu0``), or None for
    any other key (including names no pool could have)."""
    k = key.decode(errors="replace") if isinstance(key, bytes) else key
    if not (k.startswith(_CFG_HEAD) and k.endswith(_CFG_TAIL)):
        return None
    name = k[len(_CFG_HEAD) : -len(_CFG_TAIL)]
    return name if POOL_NAME_RE.fullmatch(name) else None
