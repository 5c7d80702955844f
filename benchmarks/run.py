#!/usr/bin/env python
"""Every gpulock benchmark in one command: the core benchmark, gpulock side by side with its
peers, and the service under load; tables on stdout, PNG plots and JSON under the output folder.

    python benchmarks/run.py                  # full run, about 5 minutes
    python benchmarks/run.py --quick          # smoke run, about 1 minute (writes to results/quick/)
    python benchmarks/run.py --only peers,service --out /tmp/bench
    python benchmarks/run.py --wait-load 1.5  # first wait (up to --wait-max s) for a quiet machine

Parts (``--only``): ``core`` (benchmarks/core.py: its own private Redis, as it always runs),
``peers`` (benchmarks/peers.py) and ``service`` (benchmarks/service.py), the last two against one
private Redis this script starts. Files written to ``--out`` (default ``benchmarks/results``):
``core.json``, ``peers.json``, ``service.json``, ``summary.json`` (the tables, the targets
verdicts, machine, versions, load averages) and ``uncontended.png``, ``handoff.png``,
``commands.png``, ``reclaim.png``, ``fairness.png``, ``service.png``. docs/BENCHMARKS.md says how
to read them.

Exit status: 0 when every part ran (missed targets are reported, not failed), 2 when a part
failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import core  # noqa: E402
import peers  # noqa: E402
import plots  # noqa: E402
from _util import machine_info  # noqa: E402

import service  # noqa: E402
from gpulock.embedded import RedisProcess  # noqa: E402

PEER_RIVALS = ("rs-sem", "rs-multi", "redislock", "redispy")  # correct across processes


def wait_for_quiet(limit: float, max_wait: float) -> float:
    """Wait until the 1-minute load average is below ``limit`` (or ``max_wait`` passed)."""
    t0 = time.monotonic()
    while True:
        la = os.getloadavg()[0]
        if la < limit or time.monotonic() - t0 >= max_wait:
            return la
        print(f"# load average {la:.2f} >= {limit}: waiting", file=sys.stderr, flush=True)
        time.sleep(15)


def _g(d: Any, *path: str) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _ok(x: Any) -> bool:
    return isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x))


def verdicts(P: dict | None, S: dict | None) -> list[list[str]]:
    """gpulock's targets and issue 6's comparisons, on this run's numbers."""
    rows: list[list[str]] = []
    if P:
        for r in P.get("uncontended_rows") or []:
            if r["subject"].startswith("gpulock"):
                rows.append(
                    [
                        f"uncontended, {peers.label(r['subject'])}",
                        ">= 45% of ceiling",
                        f"{r['ratio']:.1%} of the {r['client']} ceiling",
                        "PASS" if r["ratio"] >= 0.45 else f"MISS by {0.45 - r['ratio']:.1%} points",
                    ]
                )
        H = P.get("chains") or {}
        for s in ("gpulock-async", "gpulock-sync"):
            h10, h100 = _g(H, s, "10"), _g(H, s, "100")
            if h10:
                ok = h10["p50_ms"] <= 0.1 and h10["p99_ms"] <= 0.5
                rows.append(
                    [
                        f"hand-off 10 waiters, {peers.label(s)}",
                        "p50 <= 0.1, p99 <= 0.5 ms",
                        f"p50 {h10['p50_ms']:.3f}, p99 {h10['p99_ms']:.3f} ms",
                        "PASS" if ok else "MISS",
                    ]
                )
            if h100:
                rows.append(
                    [
                        f"hand-off 100 waiters, {peers.label(s)}",
                        "p99 <= 1 ms",
                        f"p99 {h100['p99_ms']:.3f} ms",
                        "PASS" if h100["p99_ms"] <= 1.0 else "MISS",
                    ]
                )
        g = H.get("gpulock-async") or {}
        cpg = {
            int(n): h["cmds_per_grant"]
            for n, h in g.items()
            if int(n) >= 10 and _ok(h.get("cmds_per_grant"))
        }
        if cpg:
            base = cpg[min(cpg)]
            spread = max(abs(v / base - 1) for v in cpg.values())
            ok = max(cpg.values()) <= 4 and spread <= 0.2
            rows.append(
                [
                    "client commands per grant, AsyncPool",
                    "<= 4, flat +-20% from 10 to 1,000",
                    " / ".join(f"{cpg[n]:.2f}" for n in sorted(cpg))
                    + f" at {'/'.join(map(str, sorted(cpg)))} "
                    f"waiters (spread {spread:.0%})",
                    "PASS" if ok else "MISS",
                ]
            )
        sv = _g(P, "reclaim", "short", "gpulock-async", "core")
        if sv:
            ok = sv["p50_ms"] <= 5 and sv["max_ms"] <= 20
            rows.append(
                [
                    "crash reclaim lag (server clock)",
                    "p50 <= 5, max <= 20 ms",
                    f"p50 {sv['p50_ms']:.1f}, max {sv['max_ms']:.0f} ms",
                    "PASS" if ok else "MISS",
                ]
            )
        # gpulock ahead of every peer that is correct across processes
        for metric, key, ns in (
            ("hand-off p50", "p50_ms", ("1", "10", "100")),
            ("hand-off p99", "p99_ms", ("1", "10", "100")),
            ("commands per grant", "cmds_per_grant", ("10", "100", "1000")),
        ):
            behind = []
            for n in ns:
                mine = _g(H, "gpulock-async", n, key)
                if not _ok(mine):
                    continue
                for p in PEER_RIVALS:
                    theirs = _g(H, p, n, key)
                    if _ok(theirs) and theirs < mine:
                        behind.append(f"{peers.label(p)} at {n} ({theirs:.3g} vs {mine:.3g})")
            if any(_ok(_g(H, "gpulock-async", n, key)) for n in ns):
                rows.append(
                    [
                        f"ahead of every peer: {metric}",
                        "gpulock AsyncPool <= each peer",
                        "behind: " + ("; ".join(behind) if behind else "none"),
                        "PASS" if not behind else "MISS",
                    ]
                )
        lag = _g(P, "reclaim", "short")
        if lag and _ok(_g(lag, "gpulock-async", "lag_p50_ms")):
            mine = lag["gpulock-async"]["lag_p50_ms"]
            behind = [
                f"{peers.label(p)} ({lag[p]['lag_p50_ms']:.1f} vs {mine:.1f} ms)"
                for p in PEER_RIVALS
                if _ok(_g(lag, p, "lag_p50_ms")) and lag[p]["lag_p50_ms"] < mine
            ]
            rows.append(
                [
                    "ahead of every peer: reclaim lag after expiry (p50, waiter's clock)",
                    "gpulock <= each peer",
                    "behind: " + ("; ".join(behind) if behind else "none"),
                    "PASS" if not behind else "MISS",
                ]
            )
        d = _g(P, "reclaim", "default")
        if d:
            vals = {
                s: v["kill_to_regain_p50_ms"] / 1000
                for s, v in d.items()
                if isinstance(v, dict) and v.get("n")
            }
            if "gpulock-async" in vals:
                faster = [
                    f"{peers.label(s)} ({v:.1f} s)"
                    for s, v in vals.items()
                    if s != "gpulock-async" and v < vals["gpulock-async"]
                ]
                rows.append(
                    [
                        "regain with default settings",
                        "(no target)",
                        f"gpulock {vals['gpulock-async']:.1f} s; faster: "
                        + (", ".join(faster) or "none"),
                        "info",
                    ]
                )
    if S:
        V = S.get("variants") or {}
        for k, must_zero in (("gpulock", True), ("per-worker", False), ("global", True)):
            if k in V:
                n = V[k]["budget"]["overruns"]
                want = "0" if must_zero else "> 0 (the naive fix overruns)"
                ok = (n == 0) if must_zero else (n > 0)
                rows.append(
                    [
                        f"service budget overruns, {V[k]['label']}",
                        want,
                        f"{n:,}",
                        "PASS" if ok else "MISS",
                    ]
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: shorter and fewer repeats")
    ap.add_argument(
        "--only", default="core,peers,service", help="comma list of parts: core,peers,service"
    )
    ap.add_argument(
        "--out",
        default=None,
        help="output folder (default benchmarks/results, --quick: results/quick)",
    )
    ap.add_argument(
        "--core-parts", default="", help="passed to core.py --only (default: all of its parts)"
    )
    ap.add_argument(
        "--redis-server",
        default=None,
        help="server binary (default: the newest redis-server found)",
    )
    ap.add_argument(
        "--wait-load",
        type=float,
        default=None,
        help="wait until the 1-min load average is below this",
    )
    ap.add_argument(
        "--wait-max", type=float, default=900.0, help="longest wait for --wait-load, seconds"
    )
    a = ap.parse_args(argv)
    only = set(filter(None, a.only.split(",")))
    out = Path(a.out) if a.out else HERE / "results" / ("quick" if a.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    if a.wait_load:
        wait_for_quiet(a.wait_load, a.wait_max)
    t0 = time.monotonic()
    binary = peers.pick_server(a.redis_server)
    M = machine_info()
    summary: dict[str, Any] = {
        "command": " ".join(["python benchmarks/run.py"] + sys.argv[1:]),
        "quick": a.quick,
        "machine": M,
        "versions": peers.versions(),
        "server_binary": binary,
        "parts": {},
        "failed": [],
    }
    print(
        f"gpulock benchmarks ({'quick' if a.quick else 'full'} run): parts {', '.join(sorted(only))}; "
        f"output {out}"
    )
    print(
        f"machine: {M['cpu']}, {M['cores']} cores, load average {', '.join(f'{x:.2f}' for x in M['loadavg_start'])}"
    )
    print()
    CR = PR = SR = None
    if "core" in only:
        print("=" * 30 + " core (benchmarks/core.py) " + "=" * 30, flush=True)
        args = ["--json", str(out / "core.json"), "--redis-server", binary] + (
            ["--quick"] if a.quick else []
        )
        if a.core_parts:
            args += ["--only", a.core_parts]
        rc = core.main(args)
        if rc not in (0, 1):
            summary["failed"].append("core")
        CR = json.loads((out / "core.json").read_text())
        summary["parts"]["core"] = {
            "json": str(out / "core.json"),
            "table": CR.get("table"),
            "loadavg": [CR["machine"]["loadavg_start"], CR["machine"].get("loadavg_end")],
        }
        print()
    if only & {"peers", "service"}:
        with RedisProcess(binary) as rp:
            if "peers" in only:
                print("=" * 30 + " peers (benchmarks/peers.py) " + "=" * 30, flush=True)
                cfg = peers.QUICK if a.quick else peers.FULL
                PR = peers.run(
                    rp,
                    cfg,
                    {"uncontended", "handoff", "reclaim", "fairness"},
                    a.quick,
                    str(out / "peers.json"),
                    binary,
                )
                peers.print_tables(PR, PR["tables"])
                if PR["errors"]:
                    summary["failed"].append("peers")
                summary["parts"]["peers"] = {
                    "json": str(out / "peers.json"),
                    "tables": PR["tables"],
                    "loadavg": [PR["machine"]["loadavg_start"], PR["machine"]["loadavg_end"]],
                }
                print()
            if "service" in only:
                print("=" * 30 + " service (benchmarks/service.py) " + "=" * 30, flush=True)
                SR = service.run(
                    service.QUICK if a.quick else service.FULL,
                    a.quick,
                    str(out / "service.json"),
                    redis_url=rp.url,
                )
                service.print_report(SR)
                if SR["errors"]:
                    summary["failed"].append("service")
                la = [SR["machine"]["loadavg_start"], SR["machine"]["loadavg_end"]]
                summary["parts"]["service"] = {
                    "json": str(out / "service.json"),
                    "table": SR["table"],
                    "loadavg": la,
                }
                print()
    pngs = plots.make(out, PR, SR)
    V = verdicts(PR, SR)
    if CR:
        for r in CR.get("table", []):
            if r["verdict"].startswith(("PASS", "MISS")):
                V.append([f"core: {r['metric']}", r["target"], r["value"], r["verdict"]])
    summary["verdicts"] = [dict(zip(("what", "target", "measured", "verdict"), r)) for r in V]
    summary["plots"] = pngs
    summary["runtime_s"] = time.monotonic() - t0
    summary["loadavg_end"] = list(os.getloadavg())
    print("=" * 30 + " gpulock's targets and the peers, this run " + "=" * 30)
    if V:
        print(peers.table(["what", "target", "measured", "verdict"], V))
    print()
    print(
        f"load average: {M['loadavg_start'][0]:.2f} at start, {summary['loadavg_end'][0]:.2f} at end; "
        f"{summary['runtime_s']:.0f} s in all"
    )
    print("plots: " + (", ".join(pngs) if pngs else "none"))
    (out / "summary.json").write_text(
        json.dumps(core._clean(summary), indent=1, default=str, allow_nan=False) + "\n"
    )
    print(f"summary: {out / 'summary.json'}")
    if summary["failed"]:
        print(f"FAILED parts: {', '.join(summary['failed'])}")
        return 2
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
