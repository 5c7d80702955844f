"""Helpers for ``benchmarks/core.py``: statistics, machine facts, rate loops, and the worker
processes the benchmark spawns (run as ``python benchmarks/_util.py worker KIND ARGS_JSON``).

Every timestamp that crosses a process boundary is ``time.monotonic()``, which CPython takes
from ``clock_gettime(CLOCK_MONOTONIC)`` on Linux: one clock for the whole machine, so a time
taken in one process can be subtracted from a time taken in another.

Worker protocol (line-oriented, stdin/stdout, JSON payloads): the harness writes commands, the
worker answers one line per command. Workers print nothing else on stdout; logs go to stderr.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import signal
import statistics
import sys
import threading
import time
from typing import Any, Callable

mono = time.monotonic  # CLOCK_MONOTONIC on Linux: comparable across processes


# ---- statistics ----------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of an unsorted list; nan when empty."""
    if not xs:
        return math.nan
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: list[float]) -> float:
    xs = [x for x in xs if not (isinstance(x, float) and math.isnan(x))]
    return statistics.median(xs) if xs else math.nan


# ---- machine ---------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import redis

        redis_py = redis.__version__
    except Exception:  # pragma: no cover
        redis_py = "?"
    try:
        import hiredis  # noqa: F401

        parser = "hiredis"
    except ImportError:
        parser = "pure-Python (no hiredis)"
    try:
        load = os.getloadavg()
    except OSError:
        load = (math.nan,) * 3
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "python_impl": platform.python_implementation(),
        "redis_py": redis_py,
        "redis_py_parser": parser,
        "loadavg_start": list(load),
    }


# ---- rate loops ------------------------------------------------------------------------------


def calls_sync(fn: Callable[[], Any], seconds: float, batch: int = 20) -> tuple[int, float]:
    """Call ``fn`` back to back for about ``seconds``: (calls made, seconds taken)."""
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        for _ in range(batch):
            fn()
        n += batch
        now = time.perf_counter()
        if now >= end:
            return n, now - t0


async def calls_async(fn: Callable[[], Any], seconds: float, batch: int = 20) -> tuple[int, float]:
    n = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    while True:
        for _ in range(batch):
            await fn()
        n += batch
        now = time.perf_counter()
        if now >= end:
            return n, now - t0


def rate_sync(fn: Callable[[], Any], seconds: float, batch: int = 20) -> float:
    """Calls per second of ``fn`` over about ``seconds``."""
    n, dt = calls_sync(fn, seconds, batch)
    return n / dt


async def rate_async(fn: Callable[[], Any], seconds: float, batch: int = 20) -> float:
    n, dt = await calls_async(fn, seconds, batch)
    return n / dt


def interleave_plan(subjects: list[str], rounds: int) -> list[str]:
    """C S1 C S2 C ... C: every subject slice sits between two ceiling slices, so its ratio to
    the ceiling is taken against the machine as it was at that moment (other jobs share the
    cores; a ratio of neighbours is far steadier than a ratio of separate medians)."""
    plan = ["C"]
    for _ in range(rounds):
        for s in subjects:
            plan += [s, "C"]
    return plan


def summarize_interleaved(plan: list[str], rates: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {"ceiling_slices": [r for p, r in zip(plan, rates) if p == "C"]}
    for i, (p, r) in enumerate(zip(plan, rates)):
        if p == "C":
            continue
        d = out.setdefault(p, {"slices": [], "ratios": []})
        d["slices"].append(r)
        d["ratios"].append(r / ((rates[i - 1] + rates[i + 1]) / 2))
    out["ceiling"] = median(out["ceiling_slices"])
    for p in set(plan) - {"C"}:
        out[p]["rate"] = median(out[p]["slices"])
        out[p]["ratio"] = median(out[p]["ratios"])
    return out


# ---- worker processes --------------------------------------------------------------------------


def _emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this worker when the harness dies, so none outlives a crashed
    or interrupted run (Linux PR_SET_PDEATHSIG; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    except Exception:
        pass


async def _chain_async(a: dict) -> None:
    """N participants in this process's event loop, one AsyncPool: each acquires (queueing
    behind the others), notes the time its acquire returned, releases at once, notes the
    times around release, and queues again. With capacity == amount the pool is a FIFO chain
    of hand-offs; the fencing token orders them (grant T follows release of T-1)."""
    from gpulock import AsyncPool

    pool = AsyncPool.from_url(a["url"], a["pool"])
    recs: list[tuple] = []
    loop = asyncio.get_running_loop()

    async def participant() -> None:
        while True:
            lease = await pool.acquire(a["amount"], ttl=a["ttl"])
            tg = mono()
            tok = lease.token
            t0 = mono()
            await lease.release()
            tr = mono()
            recs.append((tok, tg, t0, tr))

    _emit({"ready": os.getpid()})
    line = await loop.run_in_executor(None, sys.stdin.readline)
    assert line.strip() == "go", line
    tasks = [loop.create_task(participant()) for _ in range(a["n"])]
    line = await loop.run_in_executor(None, sys.stdin.readline)  # "dump" (or EOF)
    errs = [repr(t.exception()) for t in tasks if t.done() and not t.cancelled() and t.exception()]
    _emit({"recs": recs, "errors": errs[:5]})
    os._exit(0)


def _chain_sync(a: dict) -> None:
    """The blocking twin of :func:`_chain_async`: participants are threads sharing one Pool."""
    from gpulock import Pool

    pool = Pool.from_url(a["url"], a["pool"])
    recs: list[tuple] = []
    errs: list[str] = []

    def participant() -> None:
        try:
            while True:
                lease = pool.acquire(a["amount"], ttl=a["ttl"])
                tg = mono()
                tok = lease.token
                t0 = mono()
                lease.release()
                tr = mono()
                recs.append((tok, tg, t0, tr))
        except Exception as e:  # pragma: no cover - reported to the harness
            errs.append(repr(e))

    _emit({"ready": os.getpid()})
    assert sys.stdin.readline().strip() == "go"
    for _ in range(a["n"]):
        threading.Thread(target=participant, daemon=True).start()
    sys.stdin.readline()
    _emit({"recs": list(recs), "errors": errs[:5]})
    os._exit(0)


def _chain_redislock(a: dict) -> None:
    """Peer calibration: the same chain with python-redis-lock (a mutex; waiters block in
    BLPOP on a signal list that release pushes to), one participant thread per lock object."""
    import redis
    import redis_lock

    conn = redis.Redis.from_url(a["url"], **a.get("client_kw", {}))
    recs: list[tuple] = []
    errs: list[str] = []

    def participant() -> None:
        lock = redis_lock.Lock(conn, a["pool"], expire=30)
        try:
            while True:
                lock.acquire(blocking=True)
                tg = mono()
                t0 = mono()
                lock.release()
                tr = mono()
                recs.append((0, tg, t0, tr))
        except Exception as e:  # pragma: no cover
            errs.append(repr(e))

    _emit({"ready": os.getpid()})
    assert sys.stdin.readline().strip() == "go"
    for _ in range(a["n"]):
        threading.Thread(target=participant, daemon=True).start()
    sys.stdin.readline()
    _emit({"recs": list(recs), "errors": errs[:5]})
    os._exit(0)


async def _subscriber(a: dict) -> None:
    """Pub/sub floor: a redis.asyncio subscriber reading the way gpulock's listener does
    (``get_message`` in a loop); notes when each message (a sequence number) arrived."""
    import redis.asyncio as aioredis

    c = aioredis.from_url(a["url"], **a.get("client_kw", {}))
    ps = c.pubsub(ignore_subscribe_messages=True)
    await ps.subscribe(a["channel"])
    loop = asyncio.get_running_loop()
    got: dict[str, float] = {}
    stop = loop.run_in_executor(None, sys.stdin.readline)
    _emit({"ready": os.getpid()})
    while not stop.done():
        msg = await ps.get_message(timeout=0.2)
        if msg is not None and msg["type"] == "message":
            got[msg["data"].decode()] = mono()
    _emit({"got": got})
    os._exit(0)


def _holder(a: dict) -> None:
    """Crash-reclaim holder: on "go", acquire (granted at once: the pool is free), report the
    lease, then keep heartbeating until the harness SIGKILLs this process."""
    from gpulock import Pool

    pool = Pool.from_url(a["url"], a["pool"])
    pool.status()  # connect and load scripts before "go", so the trial starts warm
    _emit({"ready": os.getpid()})
    if sys.stdin.readline().strip() != "go":
        os._exit(0)
    lease = pool.acquire(a["amount"], ttl=a["ttl"], timeout=5)
    _emit(
        {"lease_id": lease.id, "token": lease.token, "expires_ms": round(lease.expires_at * 1000)}
    )
    while True:
        time.sleep(3600)


async def _reclaim_waiter(a: dict) -> None:
    """Crash-reclaim waiter: on "q", queue for the pool (behind the holder), say "queued";
    when granted, report the grant (server expiry, ttl, local monotonic time the acquire
    returned), release, and say "released"."""
    from gpulock import AsyncPool

    pool = AsyncPool.from_url(a["url"], a["pool"])
    loop = asyncio.get_running_loop()
    await pool.status()
    _emit({"ready": os.getpid()})
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if line.strip() != "q":
            os._exit(0)
        queued = loop.create_future()

        def on_queued(pos: int) -> None:
            if not queued.done():
                queued.set_result(pos)

        task = loop.create_task(
            pool.acquire(a["amount"], ttl=a["ttl"], timeout=30, on_queued=on_queued)
        )
        await asyncio.wait({task, queued}, return_when=asyncio.FIRST_COMPLETED)
        # Always one "queued" line: position, or null when granted without queueing (the
        # holder's lease was already gone: the harness discards that trial).
        _emit({"queued": queued.result() if queued.done() else None})
        try:
            lease = await task
        except Exception as e:
            _emit({"error": repr(e)})
            continue
        t_local = mono()
        _emit(
            {
                "granted": True,
                "t_local": t_local,
                "expires_ms": round(lease.expires_at * 1000),
                "ttl_ms": round(lease.ttl * 1000),
                "token": lease.token,
            }
        )
        await lease.release()
        _emit({"released": True})


def worker_main(kind: str, args_json: str) -> None:
    _die_with_parent()
    a = json.loads(args_json)
    if kind == "chain-async":
        asyncio.run(_chain_async(a))
    elif kind == "chain-sync":
        _chain_sync(a)
    elif kind == "chain-redislock":
        _chain_redislock(a)
    elif kind == "subscriber":
        asyncio.run(_subscriber(a))
    elif kind == "holder":
        _holder(a)
    elif kind == "reclaim-waiter":
        asyncio.run(_reclaim_waiter(a))
    else:
        raise SystemExit(f"unknown worker kind {kind!r}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "worker":
        worker_main(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit("usage: _util.py worker KIND ARGS_JSON (spawned by benchmarks/core.py)")
