"""``process_*`` on /metrics under gunicorn (prometheus-client's multiprocess mode, where its
own process collector is not in the registry the scrape is answered from): each live worker's
CPU seconds, resident memory, open fds and start time, labelled ``pid``, whichever worker
answers; a worker that is gone is no longer reported. Single-process mode (no
``PROMETHEUS_MULTIPROC_DIR``) keeps prometheus-client's own, unlabelled."""

from __future__ import annotations

import os
import signal
import time

import pytest
from support.pools import GiB

from gpulock.fastapi._process_metrics import WorkerProcesses

ENV = {
    "GPULOCK_MODEL": "sleep",
    "GPULOCK_SLEEP_SECONDS": "0",
    "GPULOCK_RESIDENT": "0",
}
NAMES = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
)


def _by_pid(m: dict[str, float], name: str) -> dict[int, float]:
    pre = name + "{pid="
    return {int(k[len(pre) : -1]): v for k, v in m.items() if k.startswith(pre)}


def _until(pred, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        out = pred()
        if out:
            return out
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.1)


@pytest.mark.timeout(180)
def test_every_live_workers_process_metrics_by_pid(make_service):
    svc = make_service("procmetrics", workers=2, env=ENV, capacity=GiB)
    svc.wait_ready(2, timeout=90)
    workers = set(svc.worker_pids())
    assert len(workers) == 2
    # every scrape (whichever worker answers) shows both workers
    for _ in range(6):
        m = svc.metrics()
        for name in NAMES:
            assert set(_by_pid(m, name)) == workers, (name, sorted(k for k in m if "process" in k))
        rss = _by_pid(m, "process_resident_memory_bytes")
        assert all(v > 1 << 20 for v in rss.values()), rss
        assert all(v >= 3 for v in _by_pid(m, "process_open_fds").values())
        starts = _by_pid(m, "process_start_time_seconds")
        assert all(time.time() - 600 < v <= time.time() for v in starts.values()), starts
    # a killed worker's series go with it; its replacement's come
    gone = min(workers)
    os.kill(gone, signal.SIGKILL)

    def replaced():
        now = set(svc.worker_pids())
        m = svc.metrics()
        pids = set(_by_pid(m, "process_resident_memory_bytes"))
        return len(now) == 2 and gone not in now and pids == now and now

    now = _until(replaced)
    assert gone not in now


def test_collector_skips_a_pid_that_is_gone(tmp_path):
    """A pid without /proc files (gone before the scrape) has no series; this process has
    them all."""
    fams = {f.name: f for f in WorkerProcesses([os.getpid(), 2**22 + 1]).collect()}
    assert {n.removesuffix("_total") for n in NAMES} <= set(fams)
    for f in fams.values():
        assert {s.labels["pid"] for s in f.samples} == {str(os.getpid())}, f
