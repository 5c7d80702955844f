"""The CPU dry run of ``benchmarks/gpu_truth.py`` (fake device, tiny model): every section
runs, the table has its rows and the JSON its numbers; without CUDA and without
``--dry-run`` it skips with exit 0. No speed assertions; the numbers asserted are
correctness: under gpulock the fake device never runs out (every lease is at least the
request's true bytes and the pool's capacity is under the device's); in (d) the pool grants
exactly the grab less while the fake device shows it and comes back after; in (e) the
over-user is flagged with its pid, lease and excess."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_truth.py"
pytestmark = pytest.mark.timeout(120)


def test_gpu_truth_dry_run(tmp_path):
    out = tmp_path / "gpu_truth.json"
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    lines = p.stdout.splitlines()
    head = lines.index("DRY RUN (fake device, tiny model: not a measurement)")
    assert lines[head + 1] == "section | metric | value | target"
    rows = [line.split(" | ") for line in lines[head + 3 :] if " | " in line]
    names = [r[0].split()[0] for r in rows]
    assert names.index("a") < names.index("b") < names.index("c") < names.index("d")
    assert names.index("d") < names.index("e")  # printed a, b, c, d, e
    for sec in ("a", "b"):
        metrics = {r[1] for r in rows if r[0].split()[0] == sec}
        assert {
            "CUDA OOMs",
            "poisoned contexts",
            "peak device in use / total",
            "time-weighted in use / total",
            "p99 latency",
        } <= metrics
    R = json.loads(out.read_text())
    assert R["dry_run"] is True and R["device"] == "fake"
    assert set(R["sections"]) == {"a", "b", "c", "d", "e"}
    a, b, c = (R["sections"][k] for k in "abc")
    for s in (a, b, c):
        assert "error" not in s, s
    # each load section ran: requests answered, memory sampled
    for s in (a, b):
        assert s["ok"] > 0 and s["samples"] > 0 and 0 < s["peak_used_frac"] <= 1
        assert s["poisoned"] == 0 and s["errors"] == 0
    assert a["permits_per_worker"] >= 1
    assert b["oom"] == 0, b  # leases ≥ true bytes, capacity < device: no OOM can happen
    # calibration: one row per shape of the mix, the calibrated estimate never under
    shapes = [r["shape"] for r in c["rows"]]
    assert shapes == ["2x8", "2x12", "2x16", "2x32", "4x32"]
    for r in c["rows"]:
        assert r["calibrated"] >= r["measured"] > 0 and r["formula"] > 0
    assert c["target_met"] is True
    # (d): the fake device shows exactly the grab, so the pool grants exactly that less while
    # it lasts, no client runs out, and the pool is back to what it was once the grab is gone
    d, e = R["sections"]["d"], R["sections"]["e"]
    for s in (d, e):
        assert "error" not in s, s
    assert d["external_during"] == d["external_before"] + d["grab"]
    assert d["effective_during"] == d["effective_before"] - d["grab"]
    assert d["effective_during"] <= d["capacity"] - d["grab"]
    assert 0 < d["peak_granted_during"] <= d["effective_during"]
    assert d["ooms_during"] == 0
    assert (d["effective_after"], d["external_after"]) == (
        d["effective_before"],
        d["external_before"],
    )
    assert d["target_met"] is True
    # (e): the over-user is flagged with its own pid and lease, its excess exactly what the
    # fake device lists beyond the lease, after the rule's hold
    assert e["flagged_pid"] == e["pid"] and e["flagged_lease_ids"] == e["lease_id"]
    assert e["flagged_leased"] == e["leased"] and e["flagged_actual"] == e["uses"]
    assert e["excess"] == e["uses"] - e["leased"]
    assert e["time_to_flag_s"] >= e["hold_s"]
    assert e["target_met"] is True


def test_gpu_truth_plan_fits_its_minutes():
    """The time budget by construction: the plan's bound is within --minutes, and a load
    section after a slow one is shortened so that what is left (their drains, (d) and (e)'s
    fixed budgets) still ends by the deadline."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("gpu_truth_plan", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for minutes in (6, 8, 20):
        p = mod.plan(minutes, False, 4)
        assert p["bound_s"] <= minutes * 60 and p["load_s"] > 0
        assert mod.load_time(p, ["a", "b"], p["bound_s"]) == p["load_s"]  # on schedule
        # (d) and (e) keep their fixed budgets after the loads
        # (the 0.5 s before each load starts is in SLACK_S, not in the bound)
        rest = p["bound_s"] - p["start_s"] - p["cal_s"] + 1.0
        assert mod.load_time(p, ["a", "b", "d", "e"], rest) == p["load_s"]
        # (c) took longer than planned (50 s, or one load's share when the plan has less):
        # both loads shrink, their drains and (d), (e) still fit
        late = min(50.0, p["load_s"])
        left = p["bound_s"] - p["start_s"] - p["cal_s"] - late
        a = mod.load_time(p, ["a", "b", "d", "e"], left)
        fixed = 2 * p["drain_s"] + p["d_s"] + p["e_s"] + 1
        assert a < p["load_s"] and 2 * a + fixed <= left + 1e-9
    with pytest.raises(SystemExit, match="--minutes"):
        mod.plan(4, False, 4)


def test_gpu_truth_without_cuda_skips():
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the real run is not a test")
    p = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert p.returncode == 0 and "skipped" in p.stdout, p.stdout + p.stderr
