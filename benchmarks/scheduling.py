#!/usr/bin/env python
"""Scheduling benchmark: what the queue policies buy on mixed-size load (docs/SEMANTICS.md,
"Priorities" and "Backfill"), measured on the pool directly (no HTTP service in the way).

    python benchmarks/scheduling.py            # full run, about 2.5 minutes
    python benchmarks/scheduling.py --quick    # smoke run, about 20 s

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
server's CPU per grant (``INFO cpu`` over the window / grants made in it). And the wait
estimate's error (docs/SEMANTICS.md, "Wait estimate"): for each request asked in the window
that queued, the ``estimated_wait`` of its first ``on_queued`` place against its wait
(``acquire()`` called to granted): how many had one, the median and p90 of the absolute and of
the relative error, and the signed median (benchmarks/_estimate_error.py; per run, placement
rows included; per class in the JSON).

Placement rows (docs/SEMANTICS.md, "Devices and placement"): 4 devices of 1 GiB, 64 clients
(16 per device, the load per GiB of the rows above), the same hold, the ``mixed`` and
``uniform`` workloads (``--quick``: ``mixed`` only), FIFO unless named:

* ``bestfit``: one pool of 4 devices, placement bestfit;
* ``spread``: one pool of 4 devices, placement spread;
* ``random``: 4 separate pools of 1 GiB, each request to a uniformly random one (FIFO in each):
  what users of one pool per GPU do today;
* ``bestfit+backfill``: one pool of 4 devices, bestfit, backfill (2 s window).

Reported as above (utilization of all 4 GiB), with each device's peak use: the most bytes its
leases held at once, swept from the clients' grant and release times and ``lease.device``
(inside the server's times, so never above the device's 1 GiB: the run fails if it is).
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
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _estimate_error import Queued, build_error_table, error_stats, samples  # noqa: E402
from _util import machine_info, percentile  # noqa: E402

import gpulock  # noqa: E402
from gpulock import AsyncPool  # noqa: E402
from gpulock.embedded import RedisProcess  # noqa: E402
from gpulock_common.queue import QueuePlace  # noqa: E402

MiB = 2**20
CAPACITY = 1024 * MiB
FULL: dict[str, Any] = dict(
    clients=16,
    duration_s=8.0,
    warm_s=1.0,
    hold_s=0.04,
    backfill_window_s=2.0,
    placement_clients=64,
    placement_workloads=("mixed", "uniform"),
)
QUICK: dict[str, Any] = dict(FULL, duration_s=1.0, warm_s=0.3, placement_workloads=("mixed",))


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

# Placement rows: DEVICES devices of CAPACITY each. row -> (the pool's placement, its policy,
# whether the row is DEVICES separate single-device pools, each request to a uniformly random
# one: what users of one pool per GPU do today)
DEVICES = 4
PLACEMENTS: dict[str, tuple[str | None, str, bool]] = {
    "bestfit": ("bestfit", "fifo", False),
    "spread": ("spread", "fifo", False),
    "random": (None, "fifo", True),
    "bestfit+backfill": ("bestfit", "backfill", False),
}


def _cpu_s(info: dict[str, Any]) -> float:
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


# One lease as a client saw it: asked, granted, released, bytes, priority, tenant, device, and
# its first on_queued place (a gpulock_common.queue.QueuePlace: position, estimated_wait,
# queue_length), None when it did not queue
Rec = tuple[float, float, float, int, int, str, int, "QueuePlace | None"]
# A client's next request: the pool object to ask, the index of that pool's device 0 among the
# devices of the row (4 single-device pools are devices 0-3 of the random row), bytes, priority,
# tenant
Ask = tuple[AsyncPool, int, int, int, "str | None"]


async def _drive(
    url: str,
    admins: list[AsyncPool],
    n_clients: int,
    ask: Callable[[int, random.Random, random.Random], Ask],
    cfg: dict[str, Any],
    seed: int,
) -> tuple[list[Rec], list[str], float, float, int, float]:
    """Run ``n_clients`` clients back to back (client i asks ``ask(i, rng, device_rng)``)
    through the warm-up and the window; returns the leases, the errors, the window's ends, the
    grants the pools ``admins`` made in it and the server's CPU seconds in it. The warm-up
    lasts ``cfg["warm_s"]`` and until every client's first acquire has returned (its pool
    object connected and subscribed: on a loaded machine 64 clients take longer than the
    quick run's 0.3 s), so that the window measures every client running."""
    import redis.asyncio as aioredis

    recs: list[Rec] = []
    errors: list[str] = []
    started: set[int] = set()  # clients whose first acquire has returned
    stop = asyncio.Event()

    async def client(i: int) -> None:
        # sizes from one stream, devices (the random row) from another: every row of a
        # workload asks for the same sizes in the same order
        rng, drng = random.Random(seed * 1000 + i), random.Random(seed * 1000 + i + 10**6)
        while not stop.is_set():
            pool, base, amount, prio, tenant = ask(i, rng, drng)
            places: list[QueuePlace] = []  # the on_queued places, the first one kept
            asked = time.monotonic()
            try:
                lease = await pool.acquire(
                    amount,
                    timeout=30,
                    priority=prio,
                    tenant=tenant,
                    on_queued=lambda p, kept=places: None if kept else kept.append(p),
                )
            except gpulock.GpuLockError as e:
                errors.append(f"{type(e).__name__}: {e}")
                started.add(i)
                continue
            started.add(i)
            granted = time.monotonic()
            await asyncio.sleep(cfg["hold_s"])
            released = time.monotonic()
            await lease.release()
            first = places[0] if places else None
            device = base + lease.device
            recs.append((asked, granted, released, amount, prio, tenant or "", device, first))

    async def grants() -> int:
        return sum([(await a.status(limit=0)).grants for a in admins])

    direct = aioredis.Redis.from_url(url)
    try:
        tasks = [asyncio.create_task(client(i)) for i in range(n_clients)]
        try:
            await asyncio.sleep(cfg["warm_s"])
            while len(started) < n_clients and not any(t.done() for t in tasks):
                await asyncio.sleep(0.01)  # a client that failed ends it: gather raises
            t0 = time.monotonic()
            cpu0, g0 = _cpu_s(await direct.info("cpu")), await grants()
            await asyncio.sleep(cfg["duration_s"])
            t1 = time.monotonic()
            cpu1, g1 = _cpu_s(await direct.info("cpu")), await grants()
        finally:
            stop.set()
        await asyncio.gather(*tasks)
    finally:
        await direct.aclose()
    return recs, errors, t0, t1, g1 - g0, cpu1 - cpu0


def _waits(sel: list[Rec]) -> dict[str, float]:
    w = [(x[1] - x[0]) * 1000 for x in sel]
    return {
        "n": len(w),
        "p50": percentile(w, 50),
        "p99": percentile(w, 99),
        "max": max(w, default=math.nan),
    }


def _queued(sel: list[Rec]) -> list[Queued]:
    """The requests of ``sel`` that queued, as _estimate_error takes them."""
    return [
        Queued(x[0], x[7], x[1] - x[0], {"mib": x[3] // MiB, "priority": x[4], "tenant": x[5]})
        for x in sel
        if x[7] is not None
    ]


def _common(
    recs: list[Rec], t0: float, t1: float, grants: int, cpu_s: float, capacity: int
) -> dict[str, Any]:
    """The measurements every row has: utilization of ``capacity`` (time-weighted, from the
    clients' grant and release times, clipped to the window), grants/s, server CPU per grant,
    and waits (of the requests asked in the window) overall and per size class, with the wait
    estimate's error over those that queued, overall and per size class."""
    area = sum(max(0.0, min(x[2], t1) - max(x[1], t0)) * x[3] for x in recs)
    in_window = [x for x in recs if t0 <= x[0] <= t1]
    return {
        "window_s": t1 - t0,
        "utilization": area / (capacity * (t1 - t0)),
        "grants_per_s": grants / (t1 - t0),
        "server_cpu_us_per_grant": cpu_s * 1e6 / grants if grants else math.nan,
        "wait_ms": _waits(in_window),
        # how long the clients held (40 ms asked): more means the client process lagged
        "hold_ms_p50": percentile([(x[2] - x[1]) * 1000 for x in in_window], 50),
        "wait_by_size_ms": {
            str(s // MiB): _waits([x for x in in_window if x[3] == s])
            for s in sorted({x[3] for x in in_window})
        },
        "wait_estimate": error_stats(_queued(in_window)),
        "wait_estimate_samples": samples(_queued(in_window)),
        "wait_estimate_by_size": {
            str(s // MiB): error_stats(_queued([x for x in in_window if x[3] == s]))
            for s in sorted({x[3] for x in in_window})
        },
    }


async def run_one(
    url: str, workload: str, policy: str, cfg: dict[str, Any], seed: int
) -> dict[str, Any]:
    """One workload under one policy on a fresh pool of one device; returns its measurements."""
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

    def ask(i: int, rng: random.Random, drng: random.Random) -> Ask:
        amount, prio = draw(rng)
        tenant = ("a" if i < cfg["clients"] // 2 else "b") if quotas else None
        return pools[i], 0, amount, prio, tenant

    try:
        recs, errors, t0, t1, grants, cpu_s = await _drive(
            url, [admin], cfg["clients"], ask, cfg, seed
        )
    finally:
        for p in pools:
            await p.aclose()
        await admin.aclose()

    in_window = [x for x in recs if t0 <= x[0] <= t1]
    prios = sorted({x[4] for x in in_window})
    tenants = sorted({x[5] for x in in_window if x[5]})
    return {
        "workload": workload,
        "policy": policy,
        **_common(recs, t0, t1, grants, cpu_s, CAPACITY),
        "wait_by_priority_ms": {str(p): _waits([x for x in in_window if x[4] == p]) for p in prios},
        "wait_by_tenant_ms": {t: _waits([x for x in in_window if x[5] == t]) for t in tenants},
        "wait_estimate_by_priority": {
            str(p): error_stats(_queued([x for x in in_window if x[4] == p])) for p in prios
        },
        "wait_estimate_by_tenant": {
            t: error_stats(_queued([x for x in in_window if x[5] == t])) for t in tenants
        },
        "quotas": quotas or {},
        "peak_by_tenant": {t: _peak([x for x in recs if x[5] == t]) for t in tenants},
        "errors": errors[:5],
        "error_count": len(errors),
    }


async def run_placement(
    url: str, workload: str, row: str, cfg: dict[str, Any], seed: int
) -> dict[str, Any]:
    """One placement row (``PLACEMENTS``) of ``workload`` on DEVICES devices of CAPACITY each,
    fresh pools; returns its measurements, with each device's peak use (swept from the clients'
    grant and release times and ``lease.device``, inside the server's: never above the
    device's capacity)."""
    placement, policy, separate = PLACEMENTS[row]
    n = cfg["placement_clients"]
    draw = WORKLOADS[workload]
    base = f"place-{workload}-{row.replace('+', '-')}"
    names = [f"{base}-{d}" for d in range(DEVICES)] if separate else [base]
    admins = [AsyncPool.from_url(url, nm) for nm in names]
    for a in admins:
        await a.configure(
            CAPACITY,
            devices=None if separate else DEVICES,
            placement=placement,
            policy=policy,
            backfill_window=cfg["backfill_window_s"],
            max_waiters=1000,
        )
    # each client: its own connection and, as a user of 4 single-device pools has, one pool
    # object per pool on it (the random row), or one pool object of the 4-device pool
    heads = [AsyncPool.from_url(url, names[0]) for _ in range(n)]
    objs = [[h] + [AsyncPool(h.redis, nm) for nm in names[1:]] for h in heads]

    def ask(i: int, rng: random.Random, drng: random.Random) -> Ask:
        amount, prio = draw(rng)
        d = drng.randrange(DEVICES) if separate else 0
        return objs[i][d], d, amount, prio, None

    try:
        recs, errors, t0, t1, grants, cpu_s = await _drive(url, admins, n, ask, cfg, seed)
    finally:
        for per in objs:
            for p in reversed(per):  # the head owns the connection: last
                await p.aclose()
        for a in admins:
            await a.aclose()

    in_window = [x for x in recs if t0 <= x[0] <= t1]
    return {
        "workload": workload,
        "row": row,
        "placement": placement,
        "policy": policy,
        "separate_pools": separate,
        "devices": DEVICES,
        "device_capacity": CAPACITY,
        "clients": n,
        **_common(recs, t0, t1, grants, cpu_s, DEVICES * CAPACITY),
        "peak_by_device": [_peak([x for x in recs if x[6] == d]) for d in range(DEVICES)],
        "grants_by_device": [sum(1 for x in in_window if x[6] == d) for d in range(DEVICES)],
        "errors": errors[:5],
        "error_count": len(errors),
    }


def _peak(recs: list[Rec]) -> int:
    """The most bytes the leases ``recs`` held at once (a sweep of their grant and release
    times; a release sorts before a grant at the same instant)."""
    events = sorted([(x[1], 1, x[3]) for x in recs] + [(x[2], 0, -x[3]) for x in recs])
    cur = peak = 0
    for _, _, delta in events:
        cur += delta
        peak = max(peak, cur)
    return peak


def _classes(r: dict[str, Any]) -> str:
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


def build_table(R: dict[str, Any]) -> str:
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


def _sizes(r: dict[str, Any]) -> str:
    return "; ".join(
        f"{k} MiB: {v['p50']:.0f}/{v['p99']:.0f}/{v['max']:.0f}"
        for k, v in r["wait_by_size_ms"].items()
    )


ROW_LABEL = {
    "bestfit": "bestfit, FIFO",
    "spread": "spread, FIFO",
    "random": "random of 4 pools, FIFO each",
    "bestfit+backfill": "bestfit, backfill",
}


def build_placement_table(R: dict[str, Any]) -> str:
    from peers import table

    rows = [
        [
            r["workload"],
            ROW_LABEL.get(r["row"], r["row"]),
            f"{r['utilization']:.0%}",
            f"{r['grants_per_s']:.0f}",
            _sizes(r),
            "/".join(str(p // MiB) for p in r["peak_by_device"]),
            f"{r['server_cpu_us_per_grant']:.0f}",
        ]
        for r in R["placement"]
    ]
    return table(
        [
            "workload",
            "placement",
            "utilization",
            "grants/s",
            "wait p50/p99/max (ms) per size",
            "peak MiB per device",
            "server CPU µs per grant",
        ],
        rows,
    )


def over_capacity(R: dict[str, Any]) -> list[str]:
    """The placement rows where a device's peak use (from the clients' times) exceeded its
    capacity: must be none."""
    return [
        f"{r['workload']}/{r['row']}: device {d} peaked at {p} > {r['device_capacity']}"
        for r in R["placement"]
        for d, p in enumerate(r["peak_by_device"])
        if p > r["device_capacity"]
    ]


def run(
    cfg: dict[str, Any], quick: bool, json_path: str, server: str | None = None
) -> dict[str, Any]:
    from peers import pick_server

    t_all = time.monotonic()
    R: dict[str, Any] = {
        "quick": quick,
        "config": cfg,
        "machine": machine_info(),
        "gpulock": gpulock.__version__,
        "capacity": CAPACITY,
        "devices": DEVICES,
        "runs": [],
        "placement": [],
    }
    with RedisProcess(pick_server(server)) as rp:
        for w in WORKLOADS:
            for p in POLICIES:
                print(f"# {w} / {p}", file=sys.stderr, flush=True)
                R["runs"].append(asyncio.run(run_one(rp.url, w, p, cfg, seed=7)))
        for w in cfg["placement_workloads"]:
            for row in PLACEMENTS:
                print(f"# {w} / {DEVICES} devices, {row}", file=sys.stderr, flush=True)
                R["placement"].append(asyncio.run(run_placement(rp.url, w, row, cfg, seed=7)))
    R["machine"]["loadavg_end"] = list(os.getloadavg())
    R["runtime_s"] = time.monotonic() - t_all
    R["table"] = build_table(R)
    R["placement_table"] = build_placement_table(R)
    R["estimate_table"] = build_error_table(R, ROW_LABEL)
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
        from plots import plot_placement, plot_scheduling

        plot_scheduling(R, Path(plot))
        print(f"plot: {plot}")
        # the placement rows: next to it, "-placement" added to its name
        placement_plot = Path(plot).with_name(f"{Path(plot).stem}-placement{Path(plot).suffix}")
        plot_placement(R, placement_plot)
        print(f"plot: {placement_plot}")
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
    print(
        f"placement: {DEVICES} devices x {CAPACITY // MiB} MiB, {c['placement_clients']} clients "
        f"back to back, {c['hold_s'] * 1000:.0f} ms hold; utilization of all {DEVICES} devices; "
        "peak: the most bytes each device held at once (from the clients' grant and release times)"
    )
    print()
    print(R["placement_table"])
    print()
    print(
        "wait estimate: the estimated_wait of each queued request's first on_queued place "
        "against its wait (acquire() called to granted), over the requests asked in the "
        "window that queued; signed = estimate - wait (> 0: too long)"
    )
    print()
    print(R["estimate_table"])
    print()
    print(f"raw numbers: {R['json_path']}")
    bad = [r for r in R["runs"] if r["error_count"]]
    if bad:
        print(f"FAILED: errors in {[(r['workload'], r['policy']) for r in bad]}")
        return 2
    bad_rows = [r for r in R["placement"] if r["error_count"]]
    if bad_rows:
        print(f"FAILED: errors in {[(r['workload'], r['row']) for r in bad_rows]}")
        return 2
    over = over_capacity(R)
    if over:
        print(f"FAILED: a device held more than its capacity: {over}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
