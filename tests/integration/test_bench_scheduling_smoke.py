"""Smoke test of ``benchmarks/scheduling.py --quick``: it runs end to end against a server it
starts itself, prints its tables and writes its JSON, every workload under both policies and
the placement rows (a 4-device pool best fit, spread and best fit with backfill, and 4 separate
pools asked at random), with no acquire failing, tenant a's peak use within its quota and each
device's peak use within its capacity, and the wait estimate's error reported for every run
(its fields present and finite). No speed or accuracy assertions (the numbers live in
docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def test_scheduling_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "scheduling.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scheduling.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    heads = [line for line in p.stdout.splitlines() if line.startswith("workload")]
    # the policy table, the placement table, then the wait estimate's error
    assert len(heads) == 3, p.stdout
    for head in heads[:2]:
        for col in ("utilization", "grants/s", "server CPU"):
            assert col in head
    assert "peak MiB per device" in heads[1]
    for col in ("estimated / queued", "|error| p50 / p90 (ms)", "relative p50 / p90", "signed"):
        assert col in heads[2]
    for label in ("bestfit, FIFO", "spread, FIFO", "random of 4 pools", "bestfit, backfill"):
        assert label in p.stdout
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
    assert R["estimate_table"].count("\n") == 1 + len(R["runs"]) + len(R["placement"])
    for r in R["runs"] + R["placement"]:
        _check_estimate_error(r)
    for r in R["runs"]:
        if r["workload"] == "tenants":
            assert set(r["wait_by_tenant_ms"]) == {"a", "b"}, r
            # from the clients' grant and release times, inside the server's: never above
            assert 0 < r["peak_by_tenant"]["a"] <= r["quotas"]["a"], r
    rows = R["placement"]
    assert [(r["workload"], r["row"]) for r in rows] == [
        ("mixed", x) for x in ("bestfit", "spread", "random", "bestfit+backfill")
    ]
    assert R["placement_table"].count("\n") == 1 + len(rows)  # header, rule, one line a row
    for r in rows:
        assert r["error_count"] == 0, r
        assert r["devices"] == 4 and len(r["peak_by_device"]) == 4, r
        assert 0 < r["utilization"] <= 1.0 + 1e-9, r  # of all 4 devices
        assert set(r["wait_by_size_ms"]) == {"64", "512"}, r
        # from the clients' grant and release times and lease.device, inside the server's:
        # no device ever held more than its capacity
        assert all(0 < p <= r["device_capacity"] for p in r["peak_by_device"]), r
        assert all(n > 0 for n in r["grants_by_device"]), r  # every device was used


def _check_estimate_error(r: dict[str, Any]) -> None:
    """A run's wait estimate error: counts that add up, and finite statistics (no threshold
    on their values: the accuracy is measured in docs/BENCHMARKS.md, not asserted)."""
    e = r["wait_estimate"]
    assert e["queued"] > 0, r  # 16 clients (64 for placement) on 1 GiB: requests queue
    assert e["estimated"] + e["unmeasured"] == e["queued"], e
    # the queue is busy from the warm-up on, so the drain rate is measured (after 200 ms of
    # busy time) well before the window's 1 s ends: some queued requests had an estimate
    assert e["estimated"] > 0, e
    stats = [
        e["abs_ms"]["p50"],
        e["abs_ms"]["p90"],
        e["rel"]["p50"],
        e["rel"]["p90"],
        e["signed_ms_p50"],
        e["over_share"],
        e["estimate_ms_p50"],
        e["actual_ms_p50"],
    ]
    assert all(isinstance(x, (int, float)) and math.isfinite(x) for x in stats), e
    assert 0 <= e["abs_ms"]["p50"] <= e["abs_ms"]["p90"], e
    assert 0 <= e["rel"]["p50"] <= e["rel"]["p90"], e
    assert set(r["wait_estimate_by_size"]) == set(r["wait_by_size_ms"]), r
