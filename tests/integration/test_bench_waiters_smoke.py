"""Smoke test of ``benchmarks/waiters.py --quick`` (10 and 100 waiters): it runs end to end
against servers it starts itself, prints its table and writes its JSON. No speed assertions;
the connection bound and the absence of pool errors are correctness, so they are checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_waiters_benchmark_quick(tmp_path):
    out = tmp_path / "waiters.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "waiters.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    head = next(line for line in p.stdout.splitlines() if line.startswith("shell"))
    for col in ("connections opened", "enqueue all (s)", "commands/s waiting"):
        assert col in head
    R = json.loads(out.read_text())
    assert [(r["shell"], r["waiters"]) for r in R["runs"]] == [
        ("AsyncPool", 10),
        ("AsyncPool", 100),
        ("Pool (sync)", 10),
        ("Pool (sync)", 100),
    ]
    for r in R["runs"]:
        assert r["granted"] == r["waiters"] and r["left_in_queue"] == 0, r
        assert r["pool_errors"] == 0, r
        assert r["opened"] <= 16 + (4 if r["shell"] == "Pool (sync)" else 0), r
        assert r["enqueue_s"] > 0 and r["waiting"]["per_s"] >= 0
