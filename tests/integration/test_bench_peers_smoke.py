"""Smoke test of the side-by-side benchmarks: ``benchmarks/run.py --quick`` (peers, service, and
the core benchmark's fastest part) runs end to end in a subprocess, against servers it starts
itself, and produces its tables, its JSON files and its PNG plots.

No speed assertions: targets live in the benchmark's own verdict table. The redis-semaphore
rows need Node and ``npm ci`` in benchmarks/node; without them those rows are skipped (the
harness says why) and so is the test that checks them.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run.py"
NODE_DIR = ROOT / "benchmarks" / "node"

for mod, why in (
    ("matplotlib", "matplotlib (pip install -e '.[bench]')"),
    ("redis_lock", "python-redis-lock (pip install -e '.[bench]')"),
):
    if importlib.util.find_spec(mod) is None:
        pytest.skip(f"the benchmarks need {why}", allow_module_level=True)

HAVE_SERVICE = all(
    importlib.util.find_spec(m) for m in ("fastapi", "gunicorn", "uvicorn_worker", "httpx")
)


def node_missing() -> str | None:
    if not shutil.which("node"):
        return "node is not on PATH"
    for pkg in ("redis-semaphore", "ioredis"):
        if not (NODE_DIR / "node_modules" / pkg).is_dir():
            return f"{pkg} is not installed: run `npm ci` in benchmarks/node"
    return None


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    parts = "core,peers,service" if HAVE_SERVICE else "core,peers"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--quick",
        "--only",
        parts,
        "--core-parts",
        "memory",
        "--out",
        str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-4000:]}\nstderr:\n{p.stderr[-4000:]}"
    return out, p.stdout


def _load(path: Path) -> dict:
    def refuse(c):
        raise ValueError(f"non-standard JSON constant {c} in {path}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_tables(run):
    _, stdout = run
    heads = [
        "uncontended acquire+release",
        "hand-off, release returns -> next holder",
        "client commands",
        "crash reclaim",
        "fairness, mixed sizes",
        "gpulock's targets and the peers",
    ]
    if HAVE_SERVICE:
        heads.append("service, 4 workers, mixed sizes")
    for head in heads:
        assert head in stdout, f"missing table {head!r}:\n{stdout[-6000:]}"
    for row in (
        "gpulock AsyncPool",
        "gpulock Pool (sync)",
        "python-redis-lock Lock",
        "redis-py Lock",
        "asyncio.Semaphore (one process only)",
        "ceiling: EVALSHA 'return 1', 1 conn, redis-py sync",
        "Redis memory per lease",
    ):
        assert row in stdout, f"missing row {row!r}"
    if HAVE_SERVICE:
        for row in ("(a) gpulock", "(b) in-process semaphore per worker", "(c) global lock"):
            assert row in stdout


def test_json(run):
    out, _ = run
    P = _load(out / "peers.json")
    assert P["quick"] is True and not P["errors"], P["errors"]
    assert P["server"]["version"] and P["machine"]["loadavg_start"]
    rows = {r["subject"]: r for r in P["uncontended_rows"]}
    for s in ("gpulock-async", "gpulock-sync", "redislock", "redispy", "asyncio-sem"):
        assert rows[s]["rate"] > 0
    for s in ("gpulock-async", "gpulock-sync", "redislock", "redispy", "asyncio-sem"):
        h = P["chains"][s]["10"]  # --quick runs the 10-waiter chains only
        assert not h["errors"], h["errors"]
        assert h["samples"] > 0 and h["p50_ms"] is not None and h["grants_per_s"] > 0
    for s in ("gpulock-async", "gpulock-sync", "redislock", "redispy"):
        h = P["chains"][s]["10"]
        assert h["cmds_per_grant"] > 0 and h["stall"]["client_cmds_per_s"] >= 0
    assert P["reclaim"]["short"]["gpulock-async"]["n"] >= 1
    for s in ("redislock", "redispy"):
        assert P["reclaim"]["short"][s]["n"] >= 1, P["reclaim"]["short"][s]
    f = P["fairness"]["gpulock-async"]
    assert f["grants"] > 0 and 0 < f["jain_mean_wait"] <= 1.0
    C = _load(out / "core.json")
    assert C["memory"]["lease"]["used_memory"] > 0
    if HAVE_SERVICE:
        S = _load(out / "service.json")
        assert not S["errors"], S["errors"]
        for v in ("gpulock", "per-worker", "global"):
            d = S["variants"][v]
            assert d["requests_per_s"] > 0 and d["history_records"] > 0
            assert d["budget"]["utilization"] > 0
        # What the workers recorded must hold the budget where a lease admits the work.
        assert S["variants"]["gpulock"]["budget"]["overruns"] == 0
        assert S["variants"]["global"]["budget"]["overruns"] == 0
    summary = _load(out / "summary.json")
    assert summary["verdicts"] and not summary["failed"]


def test_plots(run):
    out, _ = run
    names = ["uncontended.png", "handoff.png", "commands.png", "reclaim.png", "fairness.png"]
    if HAVE_SERVICE:
        names.append("service.png")
    for name in names:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_node_peers(run):
    why = node_missing()
    if why:
        pytest.skip(f"redis-semaphore rows not run: {why}")
    out, stdout = run
    P = _load(out / "peers.json")
    assert P["node_skipped"] is None
    for s in ("rs-sem", "rs-multi"):
        assert s in {r["subject"] for r in P["uncontended_rows"]}
        h = P["chains"][s]["10"]
        assert not h["errors"], h["errors"]
        assert h["samples"] > 0 and h["cmds_per_grant"] > 0 and h["stall"]["per_waiter_second"] > 0
        assert P["reclaim"]["short"][s]["n"] >= 1, P["reclaim"]["short"][s]
    assert P["fairness"]["rs-multi"]["grants"] > 0
    assert "redis-semaphore MultiSemaphore" in stdout
