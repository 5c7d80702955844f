"""Prometheus metrics of the integration: one set of counters and histograms per process
(prometheus-client's multiprocess mode sums them when ``PROMETHEUS_MULTIPROC_DIR`` is set, as
under gunicorn), the pool's gauges read from Redis at scrape time, and the ``/metrics``
response. docs/SERVICE.md lists the metrics."""

from __future__ import annotations

import os
import re
import struct
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from fastapi import Response
from gpulock_common.aio import wait_for

from gpulock.protocol.replies import PoolStatus

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from gpulock._async import AsyncPool

_BYTES_BUCKETS = tuple(float(2**k) for k in range(20, 38, 2))  # 1 MiB .. 64 GiB
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_WAIT_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)


class _Metrics:
    """The per-process metric objects (created once, by :func:`metrics`)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.requests = Counter(
            "gpulock_requests",
            "Guarded requests answered, by route and HTTP status",
            ["route", "status"],
        )
        self.acquire_wait = Histogram(
            "gpulock_acquire_wait_seconds",
            "Seconds from arrival until the lease was granted",
            ["route"],
            buckets=_WAIT_BUCKETS,
        )
        self.hold = Histogram(
            "gpulock_hold_seconds",
            "Seconds a request's lease was held (grant to release)",
            ["route"],
            buckets=_WAIT_BUCKETS,
        )
        self.run = Histogram(
            "gpulock_inference_seconds",
            "Seconds the guarded work ran in its thread",
            ["route"],
            buckets=_WAIT_BUCKETS,
        )
        self.grants = Counter(
            "gpulock_grants", "Leases granted to this service's requests", ["route"]
        )
        self.timeouts = Counter(
            "gpulock_acquire_timeouts", "Requests answered 503: no grant in time", ["route"]
        )
        self.queue_full = Counter(
            "gpulock_queue_full", "Requests refused: the pool's queue was full", ["route"]
        )
        self.lost = Counter(
            "gpulock_leases_lost",
            "Leases found lost (before or during the guarded work)",
            ["route"],
        )
        self.yields = Counter(
            "gpulock_yields_requested",
            "Leases of this service's work the pool asked to yield to a higher-priority "
            "request (preemption; only preemptible routes' and background work's)",
            ["route"],
        )
        self.oom = Counter(
            "gpulock_cuda_oom", "CUDA out-of-memory errors inside a lease", ["route"]
        )
        self.fatal = Counter(
            "gpulock_cuda_fatal_errors", "Sticky CUDA errors that made the worker exit", ["route"]
        )
        self.inference_timeouts = Counter(
            "gpulock_inference_timeouts", "Requests answered 504", ["route"]
        )
        self.disconnected = Counter(
            "gpulock_client_disconnected",
            "Guarded requests whose client closed the connection before the answer, by "
            "phase: 'waiting' (left the queue, never granted), 'running' (the work "
            "finished, its result was dropped) or 'streaming' (a stream's client hung up after "
            "it began: the stream was closed)",
            ["route", "phase"],
        )
        self.replays = Counter(
            "gpulock_idempotent_replays",
            "Requests answered from a stored result or by joining a running attempt (X-Request-ID)",
            ["route", "how"],
        )
        self.estimate = Histogram(
            "gpulock_request_estimate_bytes",
            "Bytes leased per request (the estimate)",
            ["route"],
            buckets=_BYTES_BUCKETS,
        )
        self.http_requests = Counter(
            "gpulock_http_requests",
            "HTTP requests answered, every status (refusals before the guard too), by "
            "method, route (the route's path template; <unmatched> for none) and status",
            ["method", "route", "status"],
        )
        self.http_duration = Histogram(
            "gpulock_http_request_duration_seconds",
            "Seconds from a request's arrival until its answer was sent, by method and route",
            ["method", "route"],
            buckets=_WAIT_BUCKETS,
        )
        self.batches = Counter(
            "gpulock_batches",
            "Batches started (dynamic batching), by route and why the batch closed: 'full', "
            "'timeout' (max wait), 'room' (the next request would not fit the pool's room "
            "now), 'idle' (a thread was free and nothing else waited)",
            ["route", "reason"],
        )
        self.batch_size = Histogram(
            "gpulock_batch_size",
            "Requests per batch (dynamic batching)",
            ["route"],
            buckets=_SIZE_BUCKETS,
        )
        self.batch_wait = Histogram(
            "gpulock_batch_wait_seconds",
            "Seconds a request waited for its batch to close (dynamic batching)",
            ["route"],
            buckets=_WAIT_BUCKETS,
        )
        self.batch_bytes = Histogram(
            "gpulock_batch_bytes",
            "Bytes leased per batch (the batch's estimate; dynamic batching)",
            ["route"],
            buckets=_BYTES_BUCKETS,
        )
        self.batch_splits = Counter(
            "gpulock_batch_splits",
            "Batches split in halves after a CUDA OOM (each half retried under the same lease)",
            ["route"],
        )
        self.resident = Gauge(
            "gpulock_worker_resident_bytes",
            "Bytes held by live workers' resident leases",
            multiprocess_mode="livesum",
        )
        self.kept_grants = Counter(
            "gpulock_kept_grants",
            "Leases granted to this service's requests from kept bytes, with no Redis round "
            "trip (GpuLimiter keep=, GPULOCK_KEEP)",
        )
        self.kept_idle = Gauge(
            "gpulock_kept_idle_bytes",
            "Bytes of live workers' idle kept leases: leased in Redis, free for the worker's "
            "next request of the same size (GpuLimiter keep=, GPULOCK_KEEP)",
            multiprocess_mode="livesum",
        )
        self.ready = Gauge(
            "gpulock_workers_ready", "Live workers that are ready", multiprocess_mode="livesum"
        )
        self.workers = Gauge("gpulock_workers", "Live workers", multiprocess_mode="livesum")


_metrics: _Metrics | None = None


def metrics() -> _Metrics:
    """This process's metrics (registered on first use)."""
    global _metrics
    if _metrics is None:
        _metrics = _Metrics()
    return _metrics


def multiproc_dir() -> str | None:
    """The multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``), or None in single-process mode."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


_LIVE_FILE = re.compile(r"^gauge_live[a-z]*_(\d+)\.db$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's: its /proc may still be readable
    return True


def live_gauge_pids(path: str) -> set[int]:
    """The pids with live-gauge files in the multiprocess directory ``path``, alive or not
    (every started worker has them: each sets ``gpulock_workers``)."""
    try:
        names = os.listdir(path)
    except OSError:
        return set()
    return {int(m.group(1)) for m in map(_LIVE_FILE.match, names) if m}


def sweep_dead_processes(path: str) -> set[int]:
    """Remove the live-gauge files of processes that are gone (what gunicorn's ``child_exit``
    hook does; this covers ``uvicorn --workers N`` and workers killed with -9). Returns the
    pids of the live processes that have such files (every started worker: each sets
    ``gpulock_workers``)."""
    from prometheus_client import multiprocess

    live = set()
    for pid in live_gauge_pids(path):
        if _alive(pid):
            live.add(pid)
        else:
            # prometheus_client's multiprocess module is unannotated.
            multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]
    return live


def ready_workers(path: str) -> int:
    """Live workers that report ready in the multiprocess directory ``path``: the sum of
    ``gpulock_workers_ready`` over the processes alive, as ``/metrics`` shows it (changes
    nothing in the directory)."""
    from prometheus_client.multiprocess import MultiProcessCollector

    try:
        names = os.listdir(path)
    except OSError:
        return 0
    files = [
        os.path.join(path, n)
        for n in names
        if (m := _LIVE_FILE.match(n)) and n.startswith("gauge_livesum_") and _alive(int(m.group(1)))
    ]
    try:
        merged = MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]
    except (OSError, ValueError, struct.error):
        # a file that went away with its worker, or one a starting worker has created but not
        # yet sized (prometheus-client reads its first 4 bytes: struct.error on an empty file);
        # the caller polls again
        return 0
    for family in merged:
        if family.name == "gpulock_workers_ready":
            return int(sum(s.value for s in family.samples))
    return 0


def _pool_families(pool: str, st: PoolStatus | None, error: str | None) -> Iterator[Metric]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    up = GaugeMetricFamily(
        "gpulock_pool_up",
        "1 when the pool's status was read from Redis for this scrape",
        labels=["pool"],
    )
    up.add_metric([pool], 0.0 if st is None else 1.0)
    yield up
    if st is None:
        return
    for name, doc, v in (
        (
            "gpulock_pool_capacity_bytes",
            "Pool capacity, read from Redis at scrape time",
            st.capacity,
        ),
        (
            "gpulock_pool_used_bytes",
            "Bytes leased in the pool, read from Redis at scrape time",
            st.used,
        ),
        (
            "gpulock_pool_leases",
            "Live leases in the pool, read from Redis at scrape time",
            st.lease_count,
        ),
        (
            "gpulock_pool_waiters",
            "Requests queued in the pool, read from Redis at scrape time",
            st.waiter_count,
        ),
        (
            "gpulock_device_external_bytes",
            "Bytes the device sampler's live report shows in use outside the pool's leases "
            "(0 when no report counts)",
            st.external,
        ),
        (
            "gpulock_pool_effective_capacity_bytes",
            "Bytes the pool may grant in all now: capacity minus the device's external use",
            st.effective_capacity,
        ),
        # kept bytes (docs/SEMANTICS.md, "Kept bytes"): leases their holders keep
        (
            "gpulock_pool_kept_bytes",
            "Bytes of the leases their holders keep for their next requests (part of "
            "gpulock_pool_used_bytes), read from Redis at scrape time",
            st.kept_bytes,
        ),
        (
            "gpulock_pool_kept_leases",
            "Leases their holders keep for their next requests, read from Redis at scrape time",
            st.kept_leases,
        ),
    ):
        g = GaugeMetricFamily(name, doc, labels=["pool"])
        g.add_metric([pool], float(v))
        yield g
    # The wait estimate (docs/SEMANTICS.md, "Wait estimate"): no sample while not measured
    # (a new pool) or nobody waits, rather than a 0 that would read as "drains at no speed".
    head = st.waiters[0].estimated_wait if st.waiters else None
    for name, doc, val in (
        (
            "gpulock_pool_drain_bytes_per_second",
            "How fast the pool's queue drains while busy, bytes granted to queued requests "
            "per second (the server's rate; no sample while not measured)",
            None if st.drain is None else st.drain.bytes_per_s,
        ),
        (
            "gpulock_pool_drain_grants_per_second",
            "How fast the pool's queue drains while busy, grants to queued requests per "
            "second (the server's rate; no sample while not measured)",
            None if st.drain is None else st.drain.grants_per_s,
        ),
        (
            "gpulock_pool_head_estimated_wait_seconds",
            "The estimated wait of the request at the head of the pool's queue, seconds (no "
            "sample while nobody waits or the drain rate is not measured)",
            head,
        ),
    ):
        g = GaugeMetricFamily(name, doc, labels=["pool"])
        if val is not None:
            g.add_metric([pool], float(val))
        yield g
    over = GaugeMetricFamily(
        "gpulock_holder_overuse_bytes",
        "Bytes a holder uses on the device beyond its leases, for each over-user the device "
        "sampler's live report flags (at most 8)",
        labels=["pool", "host", "pid", "lease"],
    )
    for o in st.overusers:
        h = o.get("holder") or {}
        over.add_metric(
            [pool, str(h.get("host", "")), str(o.get("pid", "")), ",".join(o.get("lease_ids", []))],
            float(o.get("excess", 0)),
        )
    yield over
    for name, doc, v in (
        ("gpulock_pool_grants", "Leases the pool has granted (all clients), from Redis", st.grants),
        (
            "gpulock_pool_reaped_leases",
            "Expired leases the pool has reaped, from Redis",
            st.reaped_leases,
        ),
        (
            "gpulock_pool_reaped_waiters",
            "Dead waiters the pool has dropped, from Redis",
            st.reaped_waiters,
        ),
        (
            "gpulock_pool_releases_kept",
            "Releases the pool answered 'kept' (the holder keeps the lease), from Redis",
            st.releases_kept,
        ),
        (
            "gpulock_pool_kept_asked_back",
            "Kept leases whose holders the pool asked to give them back (a request did not "
            "fit), from Redis",
            st.kept_asked_back,
        ),
    ):
        c = CounterMetricFamily(name, doc, labels=["pool"])
        c.add_metric([pool], float(v))
        yield c
    yield from _yield_families(pool, st)


def _yield_families(pool: str, st: PoolStatus) -> Iterator[Metric]:
    """Preemption (docs/SEMANTICS.md, "Preemption"): the pool's counters, from Redis."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

    y = st.yields
    for name, doc, v in (
        ("gpulock_pool_yields_asked", "Leases the pool has asked to yield, from Redis", y.asked),
        (
            "gpulock_pool_yields_done",
            "Leases asked to yield that were released before the pool took them back, from Redis",
            y.done,
        ),
        (
            "gpulock_pool_yields_taken",
            "Leases asked to yield that the pool took back at their deadline, from Redis",
            y.taken,
        ),
    ):
        c = CounterMetricFamily(name, doc, labels=["pool"])
        c.add_metric([pool], float(v))
        yield c
    t = SummaryMetricFamily(
        "gpulock_pool_yield_seconds",
        "Seconds from the ask to the release of the leases that yielded (count: those leases), "
        "from Redis",
        labels=["pool"],
    )
    t.add_metric([pool], count_value=y.done, sum_value=y.done_seconds)
    yield t
    g = GaugeMetricFamily(
        "gpulock_pool_leases_yielding",
        "Leases asked to yield and not gone yet, from Redis",
        labels=["pool"],
    )
    g.add_metric([pool], float(y.outstanding))
    yield g


def _backoff_families(pool: str, backoff: dict[str, Any] | None) -> Iterator[Metric]:
    """The OOM back-off as this worker last read it (gpulock.fastapi._backoff.OomBackoff.state)."""
    from prometheus_client.core import GaugeMetricFamily

    if not backoff or not backoff.get("enabled"):
        return
    f = GaugeMetricFamily(
        "gpulock_oom_backoff_factor",
        "Share of the pool's capacity leases may fill after CUDA OOMs (1: no back-off); "
        "each lease asks for its estimate / factor",
        labels=["pool"],
    )
    f.add_metric([pool], float(backoff["factor"]))
    yield f
    g = GaugeMetricFamily(
        "gpulock_estimate_scale",
        "OOM back-off multiplier on a shape bucket's estimate (only buckets above 1)",
        labels=["pool", "bucket"],
    )
    for bucket, scale in backoff.get("scales", {}).items():
        g.add_metric([pool, bucket], float(scale))
    yield g


class _StaticCollector:
    def __init__(self, families: Iterable[Metric]):
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class _Chain:
    """A collector yielding the families of ``sources`` in turn."""

    def __init__(self, *sources: object):
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        for src in self._sources:
            yield from src.collect()  # type: ignore[attr-defined]


async def metrics_response(
    pool: AsyncPool | None,
    pool_name: str,
    accept: str | None = None,
    *,
    backoff: dict[str, Any] | None = None,
) -> Response:
    """The ``/metrics`` response: this process's (or, in multiprocess mode, all workers')
    counters and histograms, plus the pool's gauges read from Redis now (2 s at most), and
    ``process_*`` (CPU seconds, resident and virtual memory, open and max fds, start time):
    this process's, or in multiprocess mode each live worker's, labelled ``pid``
    (:mod:`._process_metrics`).
    ``accept``: the request's Accept header: OpenMetrics text when it asks for
    ``application/openmetrics-text``, else Prometheus text (0.0.4). ``backoff``: the OOM
    back-off state to show (``OomBackoff.state()``)."""
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.exposition import choose_encoder

    st, err = None, None
    if pool is not None:
        try:
            st = await wait_for(pool.status(limit=1), 2.0)  # the head waiter: its estimate
        except Exception as e:  # noqa: BLE001 — reported as gpulock_pool_up 0
            err = str(e)
    metrics()
    d = multiproc_dir()
    source: object = REGISTRY  # single process: its own process_* (prometheus-client's)
    workers: object = _StaticCollector(())
    if d:
        from prometheus_client import multiprocess

        from ._process_metrics import WorkerProcesses

        live = sweep_dead_processes(d)
        source = CollectorRegistry(auto_describe=False)
        multiprocess.MultiProcessCollector(source, d)  # type: ignore[no-untyped-call]  # unannotated
        workers = WorkerProcesses(live | {os.getpid()})
    reg = CollectorRegistry(auto_describe=False)
    families = [*_pool_families(pool_name, st, err), *_backoff_families(pool_name, backoff)]
    reg.register(_Chain(source, workers, _StaticCollector(families)))
    encode, content_type = choose_encoder(accept or "")
    return Response(encode(reg), media_type=content_type)
