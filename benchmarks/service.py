#!/usr/bin/env python
"""Service-level benchmark: the real embeddings service (``gpulock serve``: gunicorn, 4 uvicorn
workers) on CPU, under a mixed-size load, with three ways to keep the work inside one budget
(issue 6 item 3):

    (a) gpulock       every request leases its bytes from one pool shared by the 4 workers;
    (b) per-worker    no lease (GPULOCK_DISABLED=1); each worker admits work with its own
                      in-process semaphore weighted in bytes and sized to the whole budget —
                      the naive fix, since a worker cannot see the others;
    (c) global lock   every request leases the whole capacity: one request at a time across
                      all workers (a distributed mutex, capacity one).

    python benchmarks/service.py            # full run, about 1 minute
    python benchmarks/service.py --quick    # smoke run, about 25 s

The model is the service's ``sleep`` test model (``benchmarks/bench_service_model.py`` wraps
it): a request of ``b`` inputs needs ``b x 64 MiB`` and "runs" 40 ms; ``b`` is drawn from
1, 2, 4, 8 (64-512 MiB; the budget is 1 GiB). The same seeded sequence of sizes goes to each
variant. 16 clients, each on its own keep-alive connection (opened 10 ms apart, so the kernel
spreads them over the workers), send requests back to back for a fixed time.

Every model call records its work interval and bytes (the history the workers write). From it:
budget overruns (work starts that put the bytes in use above the capacity), the time spent
over it, the peak, and the budget utilization (time-weighted bytes in use / capacity). From the
clients: requests/s and latency p50/p99 of the 200s.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _util import machine_info, mono, percentile  # noqa: E402

import gpulock  # noqa: E402
from gpulock.embedded import RedisProcess, free_port  # noqa: E402

MiB = 2**20
CAPACITY = 1024 * MiB
UNIT = 64 * MiB
SIZES = (1, 2, 4, 8)
VARIANTS = {
    "gpulock": "(a) gpulock: one pool for all workers",
    "per-worker": "(b) in-process semaphore per worker",
    "global": "(c) global lock (capacity one)",
}
FULL = dict(
    concurrency=16,
    duration_s=10.0,
    warm_s=1.0,
    hold_s=0.04,
    ready_timeout_s=90.0,
    start_together=False,
)
QUICK = dict(
    concurrency=16,
    duration_s=1.0,
    warm_s=0.2,
    hold_s=0.04,
    ready_timeout_s=90.0,
    start_together=True,
    # the window stays open until this many requests completed in it: on a starved machine one
    # second may see none through the global lock (the smoke test wants every variant measured)
    min_requests=16,
)


_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"# [{time.monotonic() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


class Service:
    """``python -m gpulock serve`` in its own process group, killed whole at the end."""

    def __init__(self, variant: str, redis_url: str, tmp: Path, cfg: dict):
        self.variant = variant
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pool = f"bench-svc-{variant}"
        self.tmp = tmp
        self.hist = str(tmp / "work")
        self.lease_hist = str(tmp / "lease")
        env = dict(os.environ)
        env.update(
            {
                "PYTHONPATH": os.pathsep.join(
                    [str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
                ),
                "GPULOCK_RESIDENT": "0",  # the budget is for requests only
                # one lease per request, as the variants compare (batching: batching.py)
                "GPULOCK_BATCH": "false",
                "GPULOCK_EXECUTOR_THREADS": "8",
                "GPULOCK_ACQUIRE_TIMEOUT": "60",
                "GPULOCK_INFERENCE_TIMEOUT": "60",
                "GPULOCK_SLEEP_SECONDS": str(cfg["hold_s"]),
                "GPULOCK_SLEEP_BYTES": str(UNIT),
                "GPULOCK_HISTORY_FILE": self.lease_hist,
                "GPULOCK_DISABLED": "1" if variant == "per-worker" else "0",
                "BENCH_SVC_VARIANT": variant,
                "BENCH_SVC_CAPACITY": str(CAPACITY),
                "BENCH_SVC_HISTORY": self.hist,
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)  # serve makes a fresh one
        self.cmd = [
            sys.executable,
            "-m",
            "gpulock",
            "serve",
            "--workers",
            "4",
            "--redis-url",
            redis_url,
            "--capacity",
            str(CAPACITY),
            "--pool",
            self.pool,
            "--port",
            str(self.port),
            "--model",
            "bench_service_model:factory",
            "--log-level",
            "warning",
        ]
        self.env = env
        self.log_path = tmp / "serve.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Service":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, workers: int, timeout: float) -> float:
        """Until ``workers`` workers report ready (gpulock_workers_ready, summed over workers)."""
        import httpx

        t0 = time.monotonic()
        last = None
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"service {self.variant} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                r = httpx.get(self.url + "/metrics", timeout=5)
                for line in r.text.splitlines():
                    if line.startswith("gpulock_workers_ready"):
                        last = float(line.split()[-1])
                if last is not None and last >= workers:
                    return time.monotonic() - t0
            except (httpx.HTTPError, OSError, ValueError):
                pass
            time.sleep(0.25)
        raise TimeoutError(
            f"service {self.variant}: {last} of {workers} workers ready after {timeout:.0f}s:\n"
            f"{self.log_tail()}"
        )

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()


def size_sequence(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(SIZES) for _ in range(n)]


async def drive(url: str, cfg: dict, seed: int = 6) -> dict[str, Any]:
    """``concurrency`` clients, each on one keep-alive connection, back to back for warm +
    duration seconds, and past that until ``min_requests`` (default 0) completed with a 200 in
    the window (warm, stop). Returns every request: (t_send, t_done, status, size, worker pid),
    and the window."""
    import httpx

    C = cfg["concurrency"]
    seqs = [size_sequence(seed * 1000 + i, 100_000) for i in range(C)]
    clients = [
        httpx.AsyncClient(
            base_url=url,
            timeout=120,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        )
        for _ in range(C)
    ]
    conn_pid: list[str] = []
    for cl in clients:  # open the connections 10 ms apart so they land on different workers
        r = await cl.get("/health")
        conn_pid.append(r.headers.get("x-worker-pid", ""))
        await asyncio.sleep(0.01)
    recs: list[tuple] = []
    t_start = mono()
    t_open = t_start + cfg["warm_s"]
    t_stop = [t_open + cfg["duration_s"]]  # moved on while fewer than min_requests completed
    needed = cfg.get("min_requests", 0)
    state = {"closed": False, "extended": False}
    hold = cfg["hold_s"]

    def open_() -> bool:
        if state["closed"]:
            return False
        now = mono()
        if now < t_stop[0]:
            return True
        if needed and sum(1 for r in recs if r[2] == 200 and t_open <= r[1]) < needed:
            state["extended"] = True
            return True
        if state["extended"]:
            t_stop[0] = now  # the window ends once its requests completed
        state["closed"] = True
        return False

    async def client(i: int) -> None:
        cl = clients[i]
        k = 0
        while open_():
            b = seqs[i][k]
            k += 1
            body = {"input": [f"sleep:{hold}"] + ["x"] * (b - 1)}
            t0 = mono()
            try:
                r = await cl.post("/v1/embeddings", json=body)
                st, pid = r.status_code, r.headers.get("x-worker-pid", "")
            except Exception as e:  # noqa: BLE001 - counted as status 0
                st, pid = 0, type(e).__name__
            recs.append((t0, mono(), st, b, pid))

    await asyncio.gather(*(client(i) for i in range(C)))
    for cl in clients:
        await cl.aclose()
    return {
        "t_start": t_start,
        "t_window": (t_open, t_stop[0]),
        "recs": recs,
        "connection_worker_pids": conn_pid,
    }


def read_history(prefix: str) -> list[dict]:
    out = []
    for path in glob.glob(prefix + ".*.jsonl"):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        pass
    return out


def sweep(
    intervals: list[tuple[float, float, int]], t0: float, t1: float, capacity: int
) -> dict[str, Any]:
    """Bytes in use over [t0, t1] from (start, end, bytes) intervals: overruns (starts that put
    the total above ``capacity``), seconds over it, peak, time-weighted utilization."""
    ev = []
    for s, e, b in intervals:
        if e <= t0 or s >= t1:
            continue
        ev.append((max(s, t0), 1, b))
        ev.append((min(e, t1), 0, b))  # ends sort before starts at the same instant
    ev.sort()
    used = peak = 0
    last = t0
    area = area_capped = over_s = 0.0
    overruns = starts = 0
    for t, kind, b in ev:
        dt = t - last
        area += used * dt
        area_capped += min(used, capacity) * dt
        if used > capacity:
            over_s += dt
        last = t
        if kind == 1:
            used += b
            starts += 1
            if used > capacity:
                overruns += 1
            peak = max(peak, used)
        else:
            used -= b
    span = t1 - t0
    return {
        "work_starts": starts,
        "overruns": overruns,
        "seconds_over_capacity": over_s,
        "share_of_time_over_capacity": over_s / span if span else math.nan,
        "peak_bytes": peak,
        "peak_of_capacity": peak / capacity,
        "utilization": area / (capacity * span) if span else math.nan,
        "utilization_within_budget": area_capped / (capacity * span) if span else math.nan,
    }


def lease_peak(events: list[dict], routes=("embeddings",)) -> dict[str, Any]:
    """Cross-check from the service's own GPULOCK_HISTORY_FILE (variants a and c): the peak of
    leased bytes alive at once, from grant and release records (wall clock)."""
    grants, rels = {}, {}
    for e in events:
        if e.get("route") not in routes:
            continue
        if e["e"] == "grant":
            grants[e["lease_id"]] = e
        elif e["e"] == "release":
            rels[e["lease_id"]] = e
    iv = [(g["t"], rels[lid]["t"], int(g["amount"])) for lid, g in grants.items() if lid in rels]
    if not iv:
        return {"leases": 0}
    s = sweep(iv, min(x[0] for x in iv), max(x[1] for x in iv), CAPACITY)
    return {"leases": len(iv), "peak_bytes": s["peak_bytes"], "overruns": s["overruns"]}


def run_variant(
    variant: str, redis_url: str, cfg: dict, svc: "Service | None" = None
) -> dict[str, Any]:
    """Start the service (unless ``svc`` was started already), load it, stop it, and analyse
    what its workers recorded."""
    if svc is None:
        tmp = Path(tempfile.mkdtemp(prefix=f"gpulock-bench-svc-{variant}-"))
        svc = Service(variant, redis_url, tmp, cfg).start()
    try:
        ready_s = svc.wait_ready(4, cfg["ready_timeout_s"])
        d = asyncio.run(drive(svc.url, cfg))
    finally:
        svc.stop()
    out = analyse_variant(variant, svc, d)
    shutil.rmtree(svc.tmp, ignore_errors=True)
    out["ready_s"] = ready_s
    return out


def analyse_variant(variant: str, svc: "Service", d: dict) -> dict[str, Any]:
    t0, t1 = d["t_window"]
    work = [(h["s"], h["e"], int(h["b"])) for h in read_history(svc.hist)]
    budget = sweep(work, t0, t1, CAPACITY)
    done = [r for r in d["recs"] if t0 <= r[1] <= t1]
    ok = [r for r in done if r[2] == 200]
    lat = [(r[1] - r[0]) * 1000 for r in ok if r[0] >= t0]
    by_pid: dict[str, int] = {}
    for r in ok:
        by_pid[r[4]] = by_pid.get(r[4], 0) + 1
    statuses: dict[str, int] = {}
    for r in done:
        statuses[str(r[2])] = statuses.get(str(r[2]), 0) + 1

    def lat_of(size: int) -> list[float]:
        return [(r[1] - r[0]) * 1000 for r in ok if r[3] == size and r[0] >= t0]

    out = {
        "variant": variant,
        "label": VARIANTS[variant],
        "window_s": t1 - t0,
        "requests_per_s": len(ok) / (t1 - t0),
        "bytes_per_s": sum(r[3] * UNIT for r in ok) / (t1 - t0),
        "latency_ms": {
            "p50": percentile(lat, 50),
            "p99": percentile(lat, 99),
            "max": max(lat, default=math.nan),
        },
        "latency_by_size_ms": {
            str(s): {"p50": percentile(lat_of(s), 50), "p99": percentile(lat_of(s), 99)}
            for s in SIZES
        },
        "statuses": statuses,
        "requests_by_worker": by_pid,
        "connection_worker_pids": d["connection_worker_pids"],
        "budget": budget,
        "history_records": len(work),
    }
    if variant != "per-worker":
        out["lease_history"] = lease_peak(read_history(svc.lease_hist))
    # A timeline of bytes in use (10 ms steps) for the plot.
    step = 0.01
    ts = [t0 + i * step for i in range(int((t1 - t0) / step))]
    out["timeline"] = {
        "t": [round(t - t0, 3) for t in ts],
        "used_mib": [sum(b for s, e, b in work if s <= t < e) // MiB for t in ts],
    }
    return out


def build_table(R: dict) -> str:
    rows = []
    for v in VARIANTS:
        d = R["variants"].get(v)
        if not d:
            rows.append([VARIANTS[v], "error (see JSON)"] + [""] * 6)
            continue
        b = d["budget"]
        rows.append(
            [
                d["label"],
                f"{b['overruns']:,}" + (f" of {b['work_starts']:,}" if b["overruns"] else ""),
                f"{b['share_of_time_over_capacity']:.0%}",
                f"{b['peak_of_capacity']:.0%}",
                f"{d['requests_per_s']:.1f}",
                f"{d['latency_ms']['p50']:.0f} / {d['latency_ms']['p99']:.0f}",
                f"{b['utilization']:.0%}"
                + (
                    f" ({b['utilization_within_budget']:.0%} within)"
                    if b["utilization"] > b["utilization_within_budget"] + 0.005
                    else ""
                ),
                ", ".join(f"{k}:{n}" for k, n in sorted(d["statuses"].items())),
            ]
        )
    return _table(
        [
            "service, 4 workers, mixed sizes",
            "budget overruns",
            "time over",
            "peak of budget",
            "requests/s",
            "latency p50 / p99 (ms)",
            "utilization",
            "statuses",
        ],
        rows,
    )


def _table(head, rows) -> str:
    from peers import table

    return table(head, rows)


def run(
    cfg: dict, quick: bool, json_path: str, server: str | None = None, redis_url: str | None = None
) -> dict:
    t_all = time.monotonic()
    R: dict[str, Any] = {
        "quick": quick,
        "config": cfg,
        "machine": machine_info(),
        "gpulock": gpulock.__version__,
        "capacity": CAPACITY,
        "unit": UNIT,
        "sizes": SIZES,
        "variants": {},
        "errors": {},
    }
    from importlib import metadata

    R["versions"] = {
        d: _ver(metadata, d) for d in ("fastapi", "uvicorn", "gunicorn", "uvicorn-worker", "httpx")
    }
    rp = None
    if redis_url is None:
        from peers import pick_server

        rp = RedisProcess(pick_server(server)).start()
        redis_url = rp.url
    started: dict[str, Service] = {}
    try:
        if cfg["start_together"]:
            # Smoke runs: start the three services at once (their start-up is most of the time)
            # and load them one after the other; the idle ones only poll Redis once a second.
            for v in VARIANTS:
                tmp = Path(tempfile.mkdtemp(prefix=f"gpulock-bench-svc-{v}-"))
                started[v] = Service(v, redis_url, tmp, cfg).start()
        for v in VARIANTS:
            log(f"service: {VARIANTS[v]}")
            try:
                R["variants"][v] = run_variant(v, redis_url, cfg, started.pop(v, None))
            except Exception:
                R["errors"][v] = traceback.format_exc()
                log(f"FAILED: service {v}\n{R['errors'][v]}")
    finally:
        for svc in started.values():
            svc.stop()
            shutil.rmtree(svc.tmp, ignore_errors=True)
        if rp is not None:
            rp.close()
    R["machine"]["loadavg_end"] = list(os.getloadavg())
    R["runtime_s"] = time.monotonic() - t_all
    R["json_path"] = json_path
    R["table"] = build_table(R)
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    from core import _clean

    Path(json_path).write_text(
        json.dumps(_clean(R), separators=(",", ":"), default=str, allow_nan=False) + "\n"
    )
    return R


def _ver(metadata, d: str):
    try:
        return metadata.version(d)
    except metadata.PackageNotFoundError:
        return None


def print_report(R: dict) -> None:
    M = R["machine"]
    c = R["config"]
    kind = "quick" if R["quick"] else "full"
    print(f"gpulock {R['gpulock']} service benchmark  ({kind} run, {R['runtime_s']:.0f} s)")
    print(
        f"machine: {M['cpu']}, {M['cores']} cores; load avg {M['loadavg_start'][0]:.2f} at start, "
        f"{M['loadavg_end'][0]:.2f} at end; "
        + ", ".join(f"{k} {v}" for k, v in R["versions"].items())
    )
    print(
        f"load: {c['concurrency']} clients back to back for {c['duration_s']:.0f} s, requests of "
        f"{'/'.join(str(s * UNIT // MiB) for s in SIZES)} MiB (uniform), {c['hold_s'] * 1000:.0f} ms of work each; "
        f"budget {CAPACITY // MiB} MiB; 4 gunicorn/uvicorn workers"
    )
    print()
    print(R["table"])
    print()
    print(f"raw numbers: {R['json_path']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=str(HERE / "results" / "service.json"))
    ap.add_argument("--redis-server", default=None)
    a = ap.parse_args(argv)
    R = run(QUICK if a.quick else FULL, a.quick, a.json, a.redis_server)
    print_report(R)
    if R["errors"]:
        print(f"FAILED parts: {', '.join(R['errors'])}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
