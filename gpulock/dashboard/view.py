"""The live view of pools: the one JSON document behind the service's and the broker's
``/dashboard`` and ``gpulock top``.

:func:`dashboard_view` reads each pool's status and its history (:mod:`gpulock.admin.samples`) and
returns plain JSON types. Amounts are bytes, times seconds (history instants: Unix ms on the
Redis clock); formatting is the UI's. Holder metadata is shown without ``owner`` (a broker
token's identity) and no lease id or request id is included, so the view names no token.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Sequence

from gpulock_common.aio import wait_for

from gpulock.transport.cluster import is_cluster_client
from gpulock.admin.listing import Listing, Unreachable, alist_pools
from gpulock.protocol.replies import PoolStatus
from gpulock.transport.retry import RETRYABLE
from gpulock.admin.samples import Sample, read_counters, read_samples
from gpulock.errors import BackendUnavailable, GpuLockError

__all__ = ["HIDDEN_HOLDER_FIELDS", "RATE_WINDOW_S", "READ_TIMEOUT_S", "dashboard_view", "pool_view"]

# Holder fields never shown: the broker's token identity (gpulock_broker.auth).
HIDDEN_HOLDER_FIELDS = frozenset({"owner"})
RATE_WINDOW_S = 10.0  # grant rate: over the newest samples spanning this many seconds
MINUTE_MS = 60_000
#: Seconds the view waits for a pool's numbers (a pool on a shard that hangs: then an error).
READ_TIMEOUT_S = 5.0


def _holder(meta: dict[str, Any]) -> dict[str, str]:
    return {str(k): str(v)[:128] for k, v in meta.items() if k not in HIDDEN_HOLDER_FIELDS}


def _rate(samples: Sequence[Sample], field: str, window_ms: float) -> float | None:
    """Per second, of the cumulative ``field`` over the newest samples spanning ``window_ms``
    (None with fewer than two; a counter that went back, as after the pool was made again,
    counts from its new start)."""
    if len(samples) < 2:
        return None
    last = samples[-1]
    first = next((s for s in samples if last.t - s.t <= window_ms), samples[-2])
    if first is last:
        first = samples[-2]
    dt = (last.t - first.t) / 1000
    if dt <= 0:
        return None
    delta: int = getattr(last, field) - getattr(first, field)
    return max(0, delta) / dt


def _in_last_minute(samples: Sequence[Sample], field: str) -> int | None:
    if not samples:
        return None
    last = samples[-1]
    first = next(s for s in samples if last.t - s.t <= MINUTE_MS)
    delta: int = getattr(last, field) - getattr(first, field)
    return max(0, delta)


def pool_view(
    st: PoolStatus, samples: Sequence[Sample], counters: dict[str, int]
) -> dict[str, Any]:
    """One pool's part of the view (see :func:`dashboard_view`)."""
    return {
        "pool": st.pool,
        "capacity": st.capacity,
        "used": st.used,
        "free": st.free,
        "resident": st.resident,
        "lease_count": st.lease_count,
        "waiter_count": st.waiter_count,
        "max_waiters": st.max_waiters,
        "grants": st.grants,
        "grant_rate": _rate(samples, "grants", RATE_WINDOW_S * 1000),
        "drain": (
            None
            if st.drain is None
            else {
                "bytes_per_s": st.drain.bytes_per_s,
                "grants_per_s": st.drain.grants_per_s,
                "out_of_order": st.drain.out_of_order,
            }
        ),
        "rejected": counters.get("rejected", 0),
        "rejected_last_minute": _in_last_minute(samples, "rejected"),
        "oom": counters.get("oom", 0),
        "oom_last_minute": _in_last_minute(samples, "oom"),
        "grace_left": st.grace_left,
        "policy": st.policy,
        "backfill_window": st.backfill_window,
        "placement": st.placement,
        "devices": [{"index": d.index, "capacity": d.capacity, "used": d.used} for d in st.devices],
        "preemption": None if st.preemption is None else st.preemption.shown(),
        "yields": {
            "asked": st.yields.asked,
            "done": st.yields.done,
            "done_seconds": st.yields.done_seconds,
            "taken": st.yields.taken,
            "mean_time_to_yield": st.yields.mean_time_to_yield,
        },
        "kept_bytes": st.kept_bytes,
        "kept_leases": st.kept_leases,
        "releases_kept": st.releases_kept,
        "kept_asked_back": st.kept_asked_back,
        "external": st.external,
        "effective_capacity": st.effective_capacity,
        "overusers": [
            {
                "holder": _holder(o.get("holder") or {}),  # no lease ids: see DASHBOARD.md
                "leased": int(o.get("leased", 0)),
                "actual": int(o.get("actual", 0)),
                "excess": int(o.get("excess", 0)),
            }
            for o in st.overusers
        ],
        "leases": [
            {
                "holder": _holder(lz.holder),
                "amount": lz.amount,
                "token": lz.token,
                "expires_in": round(lz.expires_in, 3),
                "held_for": round(lz.held_for, 3),
                "device": lz.device,
                "priority": lz.priority,
                # asked to yield: seconds until the pool takes it back; None: not asked
                "yield_in": None if lz.yield_in is None else round(lz.yield_in, 3),
                "kept": lz.kept,  # its holder keeps it (docs/SEMANTICS.md, "Kept bytes")
            }
            for lz in st.leases
        ],
        "waiters": [
            {
                "position": w.position,
                "holder": _holder(w.holder),
                "amount": w.amount,
                "waited": round(w.waited, 3),
                "priority": w.priority,
                # a queued growth: the fencing token of the lease it grows (never its id)
                "growth_token": w.growth_token,
                "estimated_wait_s": w.estimated_wait,  # None: the drain rate is not measured
            }
            for w in st.waiters
        ],
        "history": {
            "t": [s.t for s in samples],
            "capacity": [s.capacity for s in samples],
            "used": [s.used for s in samples],
            "resident": [s.resident for s in samples],
        },
    }


async def dashboard_view(
    redis: Any,
    pools: Sequence[str],
    status: Callable[[str, int], Awaitable[PoolStatus]],
    *,
    limit: int = 100,
    history: int = 900,
    unreachable: Sequence[Unreachable] = (),
    read_timeout: float = READ_TIMEOUT_S,
) -> dict[str, Any]:
    """The view of ``pools``: ``{"pools": [pool view, ...], "errors": {pool: message},
    "unreachable": [shard, ...]}``.

    Args:
        redis: a ``redis.asyncio.Redis`` on the pools' server (history, counters).
        pools: pool names, shown in this order.
        status: reads a pool's status (``(name, limit) -> PoolStatus``).
        limit: most leases and waiters listed per pool.
        history: most samples per pool (one a second).
        unreachable: the shards of a Redis Cluster the listing of ``pools`` could not read
            (:class:`gpulock.admin.listing.Unreachable`).
        read_timeout: seconds to wait for a pool's numbers (then it is in ``errors``).

    A pool view: ``capacity``, ``used``, ``free``, ``resident`` (bytes); ``lease_count``,
    ``waiter_count``, ``grants``; ``policy`` ("fifo" or "backfill") and ``backfill_window``
    (seconds); ``grant_rate`` (grants/s over the last 10 s of samples, None
    without two); ``rejected`` and ``oom`` (cumulative 503s and OOMs) with ``*_last_minute``;
    ``preemption`` (``{"gap", "yield_grace_s"}``, None when off) and ``yields`` (``asked``,
    ``done``, ``done_seconds``, ``taken``, ``mean_time_to_yield``: seconds, None before a
    yield; docs/SEMANTICS.md "Preemption");
    ``kept_bytes`` and ``kept_leases`` (the bytes, counted in ``used``, and the count of the
    leases their holders keep), ``releases_kept`` and ``kept_asked_back`` (releases answered
    "kept", kept leases whose holders were asked to give them back; docs/SEMANTICS.md "Kept
    bytes");
    ``leases`` (``holder``, ``amount``, ``token``, ``expires_in``, ``held_for``, ``device``,
    ``priority``: None when it can never be asked to yield, ``yield_in``: seconds until the
    pool takes it back when asked to yield, else None, ``kept``: whether its holder keeps
    it); ``waiters``
    (``position``, ``holder``, ``amount``, ``waited``, ``priority``, ``growth_token``: for a
    queued growth of a held lease the lease's fencing token, ``amount`` being the bytes it
    grows by, else None; ``estimated_wait_s``: seconds until its grant, None while the
    drain rate is not measured); ``drain`` (``bytes_per_s``, ``grants_per_s``, ``out_of_order``: how fast the
    queue drains while busy, docs/SEMANTICS.md "Wait estimate"; None while not measured);
    ``history`` (lists ``t``, ``capacity``,
    ``used``, ``resident``, oldest first). A pool that cannot be read is in ``errors``
    instead. A shard: ``{"node": "host:port", "slots": [[lo, hi], ...], "error": "..."}``,
    those of ``unreachable`` and, on a cluster, the shard of each pool that could not be read
    because Redis did not answer, once a listing (:func:`gpulock.admin.listing.alist_pools`, at
    most its bound more) finds that shard's master unreachable. Raises nothing of gpulock's;
    cancellation passes through.
    """

    async def read(name: str) -> dict[str, Any]:
        st, samples, counters = await asyncio.gather(
            status(name, limit), read_samples(redis, name, history), read_counters(redis, name)
        )
        return pool_view(st, samples, counters)

    async def one(name: str) -> dict[str, Any] | tuple[str, bool]:
        """The pool's view, or (why not, whether Redis did not answer)."""
        try:
            return await wait_for(read(name), read_timeout)
        except asyncio.TimeoutError:
            return f"no answer within {read_timeout:g} s", True
        except BackendUnavailable as e:
            return str(e), True
        except GpuLockError as e:
            return str(e), False
        except Exception as e:  # noqa: BLE001 - redis-py's errors from the history reads
            return f"{type(e).__name__}: {e}", isinstance(e, RETRYABLE)

    parts = await asyncio.gather(*(one(n) for n in pools))
    out: dict[str, Any] = {"pools": [], "errors": {}}
    shards = list(unreachable)
    failed: list[str] = []
    for name, part in zip(pools, parts):
        if isinstance(part, tuple):
            out["errors"][name], down = part
            if down:
                failed.append(name)
        else:
            out["pools"].append(part)
    if failed and is_cluster_client(redis):
        # Redis did not answer for these pools: name their shards if a listing (each master
        # asked on its own connection, bounded) confirms that they do not answer
        try:
            listing = await alist_pools(redis)
        except Exception:  # noqa: BLE001 - no node answers: the errors say enough
            listing = Listing([])
        for u in listing.unreachable:
            if u.node not in {s.node for s in shards} and any(u.holds(n) for n in failed):
                shards.append(u)
    out["unreachable"] = [u.to_dict() for u in shards]
    return out
