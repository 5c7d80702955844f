"""Smoke test of the core benchmark: ``benchmarks/core.py --quick`` runs end to end against a
server it starts itself, prints its table and writes its JSON.

No speed assertions here: the targets live in the benchmark (and its table says PASS/MISS);
a test that failed on a slow or busy CI machine would only teach people to ignore it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "core.py"


def test_core_benchmark_quick(tmp_path):
    out = tmp_path / "core.json"
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"

    # The table: a header line and one row per measured quantity.
    head = next(line for line in p.stdout.splitlines() if line.startswith("metric"))
    assert all(col in head for col in ("value", "target", "verdict"))
    for row in (
        "ceiling: EVALSHA 'return 1', 1 conn, redis-py sync",
        "ceiling: EVALSHA 'return 1', 1 conn, redis-py asyncio",
        "uncontended acquire+release, sync Pool",
        "uncontended acquire+release, AsyncPool",
        "hand-off 10 waiters, async",
        "hand-off 100 waiters, async",
        "client commands per grant, 10 / 100 / 1000 waiters",
        "crash reclaim lag after server expiry",
        "Redis memory per lease",
        "Redis memory per waiter",
    ):
        assert row in p.stdout, f"missing table row {row!r}:\n{p.stdout}"
    assert str(out) in p.stdout

    # The JSON: standard JSON (no NaN), every part present, each with numbers in it.
    R = json.loads(out.read_text(), parse_constant=_refuse)
    assert R["quick"] is True
    assert R["server"]["version"] and R["machine"]["python"]
    assert len(R["table"]) >= 10
    for kind in ("pairs_sync", "pairs_async"):
        assert (
            R[kind]["ceiling"] > 0 and R[kind]["pool"]["rate"] > 0 and R[kind]["pool"]["ratio"] > 0
        )
    assert set(R["handoff_async"]) == {"10", "100", "1000"}
    for h in list(R["handoff_async"].values()) + list(R["handoff_sync"].values()):
        assert not h["errors"], h["errors"]
        assert h["samples"] > 0 and h["p50_ms"] is not None and h["full_p50_ms"] > 0
        assert h["cmds_per_grant"] > 0
        assert len(h["samples_ms"]["from_release_call"]) == h["samples"]
    assert R["reclaim"]["n"] >= 1 and R["reclaim"]["p50_ms"] is not None
    for t in R["reclaim"]["trials"]:
        assert t.get("token_next", 0) > t.get(
            "token_dead", -1
        )  # the waiter got the dead lease's bytes
    assert R["memory"]["items"] == 10_000
    assert R["memory"]["lease"]["used_memory"] > 0 and R["memory"]["waiter"]["used_memory"] > 0


def _refuse(constant: str):
    raise ValueError(f"non-standard JSON constant {constant} in the benchmark's JSON")
