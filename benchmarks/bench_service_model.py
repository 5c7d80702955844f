"""The model ``benchmarks/service.py`` serves: the service's own ``sleep`` test model
(``gpulock_service.models.SleepModel``: "runs" for ``sleep:<s>`` seconds and needs
``GPULOCK_SLEEP_BYTES`` per input), loaded through the service's documented plug-in point
(``GPULOCK_MODEL=bench_service_model:factory``, with ``benchmarks/`` on ``PYTHONPATH``), plus:

* a **history**: every call appends ``{"s": start, "e": end, "b": bytes, "pid": pid}`` (work
  interval in ``time.monotonic()`` seconds — one clock for every process on Linux — and the
  bytes the work really needs) to ``$BENCH_SVC_HISTORY.<pid>.jsonl``. The benchmark sweeps these
  intervals for the bytes in use at every instant, whatever admitted the work;
* the **budget variant** (``BENCH_SVC_VARIANT``):

  - ``gpulock``: nothing more; the service leases the request's bytes from the pool;
  - ``per-worker``: the service runs with ``GPULOCK_DISABLED=1`` (no leases) and each worker
    admits work with its own in-process semaphore weighted in bytes, sized to the whole budget
    (each worker believes it has the GPU to itself): the naive fix;
  - ``global``: the service leases, but every request asks for the whole capacity, so the pool
    is a single global lock (one request at a time across all workers).
"""

from __future__ import annotations

import json
import os
import threading
import time

from gpulock_service.models import SleepModel


class BenchModel(SleepModel):
    name = "bench-sleep"

    def __init__(self, settings):
        super().__init__(settings.sleep_seconds, settings.sleep_bytes)
        self.variant = os.environ.get("BENCH_SVC_VARIANT", "gpulock")
        self.capacity = int(os.environ["BENCH_SVC_CAPACITY"])
        self._prefix = os.environ.get("BENCH_SVC_HISTORY")
        self._hist = None
        self._hist_lock = threading.Lock()
        self._cond = threading.Condition()
        self._used = 0

    def estimate_bytes(self, batch: int, tokens: int) -> int:
        if self.variant == "global":
            return self.capacity
        return super().estimate_bytes(batch, tokens)

    def _write(self, rec: dict) -> None:
        if not self._prefix:
            return
        with self._hist_lock:
            if self._hist is None:
                self._hist = open(f"{self._prefix}.{os.getpid()}.jsonl", "a", buffering=1)
            self._hist.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def embed(self, texts: list[str]) -> list[list[float]]:
        need = self.bytes_per_input * max(1, len(texts))
        gate = self.variant == "per-worker"
        if gate:
            with self._cond:
                self._cond.wait_for(lambda: self._used + need <= self.capacity)
                self._used += need
        try:
            t0 = time.monotonic()
            out = super().embed(texts)
            t1 = time.monotonic()
        finally:
            if gate:
                with self._cond:
                    self._used -= need
                    self._cond.notify_all()
        self._write({"s": t0, "e": t1, "b": need, "pid": os.getpid()})
        return out


def factory(settings) -> BenchModel:
    return BenchModel(settings)
