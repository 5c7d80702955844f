#!/usr/bin/env python
"""How long ``gpulock status --json`` (without a name) takes on a Redis Cluster with shards down.

    python benchmarks/cluster_listing.py            # ~1 minute, 5 runs per case
    python benchmarks/cluster_listing.py --runs 3 --binary /path/to/valkey-server

It starts a cluster of 5 masters without replicas (so a shard stays down) on free loopback
ports, one pool per master, and times the whole command (a new process: Python's start, the
client's start, the listing, the statuses) with the URL naming every master:

* **whole**: every master answers;
* **dead + hung**: masters 1 and 3 down, one killed (``kill -9``), one stopped (SIGSTOP);
* **hung slot 0**: master 0 stopped, the master that serves slot 0.

Each case runs on a fresh cluster. Prints the median and the maximum of ``--runs`` runs, the
exit status, and the unreachable shards the JSON names.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from gpulock import Pool
from gpulock.transport.local_cluster import start_cluster


def run_case(binary: str, dead: list[int], hung: list[int], runs: int) -> dict:
    c = start_cluster(binary, masters=5, replicas=0)
    try:
        for names in c.names_by_master("gpu-"):
            with Pool.from_url(c.url, names[0]) as p:
                p.configure(100)
        for i in dead:
            c.masters[i].kill()
        for i in hung:
            c.masters[i].pause()
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
        took, codes, shards = [], set(), []
        for _ in range(runs):
            t0 = time.monotonic()
            r = subprocess.run(
                [sys.executable, "-m", "gpulock", "--redis-url", c.url, "status", "--json"],
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
            )
            took.append(time.monotonic() - t0)
            codes.add(r.returncode)
            out = json.loads(r.stdout) if r.stdout else None
            shards = out.get("unreachable", []) if isinstance(out, dict) else []
        return {
            "median_s": round(statistics.median(took), 2),
            "max_s": round(max(took), 2),
            "exit": sorted(codes),
            "unreachable": [(u["node"], u["slots"], u["error"]) for u in shards],
        }
    finally:
        for i in hung:
            c.masters[i].resume()
        c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--binary", default=shutil.which("redis-server") or "redis-server")
    a = ap.parse_args()
    cases = {"whole": ([], []), "dead + hung": ([1], [3]), "hung slot 0": ([], [0])}
    for name, (dead, hung) in cases.items():
        r = run_case(a.binary, dead, hung, a.runs)
        print(
            f"{name:12}  median {r['median_s']:5.2f} s  max {r['max_s']:5.2f} s  exit {r['exit']}"
        )
        for node, slots, error in r["unreachable"]:
            print(f"{'':14}unreachable {node} slots {slots}: {error}")


if __name__ == "__main__":
    main()
