"""Kept bytes seen from outside the code under test (docs/SEMANTICS.md, "Kept bytes"): the
pool's cfg fields read on the raw keys (``kept``, ``used``, ``k_kept``, ``k_told``), the raw
``status`` reply's kept fields, and how many script calls the server has run (Redis
``INFO commandstats``), for the tests that check a grant from kept bytes makes no round
trip."""

from __future__ import annotations

import redis

from gpulock.protocol.keys import pool_keys

from support.pools import _s, raw

#: The commands a script call of the pool may be sent as (gpulock/transport/scripts.py).
SCRIPT_COMMANDS = ("fcall", "evalsha", "eval")

#: Indices of the kept fields in ``status.lua``'s reply (0-based): kept_bytes, kept_count,
#: k_kept, k_told.
STATUS_KEPT = slice(35, 39)


def script_calls(c: redis.Redis) -> int:
    """Script calls (FCALL, EVALSHA, EVAL) the server has run since it started (or since the
    last CONFIG RESETSTAT)."""
    st = c.info("commandstats")
    return sum(int(st.get(f"cmdstat_{k}", {}).get("calls", 0)) for k in SCRIPT_COMMANDS)


def cfg_int(c: redis.Redis, pool: str, field: str) -> int:
    """An integer field of the pool's cfg hash (0 when absent)."""
    v = c.hget(pool_keys(pool)[0], field)
    return int(v) if v else 0


def kept_ids(c: redis.Redis, pool: str) -> list[str]:
    """The lease ids the server lists as kept (cfg field ``kept``: " <lease_id>|<channel> ..."),
    in order."""
    v = c.hget(pool_keys(pool)[0], "kept")
    return [x.split("|", 1)[0] for x in _s(v).split()] if v else []


def kept_channels(c: redis.Redis, pool: str) -> list[str]:
    """The holders' channel ids of the kept list, in its order."""
    v = c.hget(pool_keys(pool)[0], "kept")
    return [x.split("|", 1)[1] for x in _s(v).split()] if v else []


def status_kept(c: redis.Redis, pool: str) -> tuple[int, int, int, int]:
    """``(kept_bytes, kept_count, k_kept, k_told)`` from the raw ``status`` reply (an EVAL:
    it counts as a script call), and each listed lease's kept flag must agree with the cfg
    list."""
    r = raw(c, pool, "status", 1000)
    listed = {_s(x[0]): int(x[12]) for x in r[12]}
    kept = set(kept_ids(c, pool))
    assert {lid for lid, k in listed.items() if k} == kept, (listed, kept)
    kb, kc, kk, kt = (int(x) for x in r[STATUS_KEPT])
    return kb, kc, kk, kt


def check_kept_list(c: redis.Redis, pool: str) -> None:
    """The kept list names live leases only, each once, none of them resident."""
    k = pool_keys(pool)
    ids = kept_ids(c, pool)
    assert len(ids) == len(set(ids)), ids
    holders = {_s(a): _s(b) for a, b in c.hgetall(k[2]).items()}
    assert set(ids) <= set(holders), (ids, set(holders))


def settings_known(rt) -> bool:
    """Whether the pool object's runtime ``rt`` knows the pool's max_ttl and max_waiters, so
    that it makes no background ``status`` call of its own to read them
    (gpulock/runtime/recovery.py): a test that counts script calls reads the status first
    (``pool.status()``) and checks this before it counts."""
    return bool(rt.recovery.max_ttl_seen_ms and rt.recovery.max_waiters_seen)
