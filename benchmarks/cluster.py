#!/usr/bin/env python
"""gpulock on Redis Cluster: aggregate acquire+release pairs/s over 1, 2 and 3 masters, and the
server CPU each pair costs, next to a single Redis in the same run.

    python benchmarks/cluster.py             # ~2 minutes: 1, 2, 3 masters, 8 s windows
    python benchmarks/cluster.py --quick     # smoke run: ~40 s, 3 s windows
    python benchmarks/cluster.py --procs 6 --seconds 10 --json /tmp/c.json

It starts its own servers on free loopback ports: one standalone ``redis-server`` and a
cluster of 3 masters (no replicas: this measures the masters' work). For each layout —
standalone, and the cluster with pools on 1, 2 and 3 of its masters — ``--procs`` client
processes each loop ``pool.acquire(1).release()`` (sync ``Pool``, uncontended, pool far from
full) on pools spread round-robin over the chosen masters, for ``--seconds``. Measured:

* **pairs/s**: the pairs all processes completed in the window, divided by its length;
* **server CPU per pair**: ``used_cpu_user + used_cpu_sys`` (``INFO cpu``) of each server over
  the window, summed over the servers that hold the pools, divided by the pairs (µs); the
  busiest server's CPU share (% of one core) says whether the servers or the clients were the
  limit;
* **scale model**: grants/s one master can serve = 1 s / (CPU per pair); the GPUs one master
  serves at R requests/s per GPU (one pool per GPU, one grant per request).

Numbers, the machine and the command go to ``--json`` (default
benchmarks/results/cluster.json) and a table to stdout. On a 2-core machine the client
processes share the cores with the servers: the pairs/s are the machine's, the CPU per pair is
the servers' own cost, comparable across layouts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine_info  # noqa: E402

from gpulock import Pool  # noqa: E402
from gpulock.transport.local_cluster import start_cluster  # noqa: E402
from gpulock.embedded import RedisProcess, find_server_binary  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _worker(url: str, pools: list[str], start_at: float, end_at: float, q: Any) -> None:
    objs = [Pool.from_url(url, n) for n in pools]
    for p in objs:
        p.acquire(1).release()  # connect and load the scripts before the window
    while time.time() < start_at:
        time.sleep(0.001)
    n, i = 0, 0
    while time.time() < end_at:
        objs[i].acquire(1).release()
        i = (i + 1) % len(objs)
        n += 1
    q.put(n)
    for p in objs:
        p.close()


def _cpu(c: redis.Redis) -> float:
    info = c.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def measure(url: str, pools: list[str], servers: list[redis.Redis], procs: int, seconds: float):
    for name in pools:
        with Pool.from_url(url, name) as p:
            p.configure(10**12)
    q: Any = mp.Queue()
    start_at = time.time() + 3.0  # every process connected and warmed up by then
    end_at = start_at + seconds
    ps = [
        mp.Process(
            target=_worker,
            args=(url, pools[i % len(pools) :] + pools[: i % len(pools)], start_at, end_at, q),
        )
        for i in range(procs)
    ]
    for p in ps:
        p.start()
    while time.time() < start_at:
        time.sleep(0.001)
    cpu0 = [_cpu(s) for s in servers]
    while time.time() < end_at:
        time.sleep(0.01)
    cpu1 = [_cpu(s) for s in servers]
    pairs = sum(q.get(timeout=60) for _ in ps)
    for p in ps:
        p.join(30)
    cpu = [b - a for a, b in zip(cpu0, cpu1)]
    return {
        "pairs": pairs,
        "pairs_per_s": pairs / seconds,
        "server_cpu_s": cpu,
        "cpu_us_per_pair": sum(cpu) / pairs * 1e6 if pairs else None,
        "busiest_server_cpu_pct": max(cpu) / seconds * 100,
    }


def pools_on(c: Any, masters: int, per_master: int = 2) -> list[str]:
    """Pool names: ``per_master`` on each of the first ``masters`` masters."""
    return [n for names in c.names_by_master("b", per_master)[:masters] for n in names]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 s windows (smoke run)")
    ap.add_argument("--seconds", type=float, default=None, help="window length (default 8)")
    ap.add_argument("--procs", type=int, default=4, help="client processes (default 4)")
    ap.add_argument("--json", default=str(RESULTS / "cluster.json"))
    ap.add_argument("--redis-server", default=None)
    a = ap.parse_args(argv)
    seconds = a.seconds or (3.0 if a.quick else 8.0)
    binary = a.redis_server or find_server_binary()
    R: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/cluster.py", *(argv or sys.argv[1:])]),
        "machine": machine_info(),
        "procs": a.procs,
        "seconds": seconds,
        "load_start": os.getloadavg(),
        "layouts": {},
    }
    lone = RedisProcess(binary).start()
    c = start_cluster(binary, masters=3, replicas=0)
    try:
        sc = redis.Redis(host=lone.host, port=lone.port)
        R["layouts"]["standalone"] = measure(lone.url, ["s0", "s1"], [sc], a.procs, seconds)
        for m in (1, 2, 3):
            servers = [c.client(x) for x in c.masters[:m]]
            R["layouts"][f"cluster, {m} master(s)"] = measure(
                c.url, pools_on(c, m), servers, a.procs, seconds
            )
        R["layouts"]["standalone (again)"] = measure(lone.url, ["s2", "s3"], [sc], a.procs, seconds)
    finally:
        c.stop()
        lone.stop()
    R["load_end"] = os.getloadavg()
    print(
        f"\ngpulock on Redis Cluster — {a.procs} client processes, {seconds:.0f} s windows, "
        f"load {R['load_start'][0]:.2f} → {R['load_end'][0]:.2f}"
    )
    print(
        f"{'layout':<24} {'pairs/s':>9} {'CPU µs/pair':>12} {'busiest server':>15} {'grants/s per master (model)':>28}"
    )
    for k, v in R["layouts"].items():
        per = v["cpu_us_per_pair"]
        model = 1e6 / per if per else float("nan")
        v["model_grants_per_s_per_master"] = model
        print(
            f"{k:<24} {v['pairs_per_s']:>9.0f} {per:>12.1f} {v['busiest_server_cpu_pct']:>14.0f}% {model:>28.0f}"
        )
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(R))
    return 0


if __name__ == "__main__":
    sys.exit(main())
