"""Smoke test of ``benchmarks/keep.py --quick``: kept bytes on and off side by side with the
peers (uncontended pairs, Redis CPU per pair) and the first waiter's delay behind kept bytes,
end to end in a subprocess against a server it starts itself. No speed assertions: targets live
in the benchmark's own verdict table. What is correctness is checked: with keeping on every
measured waiter queued behind the holder's kept lease and the server listed that lease as
kept; with keeping off none queued."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

if importlib.util.find_spec("redis_lock") is None:
    pytest.skip(
        "the peers need python-redis-lock (pip install -e '.[bench]')", allow_module_level=True
    )


def test_keep_benchmark_quick(tmp_path):
    out = tmp_path / "keep.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "keep.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    for row in (
        "gpulock AsyncPool, keep off",
        "gpulock AsyncPool, keep on (keep=30)",
        "gpulock Pool (sync), keep off",
        "gpulock Pool (sync), keep on (keep=30)",
        "redis-py Lock",
        "python-redis-lock Lock",
        "AsyncPool holder, extra delay (on - off)",
        "Pool (sync) holder, extra delay (on - off)",
    ):
        assert row in p.stdout, f"missing row {row!r}:\n{p.stdout[-4000:]}"
    R = json.loads(out.read_text())
    assert R["quick"] is True and not R["errors"], R["errors"]
    rows = {r["subject"]: r for r in R["uncontended_rows"]}
    for s in ("gpulock-async", "gpulock-async-keep", "gpulock-sync", "gpulock-sync-keep"):
        assert rows[s]["rate"] > 0 and rows[s]["server_cpu_us"] is not None, rows[s]
    for s in ("redislock", "redispy"):
        assert rows[s]["rate"] > 0
    W = R["waiter"]
    for shell in ("async", "sync"):
        on, off = W["cases"][f"{shell}-on"], W["cases"][f"{shell}-off"]
        assert on["n"] == off["n"] == R["config"]["iterations"]
        assert on["queued"] == on["n"] and on["kept_mismatch"] == 0, on
        assert off["queued"] == 0 and off["kept_mismatch"] == 0, off
        assert set(W["extra"][shell]) == {"p50_ms", "p99_ms"}
