#!/usr/bin/env python
"""Kept bytes (``keep=``) side by side with keeping off and with the peers: one private Redis,
one run.

    python benchmarks/keep.py            # full run, about 25 s
    python benchmarks/keep.py --quick    # smoke run (CI), about 5 s
    python benchmarks/keep.py --only uncontended,waiter --keep 30 --iterations 600

Parts:

* ``uncontended``: peers.py's uncontended part (:func:`peers.bench_uncontended`: each subject in
  slices interleaved with its own client's single-connection ``EVALSHA`` of ``return 1``, median
  ratio to the neighbouring ceiling slices), with gpulock's ``AsyncPool`` and ``Pool`` each
  twice, keeping off and keeping on (``keep=``), next to redis-py's ``Lock``,
  python-redis-lock and redis-semaphore (Node; skipped, and said so, where it cannot run);
  with the Redis server's CPU per pair (``INFO cpu`` around every slice, core.CpuSlices).
* ``waiter``: the first waiter's extra delay. A holder process (its own pool object and
  client; ``AsyncPool`` or sync ``Pool``) acquires the whole pool and releases it: with keeping
  on the bytes stay kept, idle, in that process, so a waiter does not fit; with keeping off
  they are free. A second pool object (keeping off, in this process) then acquires the whole
  pool (``timeout`` set), timed from the call to its return. With keeping on that is: its
  acquire queues and tells the holder (a ``k`` message), the holder releases its kept lease,
  which grants the waiter; with keeping off it is granted at once. Extra delay = on - off
  (p50, p99), cases interleaved in a random order each iteration. A kept lease *in use* is
  not measured: the waiter waits for that use with keeping on or off alike.

Prints two tables and writes the raw numbers (every slice and latency) to
``benchmarks/results/keep.json`` (git ignores it). Results: docs/BENCHMARKS.md section 16.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import core  # noqa: E402
import peers  # noqa: E402
from _util import machine_info, percentile  # noqa: E402

from gpulock import AsyncPool  # noqa: E402
from gpulock.embedded import RedisProcess  # noqa: E402
from gpulock.protocol.keys import pool_keys  # noqa: E402

KEEP_S = 30.0  # the keep setting measured (seconds an idle kept lease may be kept)
CAPACITY = 1000  # bytes of each waiter pool; the holder keeps all of them
EXTRA_P99_TARGET_MS = 1.0  # the first waiter's extra delay, p99, loopback
FULL = {**peers.FULL, "iterations": 600, "warm": 20}
QUICK = {**peers.QUICK, "iterations": 20, "warm": 3}
CASES = [(shell, mode) for shell in ("async", "sync") for mode in ("off", "on")]
SHELL = {"async": "AsyncPool", "sync": "Pool (sync)"}

log = peers.log


# ---- the first waiter's delay ---------------------------------------------------------------------


def lat_summary(ms: list[float]) -> dict[str, Any]:
    """n, p50, p99, max and mean of latencies in ms (None where there are none)."""
    if not ms:
        return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None, "mean_ms": None}
    return {
        "n": len(ms),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms),
        "mean_ms": sum(ms) / len(ms),
    }


async def bench_first_waiter(url: str, c: redis.Redis, cfg: dict, keep_s: float) -> dict[str, Any]:
    """The first waiter's delay behind kept bytes, keeping on and off, for an AsyncPool and a
    sync Pool holder (see the module's docstring). Returns per case the latencies (ms, from
    the waiter's ``acquire`` call to its return), how many waits queued, and the summaries;
    ``extra`` per holder shell: on - off of p50 and p99."""
    names = {case: f"keep-wait-{case[0]}-{case[1]}" for case in CASES}
    waiters: dict[tuple[str, str], AsyncPool] = {}
    holders: dict[tuple[str, str], peers.Proc] = {}
    out: dict[str, Any] = {"capacity": CAPACITY, "keep_s": keep_s, "cases": {}}
    try:
        for case, name in names.items():
            waiters[case] = AsyncPool.from_url(url, name)
            await waiters[case].configure(CAPACITY)
            args = {
                "url": url,
                "pool": name,
                "shell": case[0],
                "keep": keep_s if case[1] == "on" else 0,
                "amount": CAPACITY,
            }
            holders[case] = peers.Proc("kept-holder", args)
        for w in holders.values():
            w.recv()
        lat: dict[tuple[str, str], list[float]] = {case: [] for case in CASES}
        queued = dict.fromkeys(CASES, 0)
        not_kept = dict.fromkeys(CASES, 0)
        errors: list[str] = []
        rng = random.Random(35)
        for i in range(cfg["warm"] + cfg["iterations"]):
            order = list(CASES)
            rng.shuffle(order)
            for case in order:
                holders[case].send("hold")
                r = holders[case].recv(timeout=30)
                if "error" in r:
                    errors.append(f"holder {case}: {r['error']}")
                    continue
                # The server's list of kept leases: the holder's lease with keeping on, none off.
                kept = c.hget(pool_keys(names[case]).cfg, "kept")
                if bool(kept) != (case[1] == "on"):
                    not_kept[case] += 1
                    if case[1] == "on":  # not the case measured: let it expire unseen
                        errors.append(f"{case}: the holder's lease was not kept")
                q: list[int] = []
                t0 = time.perf_counter()
                try:
                    lease = await waiters[case].acquire(CAPACITY, timeout=5, on_queued=q.append)
                except Exception as e:
                    errors.append(f"waiter {case}: {e!r}")
                    continue
                dt = (time.perf_counter() - t0) * 1000
                await lease.release()
                if i >= cfg["warm"]:
                    lat[case].append(dt)
                    queued[case] += bool(q)
        for case in CASES:
            out["cases"][f"{case[0]}-{case[1]}"] = {
                "shell": case[0],
                "keep": case[1],
                "latencies_ms": [round(x, 4) for x in lat[case]],
                "queued": queued[case],
                "kept_mismatch": not_kept[case],
                **lat_summary(lat[case]),
            }
        out["extra"] = {}
        for shell in ("async", "sync"):
            on, off = out["cases"][f"{shell}-on"], out["cases"][f"{shell}-off"]
            if on["n"] and off["n"]:
                out["extra"][shell] = {
                    "p50_ms": on["p50_ms"] - off["p50_ms"],
                    "p99_ms": on["p99_ms"] - off["p99_ms"],
                }
        out["errors"] = errors[:20]
        out["error_count"] = len(errors)
    finally:
        for w in holders.values():
            w.kill()
        for p in waiters.values():
            await p.aclose()
        for name in names.values():
            c.delete(*pool_keys(name)[:7])
    return out


# ---- the tables -----------------------------------------------------------------------------------


def _verdict(ok: bool, ratio: float) -> str:
    return "PASS" if ok else f"MISS ({ratio:.2f}x)"


def build_tables(R: dict) -> dict[str, str]:
    T: dict[str, str] = {}
    U = R.get("uncontended")
    if U:
        rows = peers.ceiling_rows(U, 6, cpu=True)
        for r in R["uncontended_rows"]:
            s = r["subject"]
            if s == "asyncio-sem":
                continue
            tgt = verdict = ""
            if s in peers.KEPT_LABELS:
                goal = peers.KEPT_TARGET
                tgt = f">= {goal:.0%}"
                verdict = _verdict(r["ratio"] >= goal, r["ratio"] / goal)
            lab = peers.label(s) + (f" (keep={R['keep_s']:g})" if s in peers.KEPT_LABELS else "")
            if s in ("gpulock-async", "gpulock-sync"):
                lab += ", keep off"
            rows.append(
                [
                    lab,
                    f"{r['rate']:,.0f}/s",
                    f"{r['ratio']:.1%} of {r['client']}",
                    peers._f(r.get("server_cpu_us"), "{:.2f}", "n/a"),
                    tgt,
                    verdict,
                ]
            )
        T["uncontended"] = peers.table(
            [
                "uncontended acquire+release",
                "rate",
                "of own client's ceiling",
                "Redis CPU us/pair",
                "target",
                "verdict",
            ],
            rows,
        )
    W = R.get("waiter")
    if W:
        rows = []
        for shell in ("async", "sync"):
            for mode, what in (
                ("off", "keep off: the bytes are free"),
                ("on", "keep on: the holder keeps them idle"),
            ):
                d = W["cases"][f"{shell}-{mode}"]
                rows.append(
                    [
                        f"{SHELL[shell]} holder, {what}",
                        str(d["n"]),
                        str(d["queued"]),
                        peers._f(d["p50_ms"]),
                        peers._f(d["p99_ms"]),
                        peers._f(d["max_ms"]),
                        "",
                        "",
                    ]
                )
            x = W["extra"].get(shell)
            if x:
                ok = x["p99_ms"] < EXTRA_P99_TARGET_MS
                rows.append(
                    [
                        f"{SHELL[shell]} holder, extra delay (on - off)",
                        "",
                        "",
                        peers._f(x["p50_ms"]),
                        peers._f(x["p99_ms"]),
                        "",
                        f"p99 < {EXTRA_P99_TARGET_MS:g} ms",
                        _verdict(ok, x["p99_ms"] / EXTRA_P99_TARGET_MS),
                    ]
                )
        T["waiter"] = peers.table(
            [
                f"first waiter for {W['capacity']} B, acquire call -> grant (ms)",
                "n",
                "queued",
                "p50",
                "p99",
                "max",
                "target",
                "verdict",
            ],
            rows,
        )
    return T


def print_report(R: dict) -> None:
    M, V = R["machine"], R["versions"]
    print(
        f"gpulock {V['gpulock']} kept bytes, keep={R['keep_s']:g} s  "
        f"({'quick' if R['quick'] else 'full'} run, {R['runtime_s']:.0f} s)"
    )
    print(
        f"machine: {M['cpu']}, {M['cores']} cores; load avg {M['loadavg_start'][0]:.2f} at start, "
        f"{M['loadavg_end'][0]:.2f} at end"
    )
    print(
        f"server {R['server']['version']} ({R['server']['binary']}), loopback TCP; python "
        f"{M['python']}, redis-py {V['redis']} ({M['redis_py_parser']}), python-redis-lock "
        f"{V['python-redis-lock']}, node {V['node']}, redis-semaphore {V['redis-semaphore']}"
    )
    if R.get("node_skipped"):
        print(f"redis-semaphore rows skipped: {R['node_skipped']}")
    for k in ("uncontended", "waiter"):
        if k in R["tables"]:
            print()
            print(R["tables"][k])
    print()
    print(f"raw numbers: {R['json_path']}")


# ---- the run --------------------------------------------------------------------------------------


def run(rp: RedisProcess, cfg: dict, only: set[str], quick: bool, keep_s: float, json_path: str):
    """The parts in ``only`` against ``rp``; the result dict (also written to ``json_path``)."""
    t0 = time.monotonic()
    use_node, why = peers.node_status()
    R: dict[str, Any] = {
        "quick": quick,
        "keep_s": keep_s,
        "config": cfg,
        "machine": machine_info(),
        "versions": peers.versions(),
        "errors": {},
        "node_skipped": None if use_node else why,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    c = redis.Redis.from_url(rp.url, **core.CLIENT_KW)
    R["server"] = {"version": c.info("server").get("redis_version"), "binary": rp.binary}
    if not use_node:
        log(f"redis-semaphore rows skipped: {why}")
    try:
        if "uncontended" in only:
            log(f"uncontended acquire+release, keep off and keep={keep_s:g}, and the peers")
            try:
                R["uncontended"] = peers.bench_uncontended(rp, c, cfg, use_node, keep_s=keep_s)
                R["uncontended_rows"] = peers.uncontended_rows(R["uncontended"])
            except Exception:
                R["errors"]["uncontended"] = traceback.format_exc()
                log(f"FAILED: uncontended\n{R['errors']['uncontended']}")
        if "waiter" in only:
            log(f"first waiter behind kept bytes, {cfg['iterations']} iterations of each case")
            try:
                R["waiter"] = asyncio.run(bench_first_waiter(rp.url, c, cfg, keep_s))
                if R["waiter"]["error_count"]:
                    R["errors"]["waiter"] = R["waiter"]["errors"]
            except Exception:
                R["errors"]["waiter"] = traceback.format_exc()
                log(f"FAILED: waiter\n{R['errors']['waiter']}")
    finally:
        c.close()
    R["machine"]["loadavg_end"] = list(os.getloadavg())
    R["runtime_s"] = time.monotonic() - t0
    R["json_path"] = json_path
    R["tables"] = build_tables(R)
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(
        json.dumps(core._clean(R), separators=(",", ":"), default=str, allow_nan=False) + "\n"
    )
    return R


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short smoke run")
    ap.add_argument("--json", default=str(HERE / "results" / "keep.json"))
    ap.add_argument("--redis-server", default=None)
    ap.add_argument("--only", default="", help="comma list: uncontended,waiter")
    ap.add_argument("--keep", type=float, default=KEEP_S, help="the keep setting, seconds")
    ap.add_argument("--iterations", type=int, default=None, help="first-waiter trials per case")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (uncontended)")
    a = ap.parse_args(argv)
    cfg = dict(QUICK if a.quick else FULL)
    if a.iterations is not None:
        cfg["iterations"] = a.iterations
    if a.rounds is not None:
        cfg["rounds"] = a.rounds
    only = set(filter(None, a.only.split(","))) or {"uncontended", "waiter"}
    binary = peers.pick_server(a.redis_server)
    with RedisProcess(binary) as rp:
        rp.binary = binary
        R = run(rp, cfg, only, a.quick, a.keep, a.json)
    print_report(R)
    if R["errors"]:
        print(f"FAILED parts (details on stderr and in the JSON): {', '.join(R['errors'])}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
