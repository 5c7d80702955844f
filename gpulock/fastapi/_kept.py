"""This worker's kept bytes in its metrics (docs/SEMANTICS.md, "Kept bytes"; ``GpuLimiter(keep=)``,
the service's ``GPULOCK_KEEP``): ``gpulock_kept_grants_total`` counts the grants its pool object
made from kept bytes, ``gpulock_kept_idle_bytes`` shows the bytes of its idle kept leases. Both
are copied from the pool object's own counts (``KeptLeases.counts()``) at each of the worker's
status reads (``reaper_interval``) and when it answers a scrape, so a request pays nothing for
them; in prometheus-client's multiprocess mode each worker writes its own (the counter summed,
the gauge a sum over the live workers)."""

from __future__ import annotations

from typing import Any

from ._metrics import metrics

#: The counts of a worker whose pool object is not made yet (or keeps nothing).
NO_KEPT: dict[str, Any] = {
    "idle": 0,
    "idle_bytes": 0,
    "grants": 0,
    "kept": 0,
    "given_back": 0,
    "draining": False,
}


def kept_counts(pool: Any) -> dict[str, Any]:
    """``pool``'s kept leases now and its counters since it was made: ``{"idle", "idle_bytes",
    "grants", "kept", "given_back", "draining"}`` (:meth:`gpulock.AsyncPool.kept`);
    :data:`NO_KEPT` for None."""
    if pool is None:
        return dict(NO_KEPT)
    counts: dict[str, Any] = pool.kept()
    return counts


class KeptMetrics:
    """Copies one worker's kept-bytes counts into its metrics (see the module)."""

    def __init__(self) -> None:
        self._pool: Any = None  # the pool object whose grants were counted so far
        self._grants = 0  # its grants from kept bytes counted so far

    def sync(self, pool: Any) -> dict[str, Any]:
        """Add ``pool``'s grants from kept bytes made since the last call to the counter and
        set the gauge to its idle kept bytes now (0 for None). Returns its counts."""
        c = kept_counts(pool)
        if pool is not self._pool:  # a new pool object (stop, then start): it counts from 0
            self._pool, self._grants = pool, 0
        m = metrics()
        if c["grants"] > self._grants:
            m.kept_grants.inc(c["grants"] - self._grants)
            self._grants = c["grants"]
        m.kept_idle.set(c["idle_bytes"])
        return c
