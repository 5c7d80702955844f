"""Smoke test of ``benchmarks/scheduling.py --quick``: it runs end to end against a server it
starts itself, prints its table and writes its JSON, every workload under both policies, with
no acquire failing and tenant a's peak use within its quota. No speed assertions (the numbers live in docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scheduling_benchmark_quick(tmp_path):
    out = tmp_path / "scheduling.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scheduling.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    head = next(line for line in p.stdout.splitlines() if line.startswith("workload"))
    for col in ("utilization", "grants/s", "server CPU"):
        assert col in head
    R = json.loads(out.read_text())
    assert [(r["workload"], r["policy"]) for r in R["runs"]] == [
        (w, p) for w in ("uniform", "mixed", "priority", "tenants") for p in ("fifo", "backfill")
    ]
    for r in R["runs"]:
        assert r["error_count"] == 0, r
        assert 0 < r["utilization"] <= 1.0 + 1e-9, r  # bytes leased never exceed the pool
        assert r["wait_ms"]["n"] > 0, r
    prio = [r for r in R["runs"] if r["workload"] == "priority"]
    assert all(set(r["wait_by_priority_ms"]) == {"0", "5"} for r in prio), prio
    for r in R["runs"]:
        if r["workload"] == "tenants":
            assert set(r["wait_by_tenant_ms"]) == {"a", "b"}, r
            # from the clients' grant and release times, inside the server's: never above
            assert 0 < r["peak_by_tenant"]["a"] <= r["quotas"]["a"], r
