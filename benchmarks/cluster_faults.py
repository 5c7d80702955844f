#!/usr/bin/env python
"""gpulock on Redis Cluster under faults: how long the other shards stall, and how soon the
faulted shard's pool grants again.

    python benchmarks/cluster_faults.py                        # every fault, 5 rounds each
    python benchmarks/cluster_faults.py --faults kill --rounds 5 --mode sync
    python benchmarks/cluster_faults.py --quick                # 2 rounds of each (smoke run)

It starts a cluster of 3 masters with one replica each on loopback (``--node-timeout``, default
2000 ms, is ``cluster-node-timeout``; ``cluster-require-full-coverage no`` unless
``--full-coverage``) and one load process: one cluster client (``--mode async``: an
``AsyncPool`` per pool on one ``redis.asyncio`` cluster client, or ``sync``: a ``Pool`` per
pool on one sync cluster client), one pool on each master, two workers per pool looping
``acquire(60 of 100, timeout=30)``, a 10 ms hold, ``release()`` (so one waits while the other
holds: grants are handed off).
Each round injects one fault on the shard of the next pool in turn:

* ``kill``: ``kill -9`` of its master; the round ends after the promotion, and the node is
  started again (it rejoins as a replica);
* ``sigstop``: SIGSTOP of its master (connections to it succeed, no reply comes); resumed
  (SIGCONT) after the promotion, it rejoins as a replica;
* ``replica``: ``kill -9`` of its master's replica (no promotion), started again after 3 s;
* ``migrate``: its slot moved to another master (``SETSLOT IMPORTING/MIGRATING``, ``MIGRATE``
  of its keys one at a time 0.2 s apart, ``SETSLOT NODE``), under the load.

Measured per round, from the load's grant times (``time.monotonic()``, one clock for the
machine's processes):

* **stall of the other shards**: the longest time without a grant of a pool on a shard that
  was not faulted (for ``replica``: of any pool), from the fault until 2 s after the faulted
  pool granted again; the same statistic over a quiet 3 s before the first fault is the
  baseline;
* **promotion → first grant**: from the moment the replica answers ``ROLE`` as a master
  (polled every 10 ms) to the faulted pool's first grant after it (``kill``, ``sigstop``);
  for ``migrate``, from ``SETSLOT NODE`` to the migrated pool's first grant after it, and the
  migrated pool's own longest gap;
* **errors**: what the load's calls raised (an acquire rides a failover within its timeout;
  anything raised is counted).

p50 and max over the rounds go to a table and, with every round, to ``--json`` (default
benchmarks/results/cluster_faults.json). The load average is recorded at the start and end:
on a loaded machine every gap grows.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import machine_info, percentile  # noqa: E402

from gpulock.protocol.keys import pool_key  # noqa: E402
from gpulock.transport.local_cluster import Cluster, start_cluster  # noqa: E402
from gpulock.embedded import find_server_binary  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FAULTS = ("kill", "sigstop", "replica", "migrate")
AMOUNT, CAPACITY, HOLD_S, WORKERS = 60, 100, 0.01, 2


# ---- the load process ------------------------------------------------------------------------
def _load(url: str, names: list[str], mode: str, out: str, stop: Any) -> None:
    """Loop acquire/hold/release on every pool until ``stop`` is set; one line per grant
    (``G <pool> <monotonic>``) and per error (``E <pool> <monotonic> <message>``) to ``out``."""
    lock = threading.Lock()
    f = open(out, "a", buffering=1)

    def log(line: str) -> None:
        with lock:
            f.write(line + "\n")

    if mode == "async":
        import asyncio

        from gpulock import AsyncPool
        from gpulock._async import _CLIENT_DEFAULTS
        from gpulock.transport.connect import async_client

        async def worker(p: Any) -> None:
            while not stop.is_set():
                try:
                    lease = await p.acquire(AMOUNT, ttl=10, timeout=30)
                except Exception as e:  # noqa: BLE001 - counted
                    log(f"E {p.name} {time.monotonic():.6f} {type(e).__name__}: {e}")
                    await asyncio.sleep(0.05)
                    continue
                log(f"G {p.name} {time.monotonic():.6f}")
                await asyncio.sleep(HOLD_S)
                try:
                    await lease.release()
                except Exception as e:  # noqa: BLE001 - counted
                    log(f"E {p.name} {time.monotonic():.6f} {type(e).__name__}: {e}")

        async def main() -> None:
            client = async_client(url, **_CLIENT_DEFAULTS)
            pools = [AsyncPool(client, n) for n in names]
            await asyncio.gather(*(worker(p) for p in pools for _ in range(WORKERS)))
            for p in pools:
                await p.aclose()

        asyncio.run(main())
    else:
        from gpulock import Pool
        from gpulock._async import _CLIENT_DEFAULTS
        from gpulock.transport.connect import sync_client

        client = sync_client(url, **_CLIENT_DEFAULTS)
        pools = [Pool(client, n) for n in names]

        def sworker(p: Any) -> None:
            while not stop.is_set():
                try:
                    lease = p.acquire(AMOUNT, ttl=10, timeout=30)
                except Exception as e:  # noqa: BLE001 - counted
                    log(f"E {p.name} {time.monotonic():.6f} {type(e).__name__}: {e}")
                    time.sleep(0.05)
                    continue
                log(f"G {p.name} {time.monotonic():.6f}")
                time.sleep(HOLD_S)
                try:
                    lease.release()
                except Exception as e:  # noqa: BLE001 - counted
                    log(f"E {p.name} {time.monotonic():.6f} {type(e).__name__}: {e}")

        ts = [threading.Thread(target=sworker, args=(p,)) for p in pools for _ in range(WORKERS)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for p in pools:
            p.close()
    f.close()


class Events:
    """The load's grants and errors, read from its file as it grows."""

    def __init__(self, path: Path):
        self.path = path
        self.grants: dict[str, list[float]] = {}
        self.errors: list[tuple[str, float, str]] = []
        self._at = 0

    def read(self) -> None:
        with open(self.path) as f:
            f.seek(self._at)
            chunk = f.read()
        end = chunk.rfind("\n") + 1
        self._at += len(chunk[:end].encode())
        for line in chunk[:end].splitlines():
            kind, pool, t, *rest = line.split(" ", 3)
            if kind == "G":
                self.grants.setdefault(pool, []).append(float(t))
            else:
                self.errors.append((pool, float(t), rest[0] if rest else ""))

    def first_after(self, pool: str, t: float) -> float | None:
        return next((g for g in self.grants.get(pool, []) if g > t), None)

    def longest_gap(self, pool: str, t0: float, t1: float) -> float:
        """The longest time without a grant of ``pool`` within [t0, t1]."""
        return self.gap_at(pool, t0, t1)[0]

    def gap_at(self, pool: str, t0: float, t1: float, clip: bool = False) -> tuple[float, float]:
        """The longest time without a grant of ``pool`` within [t0, t1], and when it began
        (``clip``: counted from t0 at the earliest, else from the last grant before t0)."""
        gs = [g for g in self.grants.get(pool, []) if t0 < g < t1]
        before = [g for g in self.grants.get(pool, []) if g <= t0]
        pts = [before[-1] if before and not clip else t0, *gs, t1]
        return max((b - a, a) for a, b in zip(pts, pts[1:]))


def _wait(pred: Any, timeout: float, what: str, step: float = 0.01, fail: bool = True) -> float:
    """Poll ``pred`` until true: the time it was. Past ``timeout``: RuntimeError, or (not
    ``fail``) the time it gave up."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            if not fail:
                return time.monotonic()
            raise RuntimeError(f"timed out ({timeout}s) waiting for {what}")
        time.sleep(step)
    return time.monotonic()


#: Seconds a round waits for the faulted pool to grant again (then it counts as never).
GIVE_UP_S = 30.0


# ---- one round -------------------------------------------------------------------------------
def run_round(c: Cluster, ev: Events, names: list[str], fault: str, i: int) -> dict[str, Any]:
    name = names[i % len(names)]
    others = [n for n in names if n != name]
    key = pool_key(name, "cfg")
    master = c.master_of(key)
    ev.read()
    r: dict[str, Any] = {"fault": fault, "pool": name, "node": f"{master.host}:{master.port}"}
    errors_before = len(ev.errors)
    event = None  # promotion (kill, sigstop) or SETSLOT NODE (migrate)

    def granted_after(t: float) -> bool:
        ev.read()
        return ev.first_after(name, t) is not None

    if fault in ("kill", "sigstop"):
        replica = c.replica_of(master)
        t0 = time.monotonic()
        if fault == "kill":
            master.kill()
        else:
            c.pause(master)
        event = _wait(lambda: c.is_master(replica, 0.2), 60, "the promotion")
        ev.read()
        _wait(lambda: granted_after(event), GIVE_UP_S, "", 0.02, fail=False)
        end = time.monotonic() + 2.0
        _wait(lambda: time.monotonic() > end, 10, "the tail")
        if fault == "kill":
            master.start()
        else:
            c.resume(master)
        c.wait_synced(master, 60)
    elif fault == "replica":
        replica = c.replica_of(master)
        t0 = time.monotonic()
        replica.kill()
        time.sleep(3.0)
        end = time.monotonic()
        replica.start()
        c.wait_synced(replica, 60)
    else:
        to = next(m for m in c.live_nodes() if c.is_master(m) and m is not master)
        t0 = time.monotonic()
        c.migrate_slot(key, to, step_pause=0.2)
        event = time.monotonic()
        _wait(lambda: granted_after(event), GIVE_UP_S, "", 0.02, fail=False)
        end = time.monotonic() + 2.0
        _wait(lambda: time.monotonic() > end, 10, "the tail")
    time.sleep(0.5)
    ev.read()
    gap, at, who = max(
        (*ev.gap_at(n, t0, end, clip=True), n) for n in (others if fault != "replica" else names)
    )
    r["other_stall_s"], r["other_stall_from_fault_s"], r["other_stall_pool"] = gap, at - t0, who
    if event is not None:
        first = ev.first_after(name, event)
        r["event_after_fault_s"] = event - t0
        r["first_grant_after_event_s"] = None if first is None else first - event
        r["own_stall_s"] = ev.longest_gap(name, t0, end)
    errs = ev.errors[errors_before:]
    r["errors"] = len(errs)
    r["error_samples"] = sorted({e[2][:200] for e in errs})[:5]
    r["errors_other_shards"] = sum(1 for e in errs if e[0] != name)
    return r


def summarize(rounds: list[dict[str, Any]], field: str) -> tuple[float, float] | None:
    """(p50, max) of ``field`` over ``rounds``; a round where it never happened counts as
    infinite; None when no round has the field."""
    xs = [math.inf if r[field] is None else r[field] for r in rounds if field in r]
    if not xs:
        return None
    return percentile(xs, 50), max(xs)


def _s(x: float) -> str:
    return f"> {GIVE_UP_S:.0f} s" if math.isinf(x) else f"{x:.2f} s"


def run_fault(
    binary: str,
    fault: str,
    rounds: int,
    mode: str,
    node_timeout: int,
    tmp: Path,
    full_coverage: bool = False,
) -> dict[str, Any]:
    c = start_cluster(
        binary, masters=3, replicas=1, node_timeout_ms=node_timeout, full_coverage=full_coverage
    )
    out = tmp / f"load-{fault}-{mode}.log"
    out.write_text("")
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    try:
        names = [ns[0] for ns in c.names_by_master(f"cf{fault[:2]}")]
        from gpulock import Pool

        for n in names:
            with Pool.from_url(c.url, n) as p:
                p.configure(CAPACITY)
        proc = ctx.Process(target=_load, args=(c.url, names, mode, str(out), stop))
        proc.start()
        ev = Events(out)
        _wait(lambda: (ev.read(), all(ev.grants.get(n) for n in names))[1], 60, "the load")
        t0 = time.monotonic()
        time.sleep(3.0)
        ev.read()
        base = max(ev.longest_gap(n, t0, time.monotonic()) for n in names)
        res: dict[str, Any] = {"baseline_gap_s": base, "rounds": []}
        for i in range(rounds):
            r = run_round(c, ev, names, fault, i)
            print(f"  {fault} #{i + 1}: {json.dumps(r)}", flush=True)
            res["rounds"].append(r)
        stop.set()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        return res
    finally:
        stop.set()
        c.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {FAULTS}")
    ap.add_argument("--rounds", type=int, default=5, help="faults of each kind (default 5)")
    ap.add_argument("--quick", action="store_true", help="2 rounds of each fault")
    ap.add_argument("--mode", choices=("async", "sync"), default="async")
    ap.add_argument("--node-timeout", type=int, default=2000, help="cluster-node-timeout, ms")
    ap.add_argument("--json", default=str(RESULTS / "cluster_faults.json"))
    ap.add_argument("--redis-server", default=None)
    ap.add_argument("--logs", default=None, help="keep the load's event logs in this folder")
    ap.add_argument(
        "--full-coverage",
        action="store_true",
        help="cluster-require-full-coverage yes (Redis's default; the clusters here use no)",
    )
    a = ap.parse_args(argv)
    faults = [f for f in a.faults.split(",") if f]
    bad = [f for f in faults if f not in FAULTS]
    if bad:
        ap.error(f"unknown fault(s) {bad}; the faults are {FAULTS}")
    rounds = 2 if a.quick else a.rounds
    binary = a.redis_server or find_server_binary()
    R: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/cluster_faults.py", *(argv or sys.argv[1:])]),
        "machine": machine_info(),
        "mode": a.mode,
        "node_timeout_ms": a.node_timeout,
        "full_coverage": a.full_coverage,
        "load_start": os.getloadavg(),
        "faults": {},
    }
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(a.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for f in faults:
            print(f"{f}:", flush=True)
            R["faults"][f] = run_fault(
                binary, f, rounds, a.mode, a.node_timeout, logs, a.full_coverage
            )
    R["load_end"] = os.getloadavg()
    print(
        f"\ngpulock on Redis Cluster under faults — {a.mode} pools on one client, "
        f"cluster-node-timeout {a.node_timeout} ms, {rounds} rounds each, "
        f"load {R['load_start'][0]:.2f} → {R['load_end'][0]:.2f}"
    )
    cols = (
        ("baseline gap", None),
        ("other shards' longest gap", "other_stall_s"),
        ("fault → promotion", "event_after_fault_s"),
        ("promotion → 1st grant", "first_grant_after_event_s"),
        ("faulted pool's longest gap", "own_stall_s"),
    )
    print(f"{'fault':<8}" + "".join(f" | {c:>26}" for c, _ in cols) + " | errors")
    for f, v in R["faults"].items():
        rs = v["rounds"]
        v["summary"] = {k: summarize(rs, k) for _, k in cols if k}
        cells = [f"{v['baseline_gap_s']:.2f} s"]
        for _, k in cols[1:]:
            x = v["summary"][k]
            cells.append("—" if x is None else f"{_s(x[0])} / {_s(x[1])}")
        errors = sum(r["errors"] for r in rs)
        print(f"{f:<8}" + "".join(f" | {c:>26}" for c in cells) + f" | {errors}")
    print("(p50 / max over the rounds; for migrate the event is SETSLOT NODE, not a promotion)")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(R, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
