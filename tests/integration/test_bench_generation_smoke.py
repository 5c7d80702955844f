"""Smoke test of ``benchmarks/generation.py --quick``: it runs end to end against a server it
starts itself, prints its parameters and its Markdown table and writes its JSON; gpulock's
modes never put more KV bytes in use than the budget, nor the pool's used bytes (sampled from
Redis) over its capacity; the elastic modes (admitted when room, and queued) resize and
reserve-max never does; a per-worker
semaphore never admits more than K streams a worker. No speed assertions (the numbers live in
docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def test_generation_benchmark_quick(tmp_path: Path) -> None:
    out = tmp_path / "generation.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "generation.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    assert "KiB of KV per token" in p.stdout
    head = next(line for line in p.stdout.splitlines() if line.startswith("| mode"))
    for col in ("streams at once", "tokens/s", "TTFT", "budget use", "overruns", "preempted"):
        assert col in head, head
    R = json.loads(out.read_text())
    assert R["kv_bytes_per_token"] == 2**19  # Llama-2-7B fp16: 0.5 MiB
    assert [r["mode"] for r in R["runs"]] == ["elastic", "elastic-queued", "reserve", "per-worker"]
    budget = R["config"]["budget"]
    for r in R["runs"]:
        assert r["error_count"] == 0, r
        assert r["finished"] > 0 and r["tokens_per_s"] > 0 and r["ttft_ms"]["n"] > 0, r
        if r["mode"] in ("elastic", "elastic-queued", "reserve"):  # one pool for all workers
            assert r["overruns"] == 0 and r["use_max"] <= 1.0, r
            assert r["redis_samples"] > 0, r
            assert 0 < r["redis_used_max"] <= budget, r
        else:
            assert r["preemptions"] == 0 and r["redis_samples"] == 0, r
            assert r["concurrent_max"] <= r["k_per_worker"] * R["config"]["workers"], r
    elastic, queued, reserve = R["runs"][0], R["runs"][1], R["runs"][2]
    assert elastic["resizes"] > 0, elastic  # long streams grew
    assert queued["resizes"] > 0, queued
    assert reserve["resizes"] == 0 and reserve["preemptions"] == 0, reserve  # never grows
