#!/usr/bin/env python
"""gpulock with many waiters in one process: connections, Redis commands/s, enqueue time.

    python benchmarks/waiters.py                      # 10, 100, 1,000, 10,000 waiters; ~40 s
    python benchmarks/waiters.py --quick              # smoke run (CI): 10 and 100, ~3 s
    python benchmarks/waiters.py --n 1000 --max-connections 4 --json /tmp/w.json

It starts its own ``redis-server`` on a free loopback port. For each N, one pool object in this
process (``AsyncPool.from_url`` with its defaults, capacity 1) holds the capacity and N
concurrent ``acquire(1)`` calls queue behind it; then, for the sync ``Pool``, the same with N
threads (N ≤ ``--sync-max``). Measured, from the server's own counters:

* **connections opened**: ``total_connections_received`` from just before the pool object
  was made until after every waiter was granted (a short-lived connection counts too); and
  the connections open while they wait (``CLIENT LIST``, the harness's own excluded);
* **enqueue**: seconds from starting the N acquires until each had its queue position
  (``on_queued``), and the client commands that took (``INFO commandstats`` deltas; the
  commands gpulock's scripts run inside Redis and the harness's ``INFO``/``CLIENT`` excluded);
* **waiting**: client commands per second over a window while all N wait (the heartbeat
  refreshes every waiter in one call per second), and the Redis CPU those take (the
  commandstats ``usec`` of the window's commands, per second of window);
* **drain**: seconds until all N were granted one after another (each releases at once);
* **pool errors**: redis-py ``ConnectionError``s saying the client ran out of connections
  ("Too many connections", or a blocking pool's "No connection available"), counted where
  redis-py makes them; gpulock retries those silently, so only a count shows them.

Numbers, the machine and the command go to ``--json`` (default benchmarks/results/waiters.json)
and a table to stdout. No targets: this measures the cost of waiting, docs/BENCHMARKS.md
reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import redis
import redis.exceptions as rex

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _util import machine_info  # noqa: E402

import gpulock  # noqa: E402
from gpulock import AsyncPool, Pool  # noqa: E402
from gpulock.protocol.keys import pool_keys  # noqa: E402
from gpulock.transport.scripts import scripts  # noqa: E402
from gpulock.embedded import RedisProcess, find_server_binary  # noqa: E402

HARNESS = {"info", "client|list", "client|id", "ping", "hello"}


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


# ---- counters ---------------------------------------------------------------------------------

POOL_ERRORS: list[str] = []


def count_pool_errors() -> None:
    """Count every redis-py ConnectionError that says the client ran out of connections."""
    orig = rex.ConnectionError.__init__

    def counting_init(self, *args, **kw):
        msg = str(args[0]) if args else ""
        if "Too many connections" in msg or "No connection available" in msg:
            POOL_ERRORS.append(msg)
        orig(self, *args, **kw)

    rex.ConnectionError.__init__ = counting_init  # type: ignore[method-assign]


def _inner() -> set[str]:
    names: set[str] = set()
    for sc in scripts().values():
        names |= {m.lower() for m in re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", sc.source)}
    return names


INNER = _inner()


class Server:
    """The harness's view of the server: its own connection, excluded from every count."""

    def __init__(self, url: str):
        self.c = redis.Redis.from_url(url)
        self.me = self.c.client_id()

    def opened(self) -> int:
        return int(self.c.info("stats")["total_connections_received"])

    def others(self) -> int:
        return sum(1 for x in self.c.client_list() if int(x["id"]) != self.me)

    def cmdstats(self) -> dict[str, tuple[int, int]]:
        out = {}
        for k, v in self.c.info("commandstats").items():
            name = k[len("cmdstat_") :]
            if name in HARNESS or name.split("|")[0] in INNER:
                continue
            out[name] = (int(v["calls"]), int(v["usec"]))
        return out

    @staticmethod
    def delta(a: dict, b: dict) -> dict[str, tuple[int, int]]:
        d = {k: (b[k][0] - a.get(k, (0, 0))[0], b[k][1] - a.get(k, (0, 0))[1]) for k in b}
        return {k: v for k, v in d.items() if v[0]}


def _summary(d: dict[str, tuple[int, int]], seconds: float | None = None) -> dict[str, Any]:
    calls = sum(v[0] for v in d.values())
    usec = sum(v[1] for v in d.values())
    out: dict[str, Any] = {
        "calls": calls,
        "usec": usec,
        "by_command": {k: v[0] for k, v in sorted(d.items())},
    }
    if seconds:
        out["per_s"] = calls / seconds
        out["cpu_share"] = usec / 1e6 / seconds
    return out


# ---- one run ---------------------------------------------------------------------------------


def _pool_kw(a: argparse.Namespace, n: int) -> dict[str, Any]:
    kw: dict[str, Any] = {"capacity": 1, "max_waiters": max(n + 10, 100)}
    if a.max_connections is not None:
        kw["max_connections"] = a.max_connections
    return kw


async def run_async(
    url: str, srv: Server, name: str, n: int, a: argparse.Namespace
) -> dict[str, Any]:
    errs0 = len(POOL_ERRORS)
    opened0 = srv.opened()
    pool = AsyncPool.from_url(url, name, **_pool_kw(a, n))
    tasks: list[asyncio.Task] = []
    try:
        holder = await pool.acquire(1, ttl=60)
        queued = 0
        all_queued = asyncio.Event()
        granted = 0

        def on_queued(pos: int) -> None:
            nonlocal queued
            queued += 1
            if queued == n:
                all_queued.set()

        async def waiter() -> None:
            nonlocal granted
            lease = await pool.acquire(1, ttl=60, timeout=600, on_queued=on_queued)
            granted += 1
            await lease.release()

        s0 = srv.cmdstats()
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(waiter()) for _ in range(n)]
        done = asyncio.ensure_future(all_queued.wait())
        await asyncio.wait(
            {done, *tasks}, timeout=a.enqueue_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if not all_queued.is_set():
            bad = [t for t in tasks if t.done()]
            raise RuntimeError(
                f"{queued} of {n} queued after {a.enqueue_timeout}s"
                + (f"; {len(bad)} acquires failed, e.g. {bad[0].exception()!r}" if bad else "")
            )
        enqueue_s = time.perf_counter() - t0
        s1 = srv.cmdstats()
        opened_enqueue = srv.opened() - opened0
        await asyncio.sleep(a.settle)
        w0 = srv.cmdstats()
        tw = time.perf_counter()
        await asyncio.sleep(a.window / 2)
        open_waiting = srv.others()
        await asyncio.sleep(a.window / 2)
        w1 = srv.cmdstats()
        window = time.perf_counter() - tw
        t1 = time.perf_counter()
        await holder.release()
        await asyncio.gather(*tasks)
        drain_s = time.perf_counter() - t1
        batch = getattr(pool, "_batch", None)
        batches = {"pipelines": batch.batches, "calls": batch.batched_calls} if batch else None
    finally:
        await pool.aclose()
        await asyncio.gather(*tasks, return_exceptions=True)
    left = srv.c.zcard(pool_keys(name)[3])
    return {
        "shell": "AsyncPool",
        "waiters": n,
        "enqueue_s": enqueue_s,
        "enqueue_cmds": _summary(Server.delta(s0, s1)),
        "waiting": _summary(Server.delta(w0, w1), window),
        "window_s": window,
        "open_while_waiting": open_waiting,
        "opened_during_enqueue": opened_enqueue,
        "opened": srv.opened() - opened0,
        "drain_s": drain_s,
        "granted": granted,
        "batched": batches,
        "pool_errors": len(POOL_ERRORS) - errs0,
        "left_in_queue": left,
    }


def run_sync(url: str, srv: Server, name: str, n: int, a: argparse.Namespace) -> dict[str, Any]:
    errs0 = len(POOL_ERRORS)
    opened0 = srv.opened()
    pool = Pool.from_url(url, name, **_pool_kw(a, n))
    lock = threading.Lock()
    all_queued = threading.Event()
    counts = {"queued": 0, "granted": 0}
    errors: list[BaseException] = []
    try:
        holder = pool.acquire(1, ttl=60)

        def on_queued(pos: int) -> None:
            with lock:
                counts["queued"] += 1
                if counts["queued"] == n:
                    all_queued.set()

        def waiter() -> None:
            try:
                lease = pool.acquire(1, ttl=60, timeout=600, on_queued=on_queued)
                with lock:
                    counts["granted"] += 1
                lease.release()
            except BaseException as e:  # noqa: BLE001 - reported
                errors.append(e)
                all_queued.set()

        threads = [threading.Thread(target=waiter, daemon=True) for _ in range(n)]
        s0 = srv.cmdstats()
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        all_queued.wait(a.enqueue_timeout)
        if errors or counts["queued"] < n:
            raise RuntimeError(f"{counts['queued']} of {n} queued; {errors[:1]!r}")
        enqueue_s = time.perf_counter() - t0
        s1 = srv.cmdstats()
        opened_enqueue = srv.opened() - opened0
        time.sleep(a.settle)
        w0 = srv.cmdstats()
        tw = time.perf_counter()
        time.sleep(a.window / 2)
        open_waiting = srv.others()
        time.sleep(a.window / 2)
        w1 = srv.cmdstats()
        window = time.perf_counter() - tw
        t1 = time.perf_counter()
        holder.release()
        for t in threads:
            t.join()
        drain_s = time.perf_counter() - t1
    finally:
        pool.close()
    left = srv.c.zcard(pool_keys(name)[3])
    return {
        "shell": "Pool (sync)",
        "waiters": n,
        "enqueue_s": enqueue_s,
        "enqueue_cmds": _summary(Server.delta(s0, s1)),
        "waiting": _summary(Server.delta(w0, w1), window),
        "window_s": window,
        "open_while_waiting": open_waiting,
        "opened_during_enqueue": opened_enqueue,
        "opened": srv.opened() - opened0,
        "drain_s": drain_s,
        "granted": counts["granted"],
        "pool_errors": len(POOL_ERRORS) - errs0,
        "left_in_queue": left,
    }


# ---- report ----------------------------------------------------------------------------------

COLS = (
    "shell",
    "waiters",
    "connections opened",
    "open while waiting",
    "pool errors",
    "enqueue all (s)",
    "commands per enqueue",
    "commands/s waiting",
    "Redis CPU waiting",
    "drain (s)",
)


def row(r: dict[str, Any]) -> tuple[str, ...]:
    n = r["waiters"]
    if "error" in r:
        return (r["shell"], f"{n:,}", "failed: " + r["error"][:60], "", "", "", "", "", "", "")
    return (
        r["shell"],
        f"{n:,}",
        str(r["opened"]),
        str(r["open_while_waiting"]),
        f"{r['pool_errors']:,}",
        f"{r['enqueue_s']:.3f}",
        f"{r['enqueue_cmds']['calls'] / n:.2f}",
        f"{r['waiting']['per_s']:.2f}",
        f"{100 * r['waiting']['cpu_share']:.2f} %",
        f"{r['drain_s']:.2f}",
    )


def print_table(rows: list[tuple[str, ...]]) -> None:
    w = [max(len(x[i]) for x in rows + [COLS]) for i in range(len(COLS))]
    print("  ".join(c.ljust(w[i]) for i, c in enumerate(COLS)).rstrip())
    print("  ".join("-" * w[i] for i in range(len(COLS))))
    for r in rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: 10 and 100 waiters, short windows"
    )
    ap.add_argument(
        "--n", default=None, help="comma list of waiter counts (default 10,100,1000,10000)"
    )
    ap.add_argument(
        "--sync-max", type=int, default=1000, help="largest N also run with the sync Pool (threads)"
    )
    ap.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="from_url's max_connections (default: its own)",
    )
    ap.add_argument(
        "--window",
        type=float,
        default=None,
        help="seconds of the waiting window (default 3; quick 0.5)",
    )
    ap.add_argument(
        "--enqueue-timeout",
        type=float,
        default=300.0,
        help="seconds allowed to queue all N (then the run fails)",
    )
    ap.add_argument(
        "--json", default=str(HERE / "results" / "waiters.json"), help="where to write raw numbers"
    )
    ap.add_argument(
        "--redis-server", default=None, help="server binary (default: redis-server on PATH)"
    )
    a = ap.parse_args(argv)
    ns = [int(x) for x in (a.n or ("10,100" if a.quick else "10,100,1000,10000")).split(",")]
    a.window = a.window or (0.5 if a.quick else 3.0)
    a.settle = (
        0.2 if a.quick else 1.5
    )  # past the first heartbeat after the burst (poll_interval 1 s)
    binary = a.redis_server or find_server_binary("redis")
    count_pool_errors()
    R: dict[str, Any] = {
        "quick": a.quick,
        "gpulock": gpulock.__version__,
        "gpulock_path": gpulock.__file__,
        "machine": machine_info(),
        "max_connections": a.max_connections,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "runs": [],
    }
    t_start = time.monotonic()
    runs = [("AsyncPool", n) for n in ns] + [("Pool (sync)", n) for n in ns if n <= a.sync_max]
    for shell, n in runs:
        log(f"{shell}, {n} waiters")
        with RedisProcess(binary) as rp:  # a fresh server per run: nothing left from the last one
            srv = Server(rp.url)
            R["server"] = {"version": srv.c.info("server").get("redis_version"), "binary": binary}
            try:
                if shell == "AsyncPool":
                    R["runs"].append(asyncio.run(run_async(rp.url, srv, f"wa{n}", n, a)))
                else:
                    R["runs"].append(run_sync(rp.url, srv, f"ws{n}", n, a))
            except Exception as e:  # reported as a row (before max_connections, 10,000 failed)
                R["runs"].append({"shell": shell, "waiters": n, "error": repr(e)[:300]})
                log(f"FAILED: {shell}, {n} waiters: {e!r}"[:400])
            srv.c.close()
    R["runtime_s"] = time.monotonic() - t_start
    m = R["machine"]
    print(
        f"gpulock {R['gpulock']} many-waiters benchmark ({'quick' if a.quick else 'full'} run, "
        f"{R['runtime_s']:.0f} s); {m['cpu']}, {m['cores']} cores, load {m['loadavg_start'][0]:.2f}; "
        f"server {R['server']['version']}; redis-py {m['redis_py']} ({m['redis_py_parser']})"
    )
    print(
        f"max_connections: {a.max_connections if a.max_connections is not None else 'from_url default'}; "
        f"waiting window {a.window:.1f} s"
    )
    print()
    print_table([row(r) for r in R["runs"]])
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(R, indent=1))
    print(f"\nraw numbers: {a.json}")
    bad = [
        r for r in R["runs"] if "error" in r or r["granted"] != r["waiters"] or r["left_in_queue"]
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
