"""Smoke test of ``benchmarks/preemption.py --rounds 2``: it runs end to end against a server it
starts itself and prints its floor line and its table (the three cases, their columns). No
speed assertions (the numbers live in docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_preemption_benchmark_two_rounds(tmp_path: Path) -> None:
    out = tmp_path / "preemption.json"
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "preemption.py"),
            "--rounds",
            "2",
            "--floor-rounds",
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
    assert any(line.startswith("floor: uncontended acquire round trip p50") for line in lines)
    i = next(i for i, line in enumerate(lines) if line.startswith("case"))
    for col in ("rounds", "p50 (ms)", "max (ms)", "bytes came back"):
        assert col in lines[i]
    rows = lines[i + 2 : i + 5]
    assert [r.split("  ")[0] for r in rows] == ["cooperative", "uncooperative", "gpulock run"]
    R = json.loads(out.read_text())
    assert [len(c["times_s"]) for c in R["cases"]] == [2, 2, 2]
    for c in R["cases"]:
        assert c["released"] + c["taken"] == 2, c  # every round's holder was asked once
    assert len(R["floor_s"]) == 5
