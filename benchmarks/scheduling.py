#!/usr/bin/env python
"""Scheduling benchmark: what the queue policies buy on mixed-size load (docs/SEMANTICS.md,
"Priorities" and "Backfill"), measured on the pool directly (no HTTP service in the way).

    python benchmarks/scheduling.py            # full run, about 1.5 minutes
    python benchmarks/scheduling.py --quick    # smoke run, about 15 s

16 clients (each its own AsyncPool object, so its own connection and hand-off channel, as 16
processes would have) acquire, hold for ``hold_s`` and release, back to back, on one pool of
1 GiB. Workloads:

* ``uniform``: 64, 128, 256 or 512 MiB, uniform (the mix of ``benchmarks/service.py``);
* ``mixed``: 90 % of requests 64 MiB, 10 % 8x larger (512 MiB);
* ``priority``: the uniform mix, a quarter of the requests at priority 5, the rest at 0;
* ``tenants``: the uniform mix, half the clients tenant ``a`` with a quota of 512 MiB (half the
  pool), the other half tenant ``b`` without one (docs/SEMANTICS.md, "Tenant quotas").

Each runs under FIFO and under backfill (2 s window). Reported per run: budget utilization
(time-weighted bytes leased / capacity, from the clients' grant and release times), grants/s,
p50/p99/max wait per size class (per priority class; per tenant, with tenant ``a``'s peak use
from the clients' grant and release times, which lie inside the server's), and the Redis
server's CPU per grant (``INFO cpu`` over the window / grants made in it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _util import machine_info, percentile  # noqa: E402

import gpulock  # noqa: E402
from gpulock import AsyncPool  # noqa: E402
from gpulock.embedded import RedisProcess  # noqa: E402

MiB = 2**20
CAPACITY = 1024 * MiB
FULL = dict(clients=16, duration_s=8.0, warm_s=1.0, hold_s=0.04, backfill_window_s=2.0)
QUICK = dict(clients=16, duration_s=1.0, warm_s=0.3, hold_s=0.04, backfill_window_s=2.0)


def draw_uniform(rng: random.Random) -> tuple[int, int]:
    return rng.choice((1, 2, 4, 8)) * 64 * MiB, 0


def draw_mixed(rng: random.Random) -> tuple[int, int]:
    return (512 * MiB if rng.random() < 0.1 else 64 * MiB), 0


def draw_priority(rng: random.Random) -> tuple[int, int]:
    return rng.choice((1, 2, 4, 8)) * 64 * MiB, (5 if rng.random() < 0.25 else 0)


WORKLOADS = {
    "uniform": draw_uniform,
    "mixed": draw_mixed,
    "priority": draw_priority,
    "tenants": draw_uniform,
}
# workload -> its pool's tenant quotas; its clients' tenants: the first half a, the rest b
QUOTAS = {"tenants": {"a": 512 * MiB}}
POLICIES = ("fifo", "backfill")


def _cpu_s(info: dict[str, Any]) -> float:
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def run_one(url: str, workload: str, policy: str, cfg: dict, seed: int) -> dict[str, Any]:
    """One workload under one policy on a fresh pool; returns its measurements."""
    import redis.asyncio as aioredis

    name = f"sched-{workload}-{policy}"
    admin = AsyncPool.from_url(url, name)
    quotas = QUOTAS.get(workload)
    await admin.configure(
        CAPACITY,
        policy=policy,
        backfill_window=cfg["backfill_window_s"],
        max_waiters=1000,
        quotas=quotas,
    )
    pools = [AsyncPool.from_url(url, name) for _ in range(cfg["clients"])]
    draw = WORKLOADS[workload]
    # asked, granted, released, bytes, priority, tenant
    recs: list[tuple[float, float, float, int, int, str]] = []
    errors: list[str] = []
    stop_at = time.monotonic() + cfg["warm_s"] + cfg["duration_s"]

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        pool = pools[i]
        tenant = ("a" if i < cfg["clients"] // 2 else "b") if quotas else None
        while time.monotonic() < stop_at:
            amount, prio = draw(rng)
            asked = time.monotonic()
            try:
                lease = await pool.acquire(amount, timeout=30, priority=prio, tenant=tenant)
            except gpulock.GpuLockError as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            granted = time.monotonic()
            await asyncio.sleep(cfg["hold_s"])
            released = time.monotonic()
            await lease.release()
            recs.append((asked, granted, released, amount, prio, tenant or ""))

    direct = aioredis.Redis.from_url(url)
    try:
        tasks = [asyncio.create_task(client(i)) for i in range(cfg["clients"])]
        await asyncio.sleep(cfg["warm_s"])
        t0 = time.monotonic()
        cpu0, st0 = _cpu_s(await direct.info("cpu")), await admin.status(limit=0)
        await asyncio.sleep(cfg["duration_s"])
        t1 = time.monotonic()
        cpu1, st1 = _cpu_s(await direct.info("cpu")), await admin.status(limit=0)
        await asyncio.gather(*tasks)
    finally:
        for p in pools:
            await p.aclose()
        await admin.aclose()
        await direct.aclose()

    area = sum(max(0.0, min(r, t1) - max(g, t0)) * x[3] for x in recs for g, r in [x[1:3]])
    in_window = [x for x in recs if t0 <= x[0] <= t1]
    grants = st1.grants - st0.grants

    def waits(sel: list) -> dict[str, float]:
        w = [(x[1] - x[0]) * 1000 for x in sel]
        return {
            "n": len(w),
            "p50": percentile(w, 50),
            "p99": percentile(w, 99),
            "max": max(w, default=math.nan),
        }

    sizes = sorted({x[3] for x in in_window})
    prios = sorted({x[4] for x in in_window})
    tenants = sorted({x[5] for x in in_window if x[5]})
    return {
        "workload": workload,
        "policy": policy,
        "window_s": t1 - t0,
        "utilization": area / (CAPACITY * (t1 - t0)),
        "grants_per_s": grants / (t1 - t0),
        "server_cpu_us_per_grant": (cpu1 - cpu0) * 1e6 / grants if grants else math.nan,
        "wait_ms": waits(in_window),
        "wait_by_size_ms": {
            str(s // MiB): waits([x for x in in_window if x[3] == s]) for s in sizes
        },
        "wait_by_priority_ms": {str(p): waits([x for x in in_window if x[4] == p]) for p in prios},
        "wait_by_tenant_ms": {t: waits([x for x in in_window if x[5] == t]) for t in tenants},
        "quotas": quotas or {},
        "peak_by_tenant": {t: _peak([x for x in recs if x[5] == t]) for t in tenants},
        "errors": errors[:5],
        "error_count": len(errors),
    }


def _peak(recs: list) -> int:
    """The most bytes the leases ``recs`` held at once (a sweep of their grant and release
    times; a release sorts before a grant at the same instant)."""
    events = sorted([(x[1], 1, x[3]) for x in recs] + [(x[2], 0, -x[3]) for x in recs])
    cur = peak = 0
    for _, _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


def _classes(r: dict) -> str:
    """A run's wait classes as table text: per tenant, per priority or per size."""
    if r["workload"] == "tenants":
        out = []
        for t, v in r["wait_by_tenant_ms"].items():
            q = r["quotas"].get(t)
            what = (
                f"quota {q // MiB} MiB, peak {r['peak_by_tenant'][t] // MiB} MiB"
                if q
                else "no quota"
            )
            out.append(f"tenant {t} ({what}): {v['p50']:.0f}/{v['p99']:.0f}/{v['max']:.0f}")
        return "; ".join(out)
    by = r["wait_by_priority_ms"] if r["workload"] == "priority" else r["wait_by_size_ms"]
    unit = "prio " if r["workload"] == "priority" else ""
    suffix = "" if r["workload"] == "priority" else " MiB"
    return "; ".join(
        f"{unit}{k}{suffix}: {v['p50']:.0f}/{v['p99']:.0f}/{v['max']:.0f}" for k, v in by.items()
    )


def build_table(R: dict) -> str:
    from peers import table

    rows = []
    for r in R["runs"]:
        rows.append(
            [
                r["workload"],
                r["policy"],
                f"{r['utilization']:.0%}",
                f"{r['grants_per_s']:.0f}",
                _classes(r),
                f"{r['server_cpu_us_per_grant']:.0f}",
            ]
        )
    return table(
        [
            "workload",
            "policy",
            "utilization",
            "grants/s",
            "wait p50/p99/max (ms) per class",
            "server CPU µs per grant",
        ],
        rows,
    )


def run(cfg: dict, quick: bool, json_path: str, server: str | None = None) -> dict[str, Any]:
    from peers import pick_server

    t_all = time.monotonic()
    R: dict[str, Any] = {
        "quick": quick,
        "config": cfg,
        "machine": machine_info(),
        "gpulock": gpulock.__version__,
        "capacity": CAPACITY,
        "runs": [],
    }
    with RedisProcess(pick_server(server)) as rp:
        for w in WORKLOADS:
            for p in POLICIES:
                print(f"# {w} / {p}", file=sys.stderr, flush=True)
                R["runs"].append(asyncio.run(run_one(rp.url, w, p, cfg, seed=7)))
    R["machine"]["loadavg_end"] = list(os.getloadavg())
    R["runtime_s"] = time.monotonic() - t_all
    R["table"] = build_table(R)
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    from core import _clean

    Path(json_path).write_text(
        json.dumps(_clean(R), separators=(",", ":"), default=str, allow_nan=False) + "\n"
    )
    R["json_path"] = json_path
    return R


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=str(HERE / "results" / "scheduling.json"))
    ap.add_argument("--redis-server", default=None)
    ap.add_argument(
        "--plot",
        default=None,
        help="write the plot here (default: benchmarks/results/scheduling.png on a full run)",
    )
    a = ap.parse_args(argv)
    R = run(QUICK if a.quick else FULL, a.quick, a.json, a.redis_server)
    plot = a.plot or (None if a.quick else str(HERE / "results" / "scheduling.png"))
    if plot:
        from plots import plot_scheduling

        plot_scheduling(R, Path(plot))
        print(f"plot: {plot}")
    M, c = R["machine"], R["config"]
    print(
        f"gpulock {R['gpulock']} scheduling benchmark ({'quick' if R['quick'] else 'full'} run, "
        f"{R['runtime_s']:.0f} s); {M['cpu']}, {M['cores']} cores, load avg "
        f"{M['loadavg_start'][0]:.2f} at start, {M['loadavg_end'][0]:.2f} at end"
    )
    print(
        f"{c['clients']} clients back to back for {c['duration_s']:.0f} s, {c['hold_s'] * 1000:.0f} ms "
        f"hold, 1 GiB pool, backfill window {c['backfill_window_s']:g} s"
    )
    print()
    print(R["table"])
    print()
    print(f"raw numbers: {R['json_path']}")
    bad = [r for r in R["runs"] if r["error_count"]]
    if bad:
        print(f"FAILED: errors in {[(r['workload'], r['policy']) for r in bad]}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
