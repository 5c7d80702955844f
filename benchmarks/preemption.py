#!/usr/bin/env python
"""Preemption: time from an urgent request to its grant when a low-priority holder holds the
whole pool.

    python benchmarks/preemption.py                 # 20 / 5 / 5 rounds; ~25 s
    python benchmarks/preemption.py --rounds 2      # every case 2 rounds (the smoke test)

It starts its own ``redis-server`` on a free loopback port and makes one pool of 100 bytes with
preemption on (gap 1, yield grace ``--grace``, default 1 s). In each round a holder at priority
0 (preemptible, ttl ``--ttl`` <= the grace, heartbeating) holds the whole pool, then a request
at priority 10 for the whole pool is made; the time measured is from just before its
``acquire`` to its return (this process's monotonic clock). Cases:

* **cooperative**: a pool object in this process whose ``on_yield`` callback releases the lease
  (it starts the release in a thread: callbacks must not block);
* **uncooperative**: a pool object that keeps renewing and never releases: the bytes come back
  when the server takes the lease back at its yield deadline;
* **gpulock run**: a ``gpulock run`` job (a subprocess) whose command traps SIGTERM and exits.

Each row says how the bytes came back, from the pool's counters: ``released`` (y_done: the
holder released before its deadline) or ``taken`` (y_taken: expired at the deadline). The floor
is an uncontended acquire's round trip (acquire of a free pool, p50), measured in the same run.
Numbers, the machine and the command go to ``--json`` and a table to stdout; no targets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _util import machine_info, percentile  # noqa: E402

import gpulock  # noqa: E402
from gpulock import Pool, Preemption  # noqa: E402
from gpulock.embedded import RedisProcess, find_server_binary  # noqa: E402
from gpulock.protocol.keys import pool_key  # noqa: E402

CAP = 100
URGENT, LOW = 10, 0
WAIT_S = 60.0  # an urgent request that waits longer than this fails the run

#: The command of the ``gpulock run`` case: trap SIGTERM (exit 0 on it), say it runs, wait.
TRAP = (
    "import pathlib, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "pathlib.Path(sys.argv[1]).touch()\n"
    "time.sleep(600)\n"
)


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def gpulock_argv() -> list[str]:
    """The ``gpulock`` CLI of this interpreter's environment."""
    script = Path(sys.executable).with_name("gpulock")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from gpulock.cli import main; sys.exit(main())"]


def enable(pool: Pool, grace_s: float, max_ttl_s: float) -> None:
    """Make the pool (CAP bytes, a bound of ``max_ttl_s`` on ttls) with preemption on, gap 1."""
    pool.configure(CAP, max_waiters=1000, max_ttl=max_ttl_s, preemption=Preemption(1, grace_s))


def counters(pool: Pool) -> tuple[int, int]:
    """(y_done, y_taken) of the pool's config."""
    c = pool.redis.hmget(pool_key(pool.name, "cfg"), "y_done", "y_taken")
    return int(c[0] or 0), int(c[1] or 0)


def urgent(pool: Pool, ttl: float) -> float:
    """Seconds from an urgent acquire of the whole pool to its grant (then released)."""
    t0 = time.monotonic()
    lease = pool.acquire(CAP, ttl=ttl, priority=URGENT, timeout=WAIT_S)
    dt = time.monotonic() - t0
    lease.release()
    return dt


def until(cond: Callable[[], Any], what: str, timeout: float = WAIT_S) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.005)


def floor(pool: Pool, n: int) -> list[float]:
    """Uncontended acquire round trips (seconds), each lease released untimed."""
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        lease = pool.acquire(CAP, ttl=5, timeout=0)
        out.append(time.monotonic() - t0)
        lease.release()
    return out


def case_in_process(
    url: str, name: str, waiter: Pool, a: argparse.Namespace, coop: bool
) -> list[float]:
    """The cooperative or uncooperative holder: a pool object of its own in this process."""
    times = []
    with Pool.from_url(url, name) as hp:
        for _ in range(a.coop_rounds if coop else a.unco_rounds):
            lease = hp.acquire(CAP, ttl=a.ttl, priority=LOW, timeout=WAIT_S)
            if coop:
                lease.on_yield(lambda lz: threading.Thread(target=lz.release).start())
            times.append(urgent(waiter, a.ttl))
            until(lambda lz=lease: lz._state.released or lz._state.lost_reason, "holder done")
    return times


def case_run(url: str, name: str, waiter: Pool, a: argparse.Namespace, tmp: Path) -> list[float]:
    """The ``gpulock run`` job: its command traps SIGTERM and exits."""
    times = []
    for i in range(a.run_rounds):
        ready = tmp / f"ready{i}"
        job = subprocess.Popen(
            [
                *gpulock_argv(),
                "run",
                "--pool",
                name,
                "--amount",
                str(CAP),
                "--ttl",
                str(a.ttl),
                "--priority",
                str(LOW),
                "--grace",
                "5",
                "--quiet",
                "--",
                sys.executable,
                "-c",
                TRAP,
                str(ready),
            ],
            env={**os.environ, "GPULOCK_REDIS_URL": url},
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            until(ready.exists, "the gpulock run job started")
            times.append(urgent(waiter, a.ttl))
            job.communicate(timeout=WAIT_S)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--rounds", type=int, default=None, help="rounds of every case (default 20/5/5)"
    )
    ap.add_argument("--grace", type=float, default=1.0, help="the yield grace, seconds (default 1)")
    ap.add_argument("--ttl", type=float, default=1.0, help="the holders' ttl, seconds (<= grace)")
    ap.add_argument("--floor-rounds", type=int, default=50, help="uncontended acquires timed")
    ap.add_argument("--json", default=str(HERE / "results" / "preemption.json"))
    ap.add_argument("--redis-server", default=None, help="server binary (default: redis-server)")
    a = ap.parse_args(argv)
    if a.ttl > a.grace:
        ap.error("--ttl must be at most --grace (else the deadline is the lease's expiry)")
    a.coop_rounds, a.unco_rounds, a.run_rounds = (a.rounds,) * 3 if a.rounds else (20, 5, 5)
    binary = a.redis_server or find_server_binary("redis")
    R: dict[str, Any] = {
        "gpulock": gpulock.__version__,
        "machine": machine_info(),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "grace_s": a.grace,
        "ttl_s": a.ttl,
        "cases": [],
    }
    t_start = time.monotonic()
    with RedisProcess(binary) as rp:
        R["server"] = rp.url
        name = "preempt-bench"
        with Pool.from_url(rp.url, name) as waiter:
            enable(waiter, a.grace, max(a.ttl, 60.0))
            R["floor_s"] = floor(waiter, a.floor_rounds)
            with tempfile.TemporaryDirectory() as tmp:
                for label, fn in (
                    ("cooperative", lambda: case_in_process(rp.url, name, waiter, a, True)),
                    ("uncooperative", lambda: case_in_process(rp.url, name, waiter, a, False)),
                    ("gpulock run", lambda: case_run(rp.url, name, waiter, a, Path(tmp))),
                ):
                    log(label)
                    d0, k0 = counters(waiter)
                    times = fn()
                    d1, k1 = counters(waiter)
                    R["cases"].append(
                        {"case": label, "times_s": times, "released": d1 - d0, "taken": k1 - k0}
                    )
    R["runtime_s"] = time.monotonic() - t_start
    m = R["machine"]
    print(
        f"gpulock {R['gpulock']} preemption benchmark ({R['runtime_s']:.0f} s); {m['cpu']}, "
        f"{m['cores']} cores; yield grace {a.grace:g} s, holder ttl {a.ttl:g} s"
    )
    fl = R["floor_s"]
    print(
        f"floor: uncontended acquire round trip p50 {percentile(fl, 50) * 1000:.2f} ms, "
        f"max {max(fl) * 1000:.2f} ms ({len(fl)} acquires)\n"
    )
    cols = ["case", "rounds", "p50 (ms)", "max (ms)", "bytes came back"]
    rows = [
        [
            c["case"],
            str(len(c["times_s"])),
            f"{percentile(c['times_s'], 50) * 1000:.1f}",
            f"{max(c['times_s']) * 1000:.1f}",
            f"released {c['released']}, taken at the deadline {c['taken']}",
        ]
        for c in R["cases"]
    ]
    w = [max(len(x[i]) for x in [cols, *rows]) for i in range(len(cols))]
    print("  ".join(c.ljust(w[i]) for i, c in enumerate(cols)).rstrip())
    print("  ".join("-" * w[i] for i in range(len(cols))))
    for r in rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(R, indent=1))
    print(f"\nraw numbers: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
