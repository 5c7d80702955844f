"""The GPU truth check: does gpulock keep a real GPU free of CUDA OOMs while it stays well used?

    python benchmarks/gpu_truth.py [--minutes 8] [--workers 4] [--out benchmarks/results/gpu_truth.json]
    python benchmarks/gpu_truth.py --dry-run          # CPU, tiny model, fake device: seconds

Without CUDA (and without ``--dry-run``) it prints that it skipped and exits 0.

The model is an encoder built in code (``torch.nn.TransformerEncoder``, random weights, no
download): BERT-large-sized on the GPU (24 layers, d=1024, 16 heads, ff 4096, fp16), tiny in
the dry run (2 layers, d=64, 4 heads, ff 128, fp32), so memory, not accuracy, is measured.
``--workers`` processes each load it and serve a mix of shapes (``SHAPES``) from client tasks.

Sections (each a function in :data:`SECTIONS`, run in :data:`RUN_ORDER`, printed a to e):

* (c) calibration: per shape, the peak memory of one forward (``max_memory_allocated`` above
  the baseline) against gpulock's estimates of it: the formula (the service's
  ``BertEstimator`` with this model's constants) and the calibrated estimate
  (``GpuLimiter.calibrate``: the bucket's measured peak × its margin, read back through
  ``GpuLimiter.estimate``). Target: the calibrated estimate is never under the peak and at
  most 10 % over it at bucket-sized shapes. Runs first: (a) and (b) size their load from it.
* (a) a per-worker ``asyncio.Semaphore`` under 10× overload: each worker lets its share of
  what fits run at once (``ceil(fit / workers)`` permits; ``fit`` = how many mean-shape
  requests the pool's capacity less the weights holds by the calibrated estimates), with
  ``ceil(10 × fit / workers)`` client tasks sending requests. Counts CUDA OOMs and poisoned
  contexts (a sticky CUDA error, ``gpulock.cuda.is_fatal_cuda_error``, in a forward or in the
  probe run after each OOM).
* (b) the same clients under gpulock: an embedded Redis, one pool with capacity = the
  device's total memory (``torch.cuda.mem_get_info``) minus :data:`RESERVE` (the CUDA
  contexts and the allocator's fragmentation, which no lease accounts for), each worker's
  weights held as a resident lease, each request leasing its calibrated estimate. Targets:
  0 OOMs, peak device memory in use / total ≥ 85 %. Also reported: time-weighted mean of in
  use / total, p99 latency (arrival to answer, queueing included), requests/s.
* (d) reconciliation: a pool with a ``DeviceSampler`` on the device (GPU: ``open_reader
  ("auto")``; dry run: a ``FakeReader`` file written from the fake device before each read),
  :data:`D_CLIENTS` clients in this process leasing and allocating capacity / D_CLIENTS each;
  mid-run another process grabs X = capacity / 4 outside gpulock. Reported: effective capacity
  and external use before / during / after (each read with the clients paused and the report
  settled), grab to report (s), peak granted during the grab, OOMs during it, grabber exit to
  full capacity (s). Targets: 0 OOMs, peak granted ≤ effective during ≤ capacity − X, after =
  before (on the GPU within the smoother's threshold).
* (e) an over-user: a process takes a lease of capacity / 64, then uses 4× it on the device.
  Reported: the pid and lease the pool's status flags (``overusers``), the excess, the time
  to the flag against the rule's hold. Target: its own pid and lease, excess ≥ 3× the lease.

(d) and (e) have fixed time budgets (:data:`TRUTH_TIMES`); the load sections get the rest.

The workers run with the service's ``PYTORCH_CUDA_ALLOC_CONF`` (``expandable_segments:True``
unless set; :mod:`gpulock_service.alloc_conf`) and, like the service, do not empty the
allocator's cache between requests: whether the cached blocks of several processes stay
within the pool's reserve is one of the things (b) finds out.

Time: each section's load phase lasts a share of ``--minutes`` (:func:`plan`); worker start
and drain have their own bounds, so the run ends within ``--minutes`` by construction (the
plan is printed first, and refused when it does not fit).

The dry run replaces the GPU by :class:`FakeDevice`: a byte budget shared by the worker
processes (``--fake-capacity``); each forward takes its "true" bytes from it (the model's
own activation formula × :data:`FAKE_TRUTH`) for as long as the forward runs and raises the
message of a CUDA OOM when they do not fit. Its numbers are the fake device's, not
measurements; the dry run checks the logic (tests/integration/test_bench_gpu_truth_smoke.py).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "service", ROOT / "clients" / "common", ROOT / "clients" / "python"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from _util import percentile  # noqa: E402

from gpulock.units import format_size, parse_size  # noqa: E402

GiB, MiB = 2**30, 2**20
#: Bytes of the device's total no pool grants: the CUDA contexts of the workers and of this
#: process (about 500 MiB each on recent drivers) and the caching allocator's fragmentation;
#: max(2 GiB + 600 MiB per worker, 3 % of the total). The dry run's fake device has no
#: contexts: 3 % of its capacity.
RESERVE_CONTEXT = 600 * MiB
#: The fake device's "true" bytes of a forward: the encoder's activation formula (the
#: service's BertEstimator.peak) × this. Any value > 1 makes the formula's safety (2.0) an
#: over-estimate and the calibration the measurement it replaces.
FAKE_TRUTH = 1.25
OVERLOAD = 10
#: Client tasks (and threads) per worker at most; the overload reached is reported.
MAX_CLIENTS = 256
#: Seconds of ``--minutes`` kept for what the plan does not bound: imports, starting Redis,
#: writing the JSON, ending the workers.
SLACK_S = 20.0

MODELS = {
    # BERT-large: d 1024, 16 heads, ff 4096, 24 layers, fp16
    "gpu": {"layers": 24, "d": 1024, "heads": 16, "ff": 4096, "dtype": "float16"},
    "dry": {"layers": 2, "d": 64, "heads": 4, "ff": 128, "dtype": "float32"},
}
#: (batch, tokens) of the request mix: bucket-sized shapes (powers of two) and shapes inside
#: a bucket, whose estimate is their bucket's.
SHAPES = {
    "gpu": [(64, 256), (64, 384), (64, 512), (128, 384), (128, 512)],
    "dry": [(2, 8), (2, 12), (2, 16), (2, 32), (4, 32)],
}


# ---- the model and the devices ------------------------------------------------------------


def build_model(cfg: dict[str, Any], device: str) -> Any:
    """An encoder of ``cfg``'s size with random weights, in eval mode, on ``device``."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        cfg["d"], cfg["heads"], cfg["ff"], dropout=0.0, batch_first=True
    )
    model = torch.nn.TransformerEncoder(layer, cfg["layers"], enable_nested_tensor=False)
    return model.to(device=device, dtype=getattr(torch, cfg["dtype"])).eval()


def estimator(cfg: dict[str, Any]) -> Any:
    """The service's per-request formula with this model's constants."""
    from gpulock_service.estimators import BertEstimator

    elem = 2 if cfg["dtype"] == "float16" else 4
    floor = 2 * MiB if elem == 2 else 1  # the dry run's shapes are far under one segment
    return BertEstimator(cfg["d"], cfg["ff"], cfg["heads"], cfg["layers"], elem, floor=floor)


def weight_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class CudaDevice:
    """The real GPU (device 0)."""

    name = "cuda"

    def __init__(self, spec: dict[str, Any]):
        import torch

        self.torch, self.dev = torch, "cuda:0"
        torch.cuda.init()
        self.total = int(torch.cuda.mem_get_info(0)[1])

    def used(self) -> int:
        """Bytes in use on the whole device (all processes), by the driver."""
        free, total = self.torch.cuda.mem_get_info(0)
        return int(total - free)

    def reserved(self) -> int:
        return int(self.torch.cuda.memory_reserved(0))

    def load(self, cfg: dict[str, Any]) -> Any:
        return build_model(cfg, self.dev)

    def forward(self, model: Any, cfg: dict[str, Any], batch: int, tokens: int) -> None:
        t = self.torch
        with t.inference_mode():
            x = t.randn(batch, tokens, cfg["d"], device=self.dev, dtype=getattr(t, cfg["dtype"]))
            model(x)
        t.cuda.synchronize(self.dev)

    def peak(self, model: Any, cfg: dict[str, Any], batch: int, tokens: int) -> int:
        from gpulock.cuda import measure_peak

        return measure_peak(lambda: self.forward(model, cfg, batch, tokens), self.dev)

    def unload(self, model: Any) -> None:
        del model
        self.after_oom()

    def probe(self) -> None:
        """Raises the sticky error of a poisoned context."""
        t = self.torch
        t.cuda.synchronize(self.dev)
        t.ones(1, device=self.dev).sum().item()

    def after_oom(self) -> None:
        from gpulock.cuda import empty_cache

        empty_cache()


class FakeDevice:
    """A byte budget shared by processes (``spec["used"]``, a ``multiprocessing.Value``):
    weights are taken at load, each forward takes its true bytes while it runs."""

    name = "fake"

    def __init__(self, spec: dict[str, Any]):
        self.total, self._used = int(spec["capacity"]), spec["used"]
        self._est = estimator(MODELS["dry"])

    def used(self) -> int:
        return int(self._used.value)

    def reserved(self) -> int:
        return self.used()

    def _take(self, n: int) -> None:
        with self._used.get_lock():
            if self._used.value + n > self.total:
                raise RuntimeError(
                    f"CUDA out of memory. Tried to allocate {format_size(n)} (fake device)"
                )
            self._used.value += n

    def _give(self, n: int) -> None:
        with self._used.get_lock():
            self._used.value -= n

    def truth(self, batch: int, tokens: int) -> int:
        return math.ceil(self._est.peak(batch, tokens) * FAKE_TRUTH)

    def load(self, cfg: dict[str, Any]) -> Any:
        model = build_model(cfg, "cpu")
        self._take(weight_bytes(model))
        return model

    def forward(self, model: Any, cfg: dict[str, Any], batch: int, tokens: int) -> None:
        import torch

        n = self.truth(batch, tokens)
        self._take(n)
        try:
            with torch.inference_mode():
                model(torch.randn(batch, tokens, cfg["d"]))
        finally:
            self._give(n)

    def peak(self, model: Any, cfg: dict[str, Any], batch: int, tokens: int) -> int:
        self.forward(model, cfg, batch, tokens)
        return self.truth(batch, tokens)

    def unload(self, model: Any) -> None:
        self._give(weight_bytes(model))

    def probe(self) -> None:
        return None

    def after_oom(self) -> None:
        return None


def make_device(spec: dict[str, Any]) -> CudaDevice | FakeDevice:
    return FakeDevice(spec) if spec["kind"] == "fake" else CudaDevice(spec)


def reserve_bytes(kind: str, total: int, workers: int) -> int:
    """See :data:`RESERVE_CONTEXT`."""
    if kind == "fake":
        return math.ceil(total * 0.03)
    return max(2 * GiB + workers * RESERVE_CONTEXT, math.ceil(total * 0.03))


# ---- the worker processes -----------------------------------------------------------------


def worker_main(idx: int, spec: dict[str, Any], cmds: Any, results: Any) -> None:
    """One worker: load the model, then run each command from ``cmds`` (a section's load)
    and put its stats on ``results``; ``None`` ends it."""
    import torch

    torch.set_num_threads(1)
    dev = make_device(spec)
    cfg = MODELS[spec["model"]]
    model = dev.load(cfg)
    results.put({"worker": idx, "ready": True, "weights": weight_bytes(model)})
    while True:
        cmd = cmds.get()
        if cmd is None:
            return
        try:
            out = asyncio.run(_serve(dev, model, cfg, cmd))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the section
            out = {"error": f"{type(e).__name__}: {e}"}
        out["worker"] = idx
        results.put(out)


async def _serve(dev: Any, model: Any, cfg: dict[str, Any], cmd: dict[str, Any]) -> dict[str, Any]:
    """``cmd["clients"]`` client tasks sending requests of ``cmd["shapes"]`` in turn until
    ``cmd["until"]`` (wall clock), each admitted by this worker's semaphore (``mode`` "sem")
    or by a lease of the shape's estimate from the pool (``mode`` "gpulock")."""
    from gpulock import AcquireTimeout, AsyncPool
    from gpulock.cuda import drop_traceback, is_fatal_cuda_error, is_oom

    clients, shapes, until = cmd["clients"], cmd["shapes"], cmd["until"]
    loop = asyncio.get_running_loop()
    ex = ThreadPoolExecutor(clients)
    st: dict[str, Any] = {"ok": 0, "oom": 0, "poisoned": 0, "errors": 0, "timeouts": 0}
    st["lat"] = []
    st["max_reserved"] = 0
    sem = asyncio.Semaphore(cmd.get("permits", clients))
    pool = resident = None
    if cmd["mode"] == "gpulock":
        pool = AsyncPool.from_url(cmd["url"], cmd["pool"])
        resident = await pool.acquire(cmd["resident"], holder={"purpose": "resident:model"})
    poisoned = threading.Event()

    def run(b: int, s: int) -> None:
        try:
            dev.forward(model, cfg, b, s)
        except BaseException as e:
            if is_fatal_cuda_error(e):
                poisoned.set()
            raise
        finally:
            st["max_reserved"] = max(st["max_reserved"], dev.reserved())

    async def one(b: int, s: int) -> None:
        t0 = time.monotonic()
        try:
            if pool is not None:
                wait = max(0.001, cmd["give_up"] - time.time())
                async with pool.lease(cmd["amounts"][f"{b}x{s}"], timeout=wait):
                    await loop.run_in_executor(ex, run, b, s)
            else:
                async with sem:
                    await loop.run_in_executor(ex, run, b, s)
        except AcquireTimeout:  # still queued when the section ended: not an error of the pool
            st["timeouts"] += 1
            return
        except Exception as e:  # noqa: BLE001 - counted by kind
            if is_oom(e):
                st["oom"] += 1
                drop_traceback(e)  # its frames pin the forward's tensors
                dev.after_oom()
                try:
                    await loop.run_in_executor(ex, dev.probe)
                except Exception as pe:  # noqa: BLE001
                    if is_fatal_cuda_error(pe):
                        poisoned.set()
            elif not poisoned.is_set():
                st["errors"] += 1
                st.setdefault("first_error", f"{type(e).__name__}: {e}"[:300])
            return
        st["ok"] += 1
        st["lat"].append(time.monotonic() - t0)

    async def client(k: int) -> None:
        i = k
        while time.time() < until and not poisoned.is_set():
            b, s = shapes[i % len(shapes)]
            i += 1
            await one(b, s)

    while time.time() < cmd["start"]:
        await asyncio.sleep(min(0.05, max(0.0, cmd["start"] - time.time())))
    await asyncio.gather(*(client(k) for k in range(clients)))
    st["poisoned"] = int(poisoned.is_set())
    if resident is not None:
        await resident.release()
    if pool is not None:
        await pool.aclose()
    ex.shutdown(wait=True)
    dev.after_oom()
    return st


class Workers:
    """``n`` worker processes (spawned: CUDA does not survive fork), each with the model."""

    def __init__(self, n: int, spec: dict[str, Any], start_timeout: float):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.cmds = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(target=worker_main, args=(i, spec, self.cmds[i], self.results), daemon=True)
            for i in range(n)
        ]
        for p in self.procs:
            p.start()
        deadline = time.monotonic() + start_timeout
        ready = [self.results.get(timeout=max(0.1, deadline - time.monotonic())) for _ in range(n)]
        self.weights = ready[0]["weights"]

    def run(self, cmd: dict[str, Any], sample: Callable[[], None], timeout: float) -> list[dict]:
        """Send ``cmd`` to every worker; ``sample()`` every 50 ms until all answered."""
        for q in self.cmds:
            q.put(cmd)
        out: list[dict] = []
        deadline = time.monotonic() + timeout
        while len(out) < len(self.cmds):
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers did not finish within {timeout:.0f}s")
            sample()
            try:
                out.append(self.results.get(timeout=0.05))
            except Exception:  # noqa: BLE001 - queue.Empty: sample again
                continue
        return out

    def close(self) -> None:
        for q in self.cmds:
            q.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


# ---- the sections ---------------------------------------------------------------------------


class Sampler:
    """Device memory in use, sampled at a fixed interval: peak and time-weighted mean."""

    def __init__(self, dev: Any, since: float, until: float):
        self.dev, self.since, self.until = dev, since, until
        self.samples: list[tuple[float, int]] = []

    def __call__(self) -> None:
        now = time.time()
        if self.since <= now <= self.until:
            self.samples.append((now, self.dev.used()))

    def peak(self) -> int:
        return max((u for _, u in self.samples), default=0)

    def time_weighted(self) -> float:
        """Mean of in-use bytes, each sample weighted by the time to the next."""
        s = self.samples
        if len(s) < 2:
            return float(s[0][1]) if s else 0.0
        area = sum(u * (s[i + 1][0] - t) for i, (t, u) in enumerate(s[:-1]))
        return area / (s[-1][0] - s[0][0])


def _load(ctx: dict[str, Any], mode: str, extra: dict[str, Any]) -> dict[str, Any]:
    """Run one section's load on the workers and sum their stats."""
    p, dev, w, load_s = ctx["plan"], ctx["device"], ctx["workers"], ctx["load_s"]
    start = time.time() + 0.5
    until = start + load_s
    cmd = {
        "mode": mode,
        "clients": ctx["clients"],
        "shapes": ctx["shapes"],
        "start": start,
        "until": until,
        "give_up": until + p["drain_s"] / 2,  # a lease wait still queued then gives up
        **extra,
    }
    sampler = Sampler(dev, start, until)
    res = w.run(cmd, sampler, timeout=0.5 + load_s + p["drain_s"])
    errs = [r["error"] for r in res if "error" in r]
    if errs:
        raise RuntimeError("; ".join(errs))
    lat = [x for r in res for x in r["lat"]]
    total = dev.total
    out = {
        "ok": sum(r["ok"] for r in res),
        "oom": sum(r["oom"] for r in res),
        "poisoned": sum(r["poisoned"] for r in res),
        "errors": sum(r["errors"] for r in res),
        "timeouts": sum(r["timeouts"] for r in res),
        "first_error": next((r["first_error"] for r in res if "first_error" in r), None),
        "peak_used_frac": sampler.peak() / total,
        "mean_used_frac": sampler.time_weighted() / total,
        "sum_worker_peak_reserved_frac": sum(r["max_reserved"] for r in res) / total,
        "p99_s": percentile(lat, 99),
        "req_per_s": sum(r["ok"] for r in res) / load_s,
        "load_s": round(load_s, 2),
        "samples": len(sampler.samples),
    }
    return out


def section_c(ctx: dict[str, Any]) -> dict[str, Any]:
    """(c) calibration error per shape; stores the estimates (a) and (b) use."""
    from gpulock.fastapi import GpuLimiter
    from gpulock.fastapi._calibration import Estimates

    dev, cfg, formula = ctx["device"], ctx["cfg"], ctx["formula"]
    margin = inspect.signature(Estimates.calibrate).parameters["margin"].default
    model = dev.load(cfg)
    route = "truth"
    rows = []

    async def go() -> None:
        lim = GpuLimiter(ctx["redis"].url, "truth-cal", capacity=dev.total, configure="set")
        await lim.start()
        try:
            if dev.name == "cuda":
                await lim.calibrate(
                    route,
                    lambda b, s: dev.forward(model, cfg, b, s),
                    ctx["shapes"],
                    "cuda:0",
                    formula,
                )
            else:  # no CUDA peak to measure: the fake device's, stored as calibrate stores
                from gpulock.fastapi import next_bucket

                for b, s in ctx["shapes"]:
                    bb, ss = next_bucket(b), next_bucket(s, minimum=8)
                    peak = dev.peak(model, cfg, bb, ss)
                    await lim.backend.redis.hset(
                        lim.estimates.key, f"{route}|b{bb}|s{ss}", math.ceil(peak * margin)
                    )
            await lim.estimates.refresh()
            for b, s in ctx["shapes"]:
                measured = dev.peak(model, cfg, b, s)
                cal = lim.estimate(route, b, s, formula)
                f = int(formula(b, s))
                bucket_sized = (b & (b - 1)) == 0 and (s & (s - 1)) == 0
                rows.append(
                    {
                        "shape": f"{b}x{s}",
                        "measured": measured,
                        "formula": f,
                        "calibrated": cal,
                        "formula_err": (f - measured) / measured,
                        "calibrated_err": (cal - measured) / measured,
                        "bucket_sized": bucket_sized,
                    }
                )
        finally:
            await lim.stop()

    try:
        asyncio.run(go())
    finally:
        dev.unload(model)
    ctx["amounts"] = {r["shape"]: r["calibrated"] for r in rows}
    edge = [r for r in rows if r["bucket_sized"]]
    # within 10 % (the byte calibrate's ceil adds aside) at bucket-sized shapes
    ok = all(r["calibrated"] >= r["measured"] for r in rows) and all(
        r["calibrated"] <= math.ceil(r["measured"] * 1.10) + 1 for r in edge
    )
    return {"rows": rows, "margin": margin, "target_met": ok}


def _fit(ctx: dict[str, Any]) -> int:
    """Mean-shape requests the device's room holds by the calibrated estimates."""
    room = ctx["capacity"] - ctx["workers"].weights * ctx["plan"]["workers"]
    mean = sum(ctx["amounts"].values()) / len(ctx["amounts"])
    return max(1, int(room // mean))


def section_a(ctx: dict[str, Any]) -> dict[str, Any]:
    """(a) a per-worker asyncio.Semaphore sized as such a service sizes it (its share of what
    fits: ``ceil(fit / workers)`` permits), under OVERLOAD× as many clients."""
    permits = math.ceil(_fit(ctx) / ctx["plan"]["workers"])
    out = _load(ctx, "sem", {"permits": permits})
    out["permits_per_worker"] = permits
    return out


def section_b(ctx: dict[str, Any]) -> dict[str, Any]:
    """(b) the same clients under gpulock."""
    from gpulock import Pool

    pool = "truth"
    with Pool.from_url(ctx["redis"].url, pool) as p:
        p.configure(ctx["capacity"])
    resident = ctx["workers"].weights
    out = _load(
        ctx,
        "gpulock",
        {"url": ctx["redis"].url, "pool": pool, "amounts": ctx["amounts"], "resident": resident},
    )
    out["capacity"] = ctx["capacity"]
    out["target_met"] = out["oom"] == 0 and out["peak_used_frac"] >= 0.85
    return out


# ---- (d) reconciliation and (e) over-use: the device sampler against the device -----------

#: (d)'s and (e)'s fixed time budgets (s): (d) ``d_s``, of which ``d_phase_s`` before, during
#: and after the grab each; (e) ``e_s``. The dry run's are seconds; the GPU's fit 8 minutes.
TRUTH_TIMES = {
    "dry": {"d_s": 12.0, "d_phase_s": 0.5, "e_s": 8.0, "hold_s": 0.5, "interval_s": 0.1},
    "gpu": {"d_s": 50.0, "d_phase_s": 8.0, "e_s": 25.0, "hold_s": 5.0, "interval_s": 1.0},
}
#: The dry run's fake grabber: a pid no process has (pid_max is at most 4194304).
FAKE_GRABBER_PID = 4_000_000
#: (d)'s clients: this many, each leasing capacity / this; together they ask for it all.
D_CLIENTS = 8

#: The process that holds memory outside gpulock ((d)) or over its lease ((e)): argv URL POOL
#: LEASE ALLOC FLAG KIND. It takes a LEASE-byte lease when LEASE > 0, then (KIND "cuda")
#: allocates ALLOC bytes with torch; writes FLAG (the lease id, or "-") once both are done and
#: holds everything until FLAG is removed.
_HOLDER = """
import os, sys, time
url, pool, lease_n, alloc_n, flag, kind = sys.argv[1:7]
lease = None
if int(lease_n) > 0:
    from gpulock import Pool
    lease = Pool.from_url(url, pool).acquire(int(lease_n), ttl=10.0, timeout=30)
x = None
if kind == "cuda" and int(alloc_n) > 0:
    import torch
    x = torch.empty(int(alloc_n), dtype=torch.uint8, device="cuda:0")
    x.fill_(1)
    torch.cuda.synchronize()
with open(flag + ".tmp", "w") as f:
    f.write(lease.id if lease is not None else "-")
os.replace(flag + ".tmp", flag)
while os.path.exists(flag):
    time.sleep(0.02)
"""


def _holder_proc(url: str, pool: str, lease_n: int, alloc_n: int, flag: Path, kind: str) -> Any:
    """Start :data:`_HOLDER` (its argv as named), with this checkout's packages importable."""
    import os
    import subprocess

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "clients" / "python"), str(ROOT / "clients" / "common")]
        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    return subprocess.Popen(
        [sys.executable, "-c", _HOLDER, url, pool, str(lease_n), str(alloc_n), str(flag), kind],
        env=env,
        cwd=ROOT,
    )


async def _until(cond: Callable[[], Any], deadline: float, what: str) -> None:
    """Poll the async ``cond`` every 20 ms until true. Raises TimeoutError at ``deadline``
    (monotonic s), naming ``what``."""
    while not await cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not by the section's deadline")
        await asyncio.sleep(0.02)


class _Mirror:
    """The dry run's device reader: before each read it writes the fake device file from the
    fake device (its ``used``) and the processes listed in :attr:`procs` (pid -> bytes: the
    workers' weights, this process's allocations, the grabber, the over-user), then reads it
    with a :class:`~gpulock.devices.FakeReader`."""

    name = "fake"

    def __init__(self, dev: Any, path: Path, procs: dict[int, int]):
        from gpulock.devices import FakeReader

        self.dev, self.path, self.procs = dev, path, procs
        self.extra = 0  # bytes the file shows in use beyond the fake device's (the over-user)
        self.fake = FakeReader(path)

    def read(self, index: int) -> Any:
        from gpulock.devices import write_fake_devices

        procs = {str(k): v for k, v in dict(self.procs).items() if v > 0}
        doc = {"index": index, "total": self.dev.total, "used": self.dev.used() + self.extra}
        write_fake_devices(self.path, [{**doc, "processes": procs}])
        return self.fake.read(index)


def _truth_env(ctx: dict[str, Any], name: str) -> tuple[Any, Any, dict[int, int]]:
    """(reader, times, procs) for section ``name``: the dry run's :class:`_Mirror` (procs: the
    workers' pids with their weights) or ``open_reader("auto")`` on the GPU."""
    import os
    import tempfile

    dev = ctx["device"]
    times = TRUTH_TIMES["dry" if dev.name == "fake" else "gpu"]
    procs: dict[int, int] = {}
    if dev.name == "fake":
        for p in ctx["workers"].procs:
            procs[int(p.pid)] = ctx["workers"].weights
        procs[os.getpid()] = 0
        path = Path(tempfile.mkdtemp(prefix=f"gpu_truth_{name}_")) / "devices.json"
        return _Mirror(dev, path, procs), times, procs
    from gpulock.devices import open_reader

    return open_reader("auto"), times, procs


def _sampler(pool: Any, reader: Any, times: dict[str, float], fake: bool) -> Any:
    """The section's DeviceSampler: the library's defaults on the GPU; in the dry run the
    fake device's scale (a 1 KiB threshold, a 0.3 s fall, no slack: its bytes are KiB)."""
    from gpulock.devices.sampler import DeviceSampler
    from gpulock.devices.truth import DEFAULT_SLACK, Smoother

    iv = times["interval_s"]
    sm = Smoother(threshold=1024, fall_samples=2, fall_seconds=0.3) if fake else Smoother()
    return DeviceSampler(
        pool,
        reader,
        0,
        interval=iv,
        report_ttl=max(10.0, 20 * iv),
        overuse_hold=times["hold_s"],
        smoother=sm,
        slack=0 if fake else DEFAULT_SLACK,
    )


def section_d(ctx: dict[str, Any]) -> dict[str, Any]:
    """(d) reconciliation: :data:`D_CLIENTS` clients in this process lease
    capacity / D_CLIENTS each, allocate it on the device, hold it briefly and free it, while a
    sampler reconciles the pool with the device. The clients pause (hold nothing), another
    process grabs X = capacity / 4 outside gpulock, and once the report shows it they run
    again: the pool must grant at most capacity − external (≤ capacity − X), with 0 OOMs.
    Then they pause, the grabber exits, and the pool must come back to its capacity before."""
    import os

    from gpulock import AcquireTimeout, AsyncPool, Pool
    from gpulock.cuda import drop_traceback, is_oom
    from gpulock.devices.truth import DEFAULT_THRESHOLD

    dev = ctx["device"]
    fake = dev.name == "fake"
    reader, times, procs = _truth_env(ctx, "d")
    cap = ctx["capacity"]
    chunk = cap // D_CLIENTS
    grab = cap // 4
    pool_name = "truth-d"
    with Pool.from_url(ctx["redis"].url, pool_name) as sp:
        sp.configure(cap)
    t0 = time.monotonic()
    deadline = t0 + times["d_s"]
    phase = times["d_phase_s"]
    me = os.getpid()
    row: dict[str, Any] = {"capacity": cap, "grab": grab, "chunk": chunk}
    tol = 0 if fake else DEFAULT_THRESHOLD  # the smoother ignores changes under its threshold

    async def go() -> None:
        pool = AsyncPool.from_url(ctx["redis"].url, pool_name)
        s = _sampler(pool, reader, times, fake)
        rounds: list[Any] = []
        st_task = asyncio.create_task(s.run(rounds.append))
        running = asyncio.Event()
        stop = False
        held = {"now": 0, "peak": 0}
        ooms = {"n": 0}
        stats = {"granted_during": 0}
        during = {"on": False}
        loop = asyncio.get_running_loop()
        ex = ThreadPoolExecutor(D_CLIENTS)

        def alloc(n: int) -> Any:
            if fake:
                dev._take(n)
                procs[me] = procs.get(me, 0) + n
                return n
            import torch

            x = torch.empty(n, dtype=torch.uint8, device="cuda:0")
            x.fill_(1)
            torch.cuda.synchronize()
            return [x]  # a box: free() empties it, so no reference outlives the free

        def free(x: Any, n: int) -> None:
            if fake:
                procs[me] -= n
                dev._give(n)
                return
            x.clear()
            from gpulock.cuda import empty_cache

            empty_cache()  # cached blocks beyond the leases would count as external

        async def client() -> None:
            while not stop:
                if not running.is_set():
                    await asyncio.sleep(0.01)
                    continue
                try:
                    lease = await pool.acquire(chunk, ttl=30, timeout=0.2)
                except AcquireTimeout:
                    continue
                try:
                    held["now"] += chunk
                    held["peak"] = max(held["peak"], held["now"])
                    if during["on"]:
                        stats["granted_during"] = max(stats["granted_during"], held["now"])
                    try:
                        x = await loop.run_in_executor(ex, alloc, chunk)
                    except Exception as e:  # noqa: BLE001 - counted when an OOM
                        if not is_oom(e):
                            raise
                        ooms["n"] += 1
                        drop_traceback(e)  # its frames pin the tensors
                        if not fake:
                            from gpulock.cuda import empty_cache

                            empty_cache()
                    else:
                        await asyncio.sleep(0.02)
                        await loop.run_in_executor(ex, free, x, chunk)
                finally:
                    held["now"] -= chunk
                    await lease.release()

        async def has_round() -> bool:
            return s.last is not None and s.last.holder

        async def idle() -> bool:
            return held["now"] == 0

        async def settled() -> Any:
            """The pool's status once the clients hold nothing and the sampler has published
            what the device shows then: a round that began after they stopped (the second
            from now) whose published external is its reading's (the clients' leases and
            the device are read one after the other, so while they run a round can see a
            freed lease's bytes still on the device: a rise, published at once)."""
            await _until(idle, deadline, "the clients to pause")
            n0 = len(rounds)

            async def ok() -> bool:
                r = rounds[-1] if len(rounds) >= n0 + 2 else None
                return r is not None and r.holder and abs(r.external - r.external_raw) <= tol

            await _until(ok, deadline, "the sampler's report to settle")
            return await pool.status()

        clients = [asyncio.create_task(client()) for _ in range(D_CLIENTS)]
        grabber = None
        flag = Path("/nonexistent")
        try:
            await _until(has_round, deadline, "the sampler's first round")
            running.set()
            await asyncio.sleep(phase)
            running.clear()
            before = await settled()
            row["peak_granted_before"] = held["peak"]
            row["effective_before"], row["external_before"] = (
                before.effective_capacity,
                before.external,
            )
            t_grab = time.monotonic()
            if fake:
                dev._take(grab)
                procs[FAKE_GRABBER_PID] = grab
            else:
                import tempfile

                flag = Path(tempfile.mkdtemp(prefix="gpu_truth_d_")) / "grabbed"
                grabber = _holder_proc(ctx["redis"].url, pool_name, 0, grab, flag, "cuda")

                async def grabbed() -> bool:
                    if grabber.poll() is not None:
                        raise RuntimeError(f"the grabber exited with {grabber.returncode}")
                    return flag.exists()

                await _until(grabbed, deadline, "the grabber's allocation")
                t_grab = time.monotonic()

            async def reported() -> bool:
                return (await pool.status()).external >= before.external + grab

            await _until(reported, deadline, "the report of the grab")
            row["grab_to_report_s"] = round(time.monotonic() - t_grab, 3)
            during["on"] = True
            ooms["n"] = 0
            running.set()
            await asyncio.sleep(phase)
            running.clear()
            st = await settled()
            row["effective_during"], row["external_during"] = st.effective_capacity, st.external
            during["on"] = False
            row["peak_granted_during"] = stats["granted_during"]
            row["ooms_during"] = ooms["n"]
            t_free = time.monotonic()
            if fake:
                procs.pop(FAKE_GRABBER_PID)
                dev._give(grab)
            else:
                flag.unlink()
                await asyncio.to_thread(grabber.wait, max(1.0, deadline - time.monotonic()))

            async def back() -> bool:
                st = await pool.status()
                return st.effective_capacity >= before.effective_capacity - tol

            await _until(back, deadline, "the pool's capacity to come back")
            row["free_to_back_s"] = round(time.monotonic() - t_free, 3)
            after = await settled()
            row["effective_after"], row["external_after"] = (
                after.effective_capacity,
                after.external,
            )
        finally:
            stop = True
            running.set()
            await asyncio.gather(*clients, return_exceptions=True)
            st_task.cancel()
            await asyncio.gather(st_task, return_exceptions=True)
            ex.shutdown(wait=True)
            if grabber is not None and grabber.poll() is None:
                grabber.kill()
                grabber.wait()
            await pool.aclose()

    asyncio.run(go())
    row["granted_limit_during"] = cap - grab
    row["target_met"] = (
        row["ooms_during"] == 0
        and row["peak_granted_during"] <= row["effective_during"] <= cap - grab
        and row["effective_after"] >= row["effective_before"] - tol
    )
    return row


def section_e(ctx: dict[str, Any]) -> dict[str, Any]:
    """(e) an over-user flagged: a process takes a lease of capacity / 64 through gpulock,
    then uses 4× that on the device (GPU: a torch allocation, plus its CUDA context; dry run:
    the fake file lists its pid with 4× its lease). The sampler must flag it in the pool's
    status (``overusers``: its pid and lease, the excess in bytes) once it has been over for
    the rule's hold; reported: the time from the allocation to the flag against that hold."""
    import tempfile

    from gpulock import AsyncPool, Pool

    dev = ctx["device"]
    fake = dev.name == "fake"
    reader, times, procs = _truth_env(ctx, "e")
    if reader.name not in ("nvml", "fake"):
        # torch's reader has no per-process use, and over-use is per process
        raise RuntimeError(
            f"(e) needs per-process device use (NVML: pip install nvidia-ml-py), "
            f"the reader here is {reader.name}"
        )
    cap = ctx["capacity"]
    lease_n = max(1, cap // 64)
    use = 4 * lease_n
    pool_name = "truth-e"
    with Pool.from_url(ctx["redis"].url, pool_name) as sp:
        sp.configure(cap)
    deadline = time.monotonic() + times["e_s"]
    flag = Path(tempfile.mkdtemp(prefix="gpu_truth_e_")) / "allocated"
    row: dict[str, Any] = {"leased": lease_n, "uses": use, "hold_s": times["hold_s"]}

    async def go() -> None:
        pool = AsyncPool.from_url(ctx["redis"].url, pool_name)
        s = _sampler(pool, reader, times, fake)
        st_task = asyncio.create_task(s.run())
        proc = _holder_proc(
            ctx["redis"].url, pool_name, lease_n, 0 if fake else use, flag, dev.name
        )
        try:

            async def allocated() -> bool:
                if proc.poll() is not None:
                    raise RuntimeError(f"the over-user exited with {proc.returncode}")
                return flag.exists()

            await _until(allocated, deadline, "the over-user's lease and allocation")
            lease_id = flag.read_text()
            if fake:
                procs[proc.pid] = use
                reader.extra = use
            t_over = time.monotonic()

            async def flagged() -> bool:
                st = await pool.status()
                return any(o.get("pid") == proc.pid for o in st.overusers)

            await _until(flagged, deadline, "the over-user to be flagged")
            row["time_to_flag_s"] = round(time.monotonic() - t_over, 3)
            st = await pool.status()
            o = next(o for o in st.overusers if o.get("pid") == proc.pid)
            row["pid"], row["flagged_pid"] = proc.pid, o["pid"]
            row["lease_id"], row["flagged_lease_ids"] = lease_id, ",".join(o["lease_ids"])
            row["flagged_leased"], row["flagged_actual"] = o["leased"], o["actual"]
            row["excess"] = o["excess"]
        finally:
            flag.unlink(missing_ok=True)
            procs.pop(proc.pid, None)
            if fake:
                reader.extra = 0
            try:
                await asyncio.to_thread(proc.wait, 10)
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: end it
                proc.kill()
                await asyncio.to_thread(proc.wait)
            st_task.cancel()
            await asyncio.gather(st_task, return_exceptions=True)
            await pool.aclose()

    asyncio.run(go())
    row["target_met"] = (
        row["flagged_pid"] == row["pid"]
        and row["flagged_lease_ids"] == row["lease_id"]
        and row["excess"] >= use - lease_n
        # the fake's over-use starts when the clock does; on the GPU it started earlier
        and (not fake or row["time_to_flag_s"] >= row["hold_s"])
    )
    return row


#: Section name → function(ctx) → its row (a dict; ``target_met`` a bool when it has
#: targets). A section that runs load on the workers (``_load``) also gets a share in
#: LOAD_SHARE, which its time is planned from; (d) and (e) have fixed budgets (TRUTH_TIMES).
SECTIONS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "a": section_a,
    "b": section_b,
    "c": section_c,
    "d": section_d,
    "e": section_e,
}
#: (c) first: (a) and (b) size their load and lease amounts from its estimates; (d) and (e)
#: last, on pools of their own.
RUN_ORDER = ["c", "a", "b", "d", "e"]
#: Share of the load time each load section gets.
LOAD_SHARE = {"a": 0.5, "b": 0.5}


def plan(minutes: float, dry: bool, workers: int) -> dict[str, Any]:
    """The time budget: worker start, per-section load and drain bounds, and (c)'s bound;
    their sum is at most ``minutes``. Raises SystemExit when it does not fit."""
    start_s, cal_s, drain_s = (60.0, 10.0, 10.0) if dry else (120.0, 60.0, 30.0)
    times = TRUTH_TIMES["dry" if dry else "gpu"]
    fixed = start_s + cal_s + drain_s * len(LOAD_SHARE) + times["d_s"] + times["e_s"]
    budget = minutes * 60.0 - SLACK_S
    load_total = (2.0 * len(LOAD_SHARE)) if dry else budget - fixed
    if not dry and load_total < 20:
        raise SystemExit(f"--minutes {minutes} leaves {load_total:.0f}s of load: give more")
    return {
        "workers": workers,
        "start_s": start_s,
        "cal_s": cal_s,
        "drain_s": drain_s,
        "load_s": load_total / len(LOAD_SHARE),
        "d_s": times["d_s"],
        "e_s": times["e_s"],
        "bound_s": fixed + load_total,
    }


def load_time(p: dict[str, Any], left: list[str], seconds_left: float) -> float:
    """The next load section's seconds: its planned share, shortened when what ran before
    took longer than planned, so that the sections ``left`` (this one first) and their drains
    still end by the deadline (``seconds_left`` from now); at least 1 s."""
    loads = [s for s in left if s in LOAD_SHARE]
    fixed = sum(p[f"{s}_s"] for s in left if f"{s}_s" in p and s in ("d", "e"))
    room = seconds_left - fixed - p["drain_s"] * len(loads) - 0.5 * len(loads)
    share = LOAD_SHARE[loads[0]] / sum(LOAD_SHARE[s] for s in loads)
    return max(1.0, min(p["load_s"], room * share))


def run_section(name: str, ctx: dict[str, Any], left: list[str], deadline: float) -> dict:
    """Run section ``name`` (``left``: it and those after it) and return its row, with its
    seconds; an exception becomes the row's ``error``. A load section first gets its clients
    (OVERLOAD× what fits by (c)'s estimates, at most MAX_CLIENTS a worker) and its time."""
    t0 = time.monotonic()
    n = ctx["plan"]["workers"]
    try:
        if name in LOAD_SHARE:
            if "amounts" not in ctx:
                raise RuntimeError("needs (c)'s estimates, and (c) failed")
            ctx["clients"] = min(MAX_CLIENTS, math.ceil(OVERLOAD * _fit(ctx) / n))
            ctx["load_s"] = load_time(ctx["plan"], left, deadline - time.monotonic())
        row = SECTIONS[name](ctx)
        if name in LOAD_SHARE:
            row["clients_per_worker"] = ctx["clients"]
            row["overload"] = round(ctx["clients"] * n / _fit(ctx), 2)
    except Exception as e:  # noqa: BLE001 - the table says which section failed
        row = {"error": f"{type(e).__name__}: {e}"[:300]}
    row["seconds"] = round(time.monotonic() - t0, 2)
    return row


# ---- the table --------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"


def table(results: dict[str, Any], dry: bool) -> str:
    """The printed table, sections a to e (and any others) in name order."""
    lines = [
        ("DRY RUN (fake device, tiny model: not a measurement)" if dry else "GPU truth"),
        "section | metric | value | target",
        "--- | --- | --- | ---",
    ]
    for name in sorted(results):
        r = results[name]
        if "error" in r:
            lines.append(f"{name} | error | {r['error']} | ran")
            continue
        if name in ("a", "b"):
            label = "per-worker asyncio.Semaphore, 10x overload" if name == "a" else "gpulock"
            lines += [
                f"{name} {label} | CUDA OOMs | {r['oom']} | {'0' if name == 'b' else '-'}",
                f"{name} | poisoned contexts | {r['poisoned']} | 0",
                f"{name} | other errors | {r['errors']} | 0",
                f"{name} | lease waits given up at the end | {r['timeouts']} | -",
                f"{name} | requests ok (per s) | {r['ok']} ({r['req_per_s']:.1f}) | -",
                f"{name} | clients (overload: clients / what fits) | "
                f"{r['clients_per_worker']} per worker ({r['overload']:.1f}x) | 10x",
                f"{name} | peak device in use / total | {_pct(r['peak_used_frac'])} | "
                f"{'>= 85%' if name == 'b' else '-'}",
                f"{name} | time-weighted in use / total | {_pct(r['mean_used_frac'])} | -",
                f"{name} | p99 latency | {r['p99_s'] * 1000:.1f} ms | -",
            ]
        elif name == "c":
            for row in r["rows"]:
                lines.append(
                    f"c calibration {row['shape']} | measured {format_size(row['measured'])}; "
                    f"formula {_pct(row['formula_err'])}; calibrated "
                    f"{_pct(row['calibrated_err'])} | "
                    + ("0..+10%" if row["bucket_sized"] else ">= 0 (inside a bucket)")
                )
        elif name == "d":
            sz = format_size
            lines += [
                f"d reconciliation | grab outside gpulock (X) | {sz(r['grab'])} | -",
                f"d | effective capacity before / during / after | "
                f"{sz(r['effective_before'])} / {sz(r['effective_during'])} / "
                f"{sz(r['effective_after'])} | during <= capacity - X "
                f"({sz(r['granted_limit_during'])}); after = before",
                f"d | external before / during / after | {sz(r['external_before'])} / "
                f"{sz(r['external_during'])} / {sz(r['external_after'])} | -",
                f"d | grab to report | {r['grab_to_report_s']:.2f} s | -",
                f"d | peak granted during the grab | {sz(r['peak_granted_during'])} | "
                f"<= effective during",
                f"d | OOMs during the grab | {r['ooms_during']} | 0",
                f"d | grabber exit to full capacity | {r['free_to_back_s']:.2f} s | -",
            ]
        elif name == "e":
            sz = format_size
            lines += [
                f"e over-user | lease / device use | {sz(r['leased'])} / {sz(r['uses'])} | -",
                f"e | flagged pid (its pid) | {r['flagged_pid']} ({r['pid']}) | same",
                f"e | flagged lease | {r['flagged_lease_ids']} | {r['lease_id']}",
                f"e | excess | {sz(r['excess'])} | >= {sz(r['uses'] - r['leased'])}",
                f"e | time to flag (hold) | {r['time_to_flag_s']:.2f} s ({r['hold_s']:.1f} s) "
                f"| >= hold",
            ]
        else:  # a section added later: its scalar numbers as they are
            for k, v in r.items():
                if isinstance(v, (int, float, str)) and k not in ("seconds", "target_met"):
                    lines.append(f"{name} | {k} | {v} | -")
    for name in sorted(results):
        met = results[name].get("target_met")
        if met is not None:
            lines.append(f"{name} | targets met | {'yes' if met else 'NO'} |")
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=8.0)
    ap.add_argument("--workers", type=int, default=None, help="default 4 (dry run: 2)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_truth.json"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, fake device")
    ap.add_argument("--fake-capacity", default="3MiB", help="the dry run's device, bytes")
    ap.add_argument("--only", default="", help="comma-separated sections (default: all)")
    a = ap.parse_args(argv)
    dry = a.dry_run
    # the allocator setting the service runs with (before torch initialises CUDA; the worker
    # processes inherit it)
    from gpulock_service import alloc_conf

    alloc = alloc_conf.apply()
    if not dry:
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except ImportError:
            has_cuda = False
        if not has_cuda:
            print("gpu_truth: skipped: no CUDA device here (use --dry-run for the CPU check)")
            return 0
    workers_n = a.workers or (2 if dry else 4)
    if workers_n < 1:
        raise SystemExit(f"--workers {workers_n}: give at least 1")
    p = plan(a.minutes, dry, workers_n)
    print(
        f"gpu_truth plan: {workers_n} workers; start <= {p['start_s']:.0f}s, (c) planned "
        f"{p['cal_s']:.0f}s, (a) and (b) {p['load_s']:.0f}s of load + {p['drain_s']:.0f}s "
        f"drain each, (d) {p['d_s']:.0f}s, (e) {p['e_s']:.0f}s: <= {p['bound_s'] / 60:.1f} min",
        flush=True,
    )
    t_begin = time.monotonic()
    deadline = t_begin + p["bound_s"]
    kind = "fake" if dry else "cuda"
    spec: dict[str, Any] = {"kind": kind, "model": "dry" if dry else "gpu"}
    if dry:
        spec["capacity"] = parse_size(a.fake_capacity, name="--fake-capacity")
        spec["used"] = mp.get_context("spawn").Value("q", 0)
    device = make_device(spec)
    cfg = MODELS[spec["model"]]
    from gpulock.embedded import RedisProcess

    only = [s for s in a.only.split(",") if s] or RUN_ORDER
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        raise SystemExit(f"--only: unknown section(s) {bad}; known: {sorted(SECTIONS)}")
    ctx: dict[str, Any] = {
        "plan": p,
        "device": device,
        "cfg": cfg,
        "formula": estimator(cfg),
        "shapes": SHAPES[spec["model"]],
    }
    ctx["capacity"] = device.total - reserve_bytes(kind, device.total, workers_n)
    results: dict[str, Any] = {}
    with RedisProcess() as redis:
        ctx["redis"] = redis
        ctx["workers"] = Workers(workers_n, spec, p["start_s"])
        try:
            order = [s for s in RUN_ORDER if s in only or s == "c"]
            for i, name in enumerate(order):
                results[name] = run_section(name, ctx, order[i:], deadline)
                print(f"gpu_truth: section {name} done in {results[name]['seconds']}s", flush=True)
                if i + 1 < len(order) and (
                    results[name].get("poisoned") or "error" in results[name]
                ):
                    # a poisoned context (or a failed section) must not carry over: fresh workers
                    ctx["workers"].close()
                    ctx["workers"] = Workers(workers_n, spec, p["start_s"])
        finally:
            ctx["workers"].close()
    print(table(results, dry))
    out = {
        "dry_run": dry,
        "device": device.name,
        "total_bytes": device.total,
        "capacity": ctx["capacity"],
        "workers": workers_n,
        "pytorch_cuda_alloc_conf": alloc,
        "plan": p,
        "seconds": round(time.monotonic() - t_begin, 2),
        "sections": results,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2, default=str))
    print(f"gpu_truth: wrote {a.out} ({out['seconds']}s)")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
