"""A pool's recent history, kept in Redis: one sample a second for the last 15 minutes.

Three keys in the pool's slot (:func:`gpulock.protocol.keys.pool_key`), removed with the pool:

* ``gpulock:{pool}:samples`` — a list of JSON samples, newest first, capped at
  :data:`SAMPLE_LIMIT` (900) entries by an ``LTRIM`` in the same script that pushes one. A
  sample is ``{"t": server ms, "rejected", "oom", "capacity", "used", "resident", "leases",
  "waiters", "grants"}``: bytes, counts, and cumulative counters.
* ``gpulock:{pool}:sampler`` — the sampler lease: the id of the one process that writes the
  samples, set with ``SET NX PX`` (:data:`SAMPLER_LEASE_MS`) and extended by its holder at each
  sample (a push checks the holder again, in the script that pushes). Every service worker and broker runs a :class:`Sampler`; only the holder writes, so a
  pool gets one sample a second however many processes watch it, and another process takes
  over within the lease's 3 s when the holder dies.
* ``gpulock:{pool}:counters`` — a hash of cumulative counts that the pool's HTTP surfaces
  answer and Redis cannot see by itself: ``rejected`` (503s for no grant in time or a full
  queue) and ``oom`` (CUDA out-of-memory errors inside a lease); :func:`count_event` adds one.

The samples are on the Redis server's clock (``TIME`` in the script), so they line up whoever
wrote them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence

from gpulock_common.aio import wait_for

from gpulock.protocol.keys import pool_key, pool_keys
from gpulock.protocol.replies import PoolStatus
from gpulock.transport.shards import checked
from gpulock.transport.shards_async import aon_key

__all__ = [
    "SAMPLE_BOUND_S",
    "SAMPLE_LIMIT",
    "SAMPLER_LEASE_MS",
    "Sample",
    "Sampler",
    "claim_sampler",
    "count_event",
    "read_counters",
    "read_samples",
    "record_sample",
]

log = logging.getLogger("gpulock.samples")

SAMPLE_LIMIT = 900  # 15 minutes at one a second
SAMPLER_LEASE_MS = 3000
#: Seconds one pool's sample may take (:class:`Sampler`), as long as a listing waits for a
#: cluster master (:data:`gpulock.admin.listing.LIST_TIMEOUT_S`).
SAMPLE_BOUND_S = 2.0
COUNTER_FIELDS = ("rejected", "oom")

# A pool that does not exist (never made, or deleted: gpulock.admin.pools removes these keys with
# it) gets none of these keys: each script checks the pool's configuration key first.

# KEYS: 1 sampler lease, 2 the pool's cfg. ARGV: 1 this sampler's id, 2 lease ms.
# Reply: 1 this sampler holds the lease (taken with SET NX PX, or extended), 0 another does
# (or there is no such pool).
_CLAIM_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""

# KEYS: 1 sampler lease, 2 samples list, 3 counters hash, 4 the pool's cfg
# ARGV: 1 this sampler's id, 2 the sample's fields as JSON members ("a":1,"b":2),
#       3 the most samples kept
# Reply: 1 written, 0 not (this sampler no longer holds the lease, or the pool is gone).
_PUSH_LUA = """
if redis.call('EXISTS', KEYS[4]) == 0 then return 0 end
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local c = redis.call('HMGET', KEYS[3], 'rejected', 'oom')
local s = string.format('{"t":%d,"rejected":%d,"oom":%d,', now,
  tonumber(c[1]) or 0, tonumber(c[2]) or 0) .. ARGV[2] .. '}'
redis.call('LPUSH', KEYS[2], s)
redis.call('LTRIM', KEYS[2], 0, tonumber(ARGV[3]) - 1)
return 1
"""

# KEYS: 1 counters hash, 2 the pool's cfg. ARGV: 1 the counter. Reply: 1 counted, 0 no pool.
_COUNT_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
return 1
"""


async def _eval(redis: Any, script: str, keys: Sequence[str], *args: Any) -> Any:
    """``EVAL script`` on ``keys`` (all of one pool) with ``args``, on the pool's server alone
    (:func:`gpulock.transport.shards_async.aon_key`): its reply. Raises redis-py's errors."""
    words = ("EVAL", script, len(keys), *keys, *args)
    return checked(await aon_key(redis, keys[0], words))[0]


def samples_key(pool: str) -> str:
    return pool_key(pool, "samples")


def sampler_key(pool: str) -> str:
    return pool_key(pool, "sampler")


def counters_key(pool: str) -> str:
    return pool_key(pool, "counters")


@dataclass(frozen=True)
class Sample:
    """One second of a pool: ``t`` Unix ms on the Redis clock; bytes; counts; cumulative
    ``grants`` (the pool's), ``rejected`` and ``oom`` (the surfaces')."""

    t: int
    capacity: int
    used: int
    resident: int
    leases: int
    waiters: int
    grants: int
    rejected: int
    oom: int

    @classmethod
    def from_json(cls, raw: str | bytes) -> Sample | None:
        try:
            d = json.loads(raw)
            return cls(**{f: int(d.get(f, 0)) for f in cls.__dataclass_fields__})
        except (ValueError, TypeError, AttributeError):
            return None


async def claim_sampler(redis: Any, pool: str, sampler_id: str) -> bool:
    """Take or extend the pool's sampler lease (``SET NX PX`` :data:`SAMPLER_LEASE_MS`) for
    ``sampler_id``; whether it holds it now. ``redis``: a ``redis.asyncio.Redis``. Raises
    redis-py's errors."""
    keys = (sampler_key(pool), pool_keys(pool).cfg)
    r = await _eval(redis, _CLAIM_LUA, keys, sampler_id, SAMPLER_LEASE_MS)
    return int(r) == 1


async def record_sample(
    redis: Any, st: PoolStatus, sampler_id: str, *, limit: int = SAMPLE_LIMIT
) -> bool:
    """Push a sample of ``st`` (keeping the newest ``limit``) if ``sampler_id`` holds the pool's
    sampler lease (:func:`claim_sampler`). Returns whether it was written. Raises redis-py's
    errors."""
    fields = {
        "capacity": st.capacity,
        "used": st.used,
        "resident": st.resident,
        "leases": st.lease_count,
        "waiters": st.waiter_count,
        "grants": st.grants,
    }
    members = json.dumps(fields, separators=(",", ":"))[1:-1]
    p = st.pool
    keys = (sampler_key(p), samples_key(p), counters_key(p), pool_keys(p).cfg)
    r = await _eval(redis, _PUSH_LUA, keys, sampler_id, members, limit)
    return int(r) == 1


async def read_samples(redis: Any, pool: str, n: int = SAMPLE_LIMIT) -> list[Sample]:
    """The pool's newest ``n`` samples, oldest first (malformed entries skipped)."""
    (raw,) = checked(
        await aon_key(redis, samples_key(pool), ("LRANGE", samples_key(pool), 0, max(0, n - 1)))
    )
    out = [s for s in (Sample.from_json(x) for x in raw) if s is not None]
    out.reverse()
    return out


async def read_counters(redis: Any, pool: str) -> dict[str, int]:
    """``{"rejected": n, "oom": n}``: the pool's cumulative counts (0 when never counted)."""
    (vals,) = checked(
        await aon_key(redis, counters_key(pool), ("HMGET", counters_key(pool), *COUNTER_FIELDS))
    )
    return {f: int(v or 0) for f, v in zip(COUNTER_FIELDS, vals)}


async def count_event(redis: Any, pool: str, event: str) -> bool:
    """Add one to the pool's ``event`` counter (``rejected`` or ``oom``); whether it was
    counted (not for a pool that does not exist). Raises ValueError for another name,
    redis-py's errors."""
    if event not in COUNTER_FIELDS:
        raise ValueError(f"unknown event {event!r}")
    r = await _eval(redis, _COUNT_LUA, (counters_key(pool), pool_keys(pool).cfg), event)
    return int(r) == 1


class Sampler:
    """Samples pools once every ``interval`` seconds, for the pools whose sampler lease it wins
    (a sampler that does not hold a pool's lease makes one short call for it a round, and
    reads no status). Each pool is sampled in a task of its own, all at once, each for at most
    ``bound`` seconds: a pool whose server is slow, dead or hung (a cluster shard) holds up no
    other pool's samples, and a pool still being sampled when the next round starts is left out
    of that round.

    Args:
        redis: a ``redis.asyncio.Redis`` or asyncio cluster client.
        pools: the names of the pools to sample, asked again every ``names_every`` rounds.
        status: reads a pool's status (``(name, limit) -> PoolStatus``).
        interval: seconds between rounds.
        names_every: rounds between calls of ``pools`` (a broker lists the pools by SCAN).
        bound: seconds one pool's sample may take (:data:`SAMPLE_BOUND_S`): then it is given
            up (cancelled) for that round.
    """

    def __init__(
        self,
        redis: Any,
        pools: Callable[[], Awaitable[Sequence[str]]],
        status: Callable[[str, int], Awaitable[PoolStatus]],
        *,
        interval: float = 1.0,
        names_every: int = 10,
        bound: float = SAMPLE_BOUND_S,
    ):
        self._redis = redis
        self._pools = pools
        self._status = status
        self.interval = interval
        self.names_every = max(1, names_every)
        self.bound = bound
        self.id = f"{os.getpid()}-{secrets.token_hex(4)}"
        self._names: Sequence[str] = ()
        self._round = 0
        self._inflight: dict[str, asyncio.Task[bool | None]] = {}

    async def _sample(self, name: str) -> bool:
        if not await claim_sampler(self._redis, name, self.id):
            return False
        st = await self._status(name, 0)
        return await record_sample(self._redis, st, self.id)

    async def _bounded(self, name: str) -> bool | None:
        """:meth:`_sample` of ``name`` within :attr:`bound`: whether written; None when it
        failed or ran out of time (logged)."""
        try:
            # in this task (gpulock_common.aio.wait_for): a cancelled round leaves no inner task
            # whose failure nobody reads
            return await wait_for(self._sample(name), self.bound)
        except asyncio.TimeoutError:
            log.debug("gpulock: sampling pool %s: no answer within %g s", name, self.bound)
        except Exception as e:  # noqa: BLE001 - a sampler never stops for one failure
            log.debug("gpulock: sampling pool %s failed: %s", name, e)
        finally:
            self._inflight.pop(name, None)
        return None

    async def _start_round(self) -> dict[str, asyncio.Task[bool | None]]:
        """Start this round's samples (the pools not still being sampled): their tasks."""
        if self._round % self.names_every == 0:
            self._names = await self._pools()
        self._round += 1
        loop = asyncio.get_running_loop()
        started = {}
        for name in self._names:
            if name not in self._inflight:
                t = loop.create_task(self._bounded(name), name=f"gpulock-sample-{name}")
                self._inflight[name] = started[name] = t
        return started

    async def run_once(self) -> dict[str, bool]:
        """One round, waited for: ``{pool: written}``. A pool whose sample failed or ran out
        of :attr:`bound` is left out (logged)."""
        tasks = await self._start_round()
        done = await asyncio.gather(*tasks.values())
        return {n: r for n, r in zip(tasks, done) if r is not None}

    async def run(self) -> None:
        """Rounds until cancelled (a round does not wait for its samples: the next starts
        ``interval`` after it); the samples under way are cancelled with it."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                start = loop.time()
                try:
                    await self._start_round()
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - e.g. Redis down while listing the pools
                    log.debug("gpulock: sampling failed: %s", e)
                await asyncio.sleep(max(0.05, self.interval - (loop.time() - start)))
        finally:
            for t in list(self._inflight.values()):
                t.cancel()
