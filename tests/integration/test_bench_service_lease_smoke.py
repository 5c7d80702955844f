"""Smoke test of ``benchmarks/service_lease.py --quick``: it runs end to end against a server it
starts itself, prints its table (three cases, three modes) and its target line, and writes its
JSON. No speed assertions (the numbers live in docs/SERVICE.md); what it counts is checked: with
keep on, the one-size cases' requests are granted from kept bytes (after the warm-up, fewer
leases from Redis than clients) and the two-sizes case's never are, and with keep off every
request is one acquire in Redis."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_service_lease_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "service_lease.json"
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "service_lease.py"),
            "--quick",
            "--requests",
            "40",
            "--slices",
            "4",
            "--warmup",
            "5",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    lines = p.stdout.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("case"))
    for col in ("acquire p50/p99 (ms)", "lease p50/p99 (ms)", "Redis acquires/request"):
        assert col in lines[i]
    rows = lines[i + 2 : i + 11]
    assert sum(" off " in r for r in rows) == 3 and sum(" keep " in r for r in rows) == 3
    assert any(line.startswith("target: lease (acquire + release) p50") for line in lines)
    R = json.loads(out.read_text())
    assert [c["case"] for c in R["cases"]] == [
        "1 client, one size",
        "4 clients, one size",
        "1 client, two sizes",
    ]
    for c in R["cases"]:
        off, keep = c["modes"]["off"], c["modes"]["keep"]
        for r in (off, keep, c["modes"]["disabled"]):
            assert r["requests"] == 40 and len(r["latency_s"]) == 40
        assert len(off["lease_s"]) == len(keep["lease_s"]) == 40
        assert off["redis_grants"] == 40 and off["kept_grants"] == 0
        assert keep["redis_grants"] + keep["kept_grants"] == 40, keep
        if c["sizes"] == [2**20]:
            # one size: the warm-up leased what the clients need at once (each release is put
            # back before a later request's acquire runs: its task was scheduled first)
            assert keep["redis_grants"] <= c["clients"] - 1, keep
        else:  # each release done before the next request of the other size: none fits
            assert keep["redis_grants"] == 40 and keep["kept_grants"] == 0, keep
