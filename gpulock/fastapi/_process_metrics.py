"""``process_*`` of every live worker in prometheus-client's multiprocess mode (gunicorn, or
``uvicorn --workers``), where its default process collector is not in the registry that
``/metrics`` answers from (that registry is built from the multiprocess directory's files, which
hold counters, gauges and histograms only).

Each worker's series carry a ``pid`` label: the worker that answers a scrape reads the
others' ``/proc/<pid>`` files (they run as the same user), so one scrape shows every worker's
CPU seconds, resident memory, open fds and start time. Not summed: a start time has no sum,
and a sum hides the one worker that leaks memory or fds (``sum(process_resident_memory_bytes)``
gives the total in PromQL). The master (gunicorn's arbiter, uvicorn's supervisor) is left out:
it serves no request and holds no model or lease, and the process manager that runs it is
what watches it.

On a system without ``/proc`` (macOS) there are none, as with prometheus-client's own
collector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Iterator

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = ["WorkerProcesses"]


def _constant(pid: int) -> Callable[[], int]:
    return lambda: pid


class WorkerProcesses:
    """A collector: prometheus-client's ``ProcessCollector`` families for each of ``pids``, in
    one family per metric with a ``pid`` label. A pid that is gone by the scrape is skipped."""

    def __init__(self, pids: Iterable[int], proc: str = "/proc"):
        self._pids = sorted(set(pids))
        self._proc = proc

    def collect(self) -> Iterator[Metric]:
        from prometheus_client import ProcessCollector
        from prometheus_client.metrics_core import Metric as MetricFamily

        merged: dict[str, Metric] = {}
        for pid in self._pids:
            one = ProcessCollector(pid=_constant(pid), proc=self._proc, registry=None)
            for fam in one.collect():
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = MetricFamily(fam.name, fam.documentation, fam.type)
                for s in fam.samples:
                    out.add_sample(s.name, {**s.labels, "pid": str(pid)}, s.value)
        return iter(merged.values())
