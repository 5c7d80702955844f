"""The OOM back-off's shared state: the rule of :mod:`gpulock.oom_backoff` driven against the
pool's ``backoff`` hash in Redis, which every worker reads, plus this worker's cache of it.

Hash ``gpulock:{pool}:backoff`` (in the pool's slot, see :mod:`gpulock.protocol.keys`), fields:

* ``pool`` → ``"<factor> <at_ms>"`` (:class:`~gpulock.oom_backoff.PoolState`);
* ``b:<bucket>`` → ``"<scale> <ok_at> <at_ms>"`` (:class:`~gpulock.oom_backoff.BucketState`),
  ``<bucket>`` the estimates hash's field (``route|b<batch>|s<tokens>``);
* ``ok:<bucket>`` → clean calls of the bucket (HINCRBY; counted only while its scale is > 1).

An OOM reads the fields and the server's TIME (one read script, on the hash's node), applies the rule and writes the new state
only if the fields still hold what was read (a compare-and-set script; read again and retry
on a race), so concurrent OOMs in several workers each apply the rule once, in some order.
A success is one HINCRBY (no race: the scale is a function of the count)."""

from __future__ import annotations

import contextvars
import logging
import time

from gpulock.oom_backoff import BackoffRule, BucketState, PoolState, decode_bucket, decode_pool
from ._backend import Backend

log = logging.getLogger("gpulock.fastapi")

# KEYS[1] the hash; ARGV: (field, expected value or "" for absent, new value) triples. Sets the
# new values only if every field holds its expected one. No rule logic: that is Python's.
_CAS = """
for i = 1, #ARGV, 3 do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if (v or '') ~= ARGV[i + 1] then return 0 end
end
for i = 1, #ARGV, 3 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 2]) end
return 1
"""

# KEYS[1] the hash; ARGV: fields (none: all). The server's TIME and the fields in one call,
# on the node that holds the hash (a cluster refuses TIME in a pipeline).
_READ = """
local t = redis.call('TIME')
if #ARGV == 0 then return {t, redis.call('HGETALL', KEYS[1])} end
return {t, redis.call('HMGET', KEYS[1], unpack(ARGV))}
"""

_CAS_TRIES = 8

#: The shape bucket whose estimate this task computed last (``Estimates.estimate`` sets it,
#: the job runner takes it for the job it starts next): the bucket an OOM of that job blames.
_last_bucket: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "gpulock_bucket", default=None
)


def note_bucket(bucket: str) -> None:
    """Remember ``bucket`` as the shape of the job this task starts next."""
    _last_bucket.set(bucket)


def take_bucket() -> str | None:
    """The bucket noted since the last job this task started (None: no estimate was asked)."""
    b = _last_bucket.get()
    if b is not None:
        _last_bucket.set(None)
    return b


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v) if v is not None else ""


class OomBackoff:
    """This worker's view of the pool's back-off, and the writes that change it.

    Args:
        rule: the numbers (None: back-off off; nothing is read or written).
        backend: the pool's Redis client and its last status (capacity).
    """

    def __init__(self, rule: BackoffRule | None, backend: Backend):
        self.rule = rule
        self._backend = backend
        self.pool_state = PoolState()
        self.buckets: dict[str, BucketState] = {}
        self.ok: dict[str, int] = {}
        self._offset_ms = 0.0  # server ms − local wall-clock ms, at the last read

    @property
    def key(self) -> str:
        """``gpulock:{pool}:backoff``."""
        return self._backend.key("backoff")

    def _now_ms(self) -> int:
        return int(time.time() * 1000 + self._offset_ms)

    def _clock(self, server_time: list[bytes]) -> int:
        """Server ms from a TIME reply ``[seconds, microseconds]``; notes the offset."""
        now = int(server_time[0]) * 1000 + int(server_time[1]) // 1000
        self._offset_ms = now - time.time() * 1000
        return now

    # ---- what the worker uses ---------------------------------------------------------------

    def factor(self) -> float:
        """The pool's factor now (1.0: no back-off)."""
        if self.rule is None:
            return 1.0
        return self.rule.factor(self.pool_state, self._now_ms())

    def scale(self, bucket: str) -> float:
        """The bucket's scale now (1.0: no back-off)."""
        st = self.buckets.get(bucket)
        if self.rule is None or st is None:
            return 1.0
        return self.rule.scale(st, self.ok.get(bucket, 0))

    def lease_amount(self, amount: int) -> int:
        """Bytes to lease for work of ``amount`` bytes: inflated by 1/factor, at most the room
        the pool can ever give a request (capacity minus the resident leases held and queued,
        as last read) — see :meth:`BackoffRule.lease_amount`."""
        f = self.factor()
        if f >= 1.0:
            return amount
        st = self._backend.status
        room = None if st is None else st.room
        return BackoffRule.lease_amount(amount, f, room)

    def state(self) -> dict[str, object]:
        """The back-off as JSON for a status answer: the factor and every bucket's scale now
        (buckets back at 1 are left out)."""
        scales = {b: round(self.scale(b), 4) for b in sorted(self.buckets)}
        return {
            "enabled": self.rule is not None,
            "factor": round(self.factor(), 4),
            "scales": {b: s for b, s in scales.items() if s > 1.0},
        }

    # ---- Redis --------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the pool's back-off hash (and the server's clock) into this worker's cache."""
        if self.rule is None or self._backend.redis is None:
            return
        now, flat = await self._backend.command("EVAL", _READ, 1, self.key)
        self._clock(now)
        fields = {_text(flat[i]): _text(flat[i + 1]) for i in range(0, len(flat), 2)}
        self.pool_state = decode_pool(fields.get("pool"))
        self.buckets, self.ok = {}, {}
        self._merge(fields)

    def _merge(self, fields: dict[str, str]) -> None:
        """Take the bucket fields of ``fields`` into the cache."""
        for k, v in fields.items():
            if k.startswith("b:"):
                self.buckets[k[2:]] = decode_bucket(v)
            elif k.startswith("ok:"):
                try:
                    self.ok[k[3:]] = int(v or 0)
                except ValueError:
                    continue

    async def oom(self, bucket: str | None) -> None:
        """An OOM inside a lease of ``bucket`` (None: of no known bucket): cut the pool's
        factor and raise the bucket's scale, by the rule, in Redis and in this cache."""
        rule = self.rule
        if rule is None or self._backend.redis is None:
            return
        fields = ["pool"] + ([f"b:{bucket}", f"ok:{bucket}"] if bucket else [])
        for _ in range(_CAS_TRIES):
            now_raw, vals = await self._backend.command("EVAL", _READ, 1, self.key, *fields)
            now = self._clock(now_raw)
            raw = [_text(v) for v in vals]
            args = ["pool", raw[0], rule.pool_oom(decode_pool(raw[0]), now).encode()]
            if bucket:
                ok = int(raw[2] or 0)
                b = rule.bucket_oom(decode_bucket(raw[1]), ok, now)
                args += [f"b:{bucket}", raw[1], b.encode()]
            if int(await self._backend.command("EVAL", _CAS, 1, self.key, *args)) == 1:
                new = dict(zip(fields, raw))
                new.update({args[i]: args[i + 2] for i in range(0, len(args), 3)})
                self.pool_state = decode_pool(new["pool"])
                self._merge(new)
                return
        log.warning(
            "gpulock: OOM back-off of pool %s not recorded: lost %d races",
            self._backend.pool_name,
            _CAS_TRIES,
        )

    async def success(self, bucket: str | None) -> None:
        """A clean call of ``bucket``: count it when the bucket's scale is raised (else
        nothing is written)."""
        if (
            self.rule is None
            or self._backend.redis is None
            or bucket is None
            or self.scale(bucket) <= 1.0
        ):
            return
        self.ok[bucket] = int(await self._backend.command("HINCRBY", self.key, f"ok:{bucket}", 1))
