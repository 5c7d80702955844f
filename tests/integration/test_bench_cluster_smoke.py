"""Smoke test of ``benchmarks/cluster.py`` (short windows, 2 client processes): it starts its
own standalone server and 3-master cluster, runs every layout, prints its table and writes its
JSON. No speed assertions: the pairs it counts must have happened (the pools' own grant
counters are not read here; every layout must have made some)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_benchmark_quick(tmp_path):
    out = tmp_path / "cluster.json"
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "cluster.py"),
            "--quick",
            "--seconds",
            "1",
            "--procs",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    assert "CPU µs/pair" in p.stdout
    R = json.loads(out.read_text())
    assert list(R["layouts"]) == [
        "standalone",
        "cluster, 1 master(s)",
        "cluster, 2 master(s)",
        "cluster, 3 master(s)",
        "standalone (again)",
    ]
    for name, v in R["layouts"].items():
        assert v["pairs"] > 0 and v["cpu_us_per_pair"] > 0, (name, v)
        assert len(v["server_cpu_s"]) == (int(name.split(", ")[1][0]) if "cluster" in name else 1)
