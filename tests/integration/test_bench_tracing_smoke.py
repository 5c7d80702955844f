"""Smoke test of ``benchmarks/tracing.py --quick``: it runs end to end against a server it starts
itself, every variant (OpenTelemetry absent, the API without a provider, an SDK provider with a
dropping batch exporter, an in-memory one) in a worker of its own, prints its table and writes
its JSON; each SDK worker exported two spans (an acquire's and a lease's) for every pair it
made, which says the variants measured what they are named for. No speed assertions (the
numbers live in docs/BENCHMARKS.md, section 14)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("opentelemetry.sdk")


def test_tracing_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "tracing.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "tracing.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    assert "Δ µs/pair" in p.stdout and "load avg" in p.stdout, p.stdout
    R = json.loads(out.read_text())
    assert R["quick"] is True
    variants = ("absent", "absent-again", "api", "sdk-drop", "sdk-memory")
    assert set(R["summary"]) == {f"{k}_{v}" for k in ("sync", "async") for v in variants}
    for row in R["summary"].values():
        assert row["rate"] > 0 and row["rate_min"] <= row["rate"] <= row["rate_max"], row
    for v in ("sdk-drop", "sdk-memory"):
        done = R["exported"][v]
        assert done["pairs"] > 0 and done["exported"] == 2 * done["pairs"], (v, done)
