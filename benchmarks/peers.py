#!/usr/bin/env python
"""gpulock side by side with its peers: one private Redis, one run (issue 6 item 2).

    python benchmarks/peers.py            # full run, about 3 minutes
    python benchmarks/peers.py --quick    # smoke run, about 25 s (chains of 10 waiters only)
    python benchmarks/peers.py --only uncontended,handoff,reclaim,fairness

Subjects, all against the same Redis server (started here on a free loopback port):

* gpulock ``AsyncPool`` and ``Pool`` (sync);
* redis-semaphore ``Semaphore`` and ``MultiSemaphore`` (npm, on ioredis, run with Node from
  ``benchmarks/node``; ``npm ci`` there installs them);
* python-redis-lock's ``Lock`` and redis-py's ``Lock`` (mutexes: capacity 1);
* ``asyncio.Semaphore``: the in-process baseline, correct only inside one process.

Measured: uncontended acquire+release per second (interleaved with the single-connection
EVALSHA ceiling of the same client, as core.py does); hand-off latency in a chain of N waiters
(1, 10, 100, 1,000); client commands per grant (``INFO commandstats``) in the same chains, and
per second of waiting once the chain is stalled (one participant holds, N wait); the time to
regain a crashed holder's permits, with each one's default settings and with a 1 s expiry;
fairness under mixed sizes (weighted subjects only). ``docs/BENCHMARKS.md`` says how to read
every table; ``benchmarks/run.py`` runs this together with core.py and service.py.

Each participant of a chain queues again only after *someone else* took the lock (a 4-byte
turn marker in /dev/shm, no Redis command), so a library without a queue cannot hand the lock
straight back to the releaser: the chain measures hand-offs to waiters, not re-acquisition.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import core  # noqa: E402
from _util import (  # noqa: E402
    calls_async,
    calls_sync,
    interleave_plan,
    machine_info,
    median,
    mono,
    percentile,
    rate_async,
    rate_sync,
    summarize_interleaved,
)

import gpulock  # noqa: E402
from gpulock import AsyncPool, Pool  # noqa: E402
from gpulock.protocol.args import DEFAULT_TTL_S  # noqa: E402
from gpulock.protocol.keys import pool_keys  # noqa: E402
from gpulock.embedded import RedisProcess  # noqa: E402

CLIENT_KW = core.CLIENT_KW
NODE_DIR = HERE / "node"
PEER_WORKERS = HERE / "_peer_workers.py"

# label, runner, weighted, FIFO, correct across processes
SUBJECTS: dict[str, dict[str, Any]] = {
    "gpulock-async": {
        "label": "gpulock AsyncPool",
        "runner": "py",
        "weighted": True,
        "fifo": True,
        "xproc": True,
    },
    "gpulock-sync": {
        "label": "gpulock Pool (sync)",
        "runner": "py",
        "weighted": True,
        "fifo": True,
        "xproc": True,
    },
    "rs-sem": {
        "label": "redis-semaphore Semaphore",
        "runner": "node",
        "weighted": False,
        "fifo": False,
        "xproc": True,
    },
    "rs-multi": {
        "label": "redis-semaphore MultiSemaphore",
        "runner": "node",
        "weighted": True,
        "fifo": False,
        "xproc": True,
    },
    "redislock": {
        "label": "python-redis-lock Lock",
        "runner": "py",
        "weighted": False,
        "fifo": False,
        "xproc": True,
    },
    "redispy": {
        "label": "redis-py Lock",
        "runner": "py",
        "weighted": False,
        "fifo": False,
        "xproc": True,
    },
    "asyncio-sem": {
        "label": "asyncio.Semaphore (one process only)",
        "runner": "py",
        "weighted": False,
        "fifo": True,
        "xproc": False,
    },
}

# Settings each peer runs with in the chains: its defaults, except where a default would end the
# run (redis-semaphore gives up after acquireTimeout = 10 s).
RS_CHAIN_OPTS = {"acquireTimeout": 10**9}

# What each one does with its default settings when a holder crashes (the library's docs and
# source): seconds until the permit is free again, or None for never.
DEFAULTS = {
    "gpulock-async": ("ttl=30 s, renewed every ttl/3", DEFAULT_TTL_S),
    "gpulock-sync": ("ttl=30 s, renewed every ttl/3", DEFAULT_TTL_S),
    "rs-sem": ("lockTimeout=10 s, refreshed every 8 s", 10.0),
    "rs-multi": ("lockTimeout=10 s, refreshed every 8 s", 10.0),
    "redislock": ("expire=None: the key never expires", None),
    "redispy": ("timeout=None: the key never expires", None),
    "asyncio-sem": ("n/a: dies with its process", None),
}
# The uncontended part's subjects with kept bytes on (``keep=`` seconds; benchmarks/keep.py):
# same pair, same interleaving, not in the chains.
KEPT_LABELS = {
    "gpulock-async-keep": "gpulock AsyncPool, keep on",
    "gpulock-sync-keep": "gpulock Pool (sync), keep on",
}
KEPT_TARGET = 10.0  # kept bytes on: >= 10x the own client's EVALSHA ceiling (docs/BENCHMARKS.md)
SHORT_TTL_S = 1.0  # the short setting every one gets for the lag measurement (python-redis-lock takes whole seconds)

FULL = dict(
    max_procs=11,
    warm_s=0.4,
    windows=3,
    window_s=0.7,
    stall_settle_s=0.3,
    stall_window_s=1.2,
    chain_hold_ms=2,
    chain_n=(1, 10, 100, 1000),
    slice_s=0.25,
    rounds=4,
    rb_n1=20_000,
    rb_n50=100_000,
    reclaim_trials=8,
    reclaim_parallel=True,
    fair_s=3.0,
    fair_warm_s=0.5,
    fair_hold_ms=5,
    default_reclaim=True,
    default_reclaim_limit_s=36.0,
)
QUICK = dict(
    max_procs=4,
    warm_s=0.15,
    windows=1,
    window_s=0.4,
    stall_settle_s=0.15,
    stall_window_s=0.25,
    chain_hold_ms=2,
    chain_n=(10,),
    slice_s=0.1,
    rounds=1,
    rb_n1=3_000,
    rb_n50=10_000,
    reclaim_trials=1,
    reclaim_parallel=True,
    fair_s=0.6,
    fair_warm_s=0.15,
    fair_hold_ms=5,
    default_reclaim=False,
    default_reclaim_limit_s=0.0,
)

FAIR_CAPACITY = 8
FAIR_SIZES = [1, 1, 1, 1, 2, 2, 2, 4, 4, 4, 8, 8]  # 12 participants asking for 38 units of 8


_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"# [{time.monotonic() - _T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


# ---- environment ----------------------------------------------------------------------------------


def node_status() -> tuple[bool, str]:
    """(usable, why not) for the Node subjects."""
    node = shutil.which("node")
    if not node:
        return False, "node is not on PATH"
    if not all(
        (NODE_DIR / "node_modules" / pkg).is_dir() for pkg in ("redis-semaphore", "ioredis")
    ):
        return False, f"redis-semaphore/ioredis not installed: run `npm ci` in {NODE_DIR}"
    return True, ""


def versions() -> dict[str, Any]:
    from importlib import metadata

    out: dict[str, Any] = {"gpulock": gpulock.__version__}
    for dist in ("redis", "hiredis", "python-redis-lock", "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    node = shutil.which("node")
    out["node"] = (
        subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
        if node
        else None
    )
    for pkg in ("redis-semaphore", "ioredis"):
        pj = NODE_DIR / "node_modules" / pkg / "package.json"
        out[pkg] = json.loads(pj.read_text())["version"] if pj.exists() else None
    return out


def _lua_calls(text: str) -> set[str]:
    return {m.lower() for m in re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", text)}


def inner_commands(subject: str) -> set[str]:
    """Commands a subject's Lua scripts run inside Redis. INFO commandstats counts those as if
    clients had sent them; they are not client round trips. Parsed from each library's own
    scripts (so a command both sent by the client and run in a script, like redis-semaphore's
    ZREM, is classed by the subject that is measured: Semaphore sends ZREM itself,
    MultiSemaphore runs it in its release script)."""
    if subject.startswith("gpulock"):
        return core.script_internal_commands()
    if subject == "redislock":
        import redis_lock

        return _lua_calls(
            " ".join(str(getattr(redis_lock, n)) for n in dir(redis_lock) if n.endswith("_SCRIPT"))
        )
    if subject == "redispy":
        from redis.lock import Lock

        return _lua_calls(
            " ".join(str(getattr(Lock, n)) for n in dir(Lock) if n.startswith("LUA_"))
        )
    if subject in ("rs-sem", "rs-multi"):
        sub = "semaphore" if subject == "rs-sem" else "multiSemaphore"
        lib = NODE_DIR / "node_modules" / "redis-semaphore" / "lib" / sub
        return set().union(*(_lua_calls(p.read_text()) for p in lib.glob("*/lua.js")))
    return set()


def peer_client_kw(subject: str) -> dict[str, Any]:
    """redis-py client settings for a Python peer: redis-py's defaults, except that
    python-redis-lock gets no socket timeout. Its waiters block in BLPOP with no timeout
    (expire=None), and redis-py 8's default socket_timeout of 5 s makes such a wait fail with
    TimeoutError after 5 s (measured; see docs/BENCHMARKS.md)."""
    return {"socket_timeout": None} if subject == "redislock" else {}


def keys_of(subject: str, name: str) -> list[str]:
    if subject.startswith("gpulock"):
        return pool_keys(name)[:7]
    if subject == "redislock":
        return [f"lock:{name}", f"lock-signal:{name}"]
    if subject in ("rs-sem", "rs-multi"):
        return [f"semaphore:{name}"]  # redis-semaphore prefixes its keys
    return [name]


# ---- worker processes ------------------------------------------------------------------------------


class Proc(core.Worker):
    """core.Worker (line protocol, reader thread, py-spy dump on silence) for any command line:
    a Python worker of _peer_workers.py or a Node worker of node/bench.js."""

    def __init__(self, kind: str, args: dict, runner: str = "py"):
        import queue

        self.kind = kind
        self.errf = tempfile.TemporaryFile(mode="w+")
        if runner == "node":
            cmd = [
                shutil.which("node") or "node",
                str(NODE_DIR / "bench.js"),
                kind,
                json.dumps(args),
            ]
        else:
            cmd = [sys.executable, str(PEER_WORKERS), "worker", kind, json.dumps(args)]
        self.p = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errf,
            text=True,
            bufsize=1,
            cwd=str(NODE_DIR if runner == "node" else HERE),
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()


def _spread(total: int, nprocs: int) -> list[int]:
    return [total // nprocs + (1 if i < total % nprocs else 0) for i in range(nprocs)]


def _turn_file() -> str:
    d = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="gpulock-bench-turn-", dir=d)
    os.write(fd, (-1).to_bytes(4, "little", signed=True))
    os.close(fd)
    return path


# ---- uncontended --------------------------------------------------------------------------------------


def bench_uncontended(
    rp: RedisProcess, c: redis.Redis, cfg: dict, use_node: bool, keep_s: float = 0.0
) -> dict[str, Any]:
    """Acquire+release pairs per second on one connection, no contention, each kind interleaved
    with the single-connection EVALSHA ceiling of its own client (core.py's method), and the
    server's CPU per pair of the Python subjects (``server_cpu``: µs per pair, core.CpuSlices;
    for "C" per ``return 1``). ``keep_s`` > 0 adds gpulock's pool objects with kept bytes on
    (``keep=keep_s``; subjects ``gpulock-sync-keep``, ``gpulock-async-keep``) to the same
    interleaving."""
    import redis_lock

    url = rp.url
    out: dict[str, Any] = {"keep_s": keep_s}
    trivial = c.script_load("return 1")
    # sync redis-py: ceiling, gpulock Pool, python-redis-lock, redis-py Lock
    sc = redis.Redis.from_url(url, **CLIENT_KW)
    pool = Pool.from_url(url, "peers-unc-sync")
    pool.configure(2**40)
    rl = redis_lock.Lock(sc, "peers-unc-redislock")
    rpl = sc.lock("peers-unc-redispy")

    def rl_pair():
        rl.acquire()
        rl.release()

    def rpl_pair():
        rpl.acquire()
        rpl.release()

    fns = {
        "C": lambda: sc.evalsha(trivial, 0),
        "gpulock-sync": lambda: pool.acquire(1).release(),
        "redislock": rl_pair,
        "redispy": rpl_pair,
    }
    kpool = None
    if keep_s:
        kpool = Pool.from_url(url, "peers-unc-sync-keep", keep=keep_s)
        kpool.configure(2**40)
        fns["gpulock-sync-keep"] = lambda: kpool.acquire(1).release()
    for f in fns.values():
        rate_sync(f, 0.1)
    plan = interleave_plan([k for k in fns if k != "C"], cfg["rounds"])
    cpu = core.CpuSlices(c)
    rates = [cpu.measure(p, *calls_sync(fns[p], cfg["slice_s"])) for p in plan]
    out["sync"] = summarize_interleaved(plan, rates)
    out["sync"]["server_cpu"] = cpu.summary()
    pool.close()
    if kpool is not None:
        kpool.close()
    sc.close()

    async def async_part() -> dict[str, Any]:
        import redis.asyncio as aioredis

        ac = aioredis.from_url(url, **CLIENT_KW)
        apool = AsyncPool.from_url(url, "peers-unc-async")
        await apool.configure(2**40)

        async def apair():
            await (await apool.acquire(1)).release()

        afns = {"C": lambda: ac.evalsha(trivial, 0), "gpulock-async": apair}
        kapool = None
        if keep_s:
            kapool = AsyncPool.from_url(url, "peers-unc-async-keep", keep=keep_s)
            await kapool.configure(2**40)

            async def kpair():
                await (await kapool.acquire(1)).release()

            afns["gpulock-async-keep"] = kpair
        for f in afns.values():
            await rate_async(f, 0.1)
        aplan = interleave_plan([k for k in afns if k != "C"], cfg["rounds"])
        acpu = core.CpuSlices(c)
        arates = [acpu.measure(p, *(await calls_async(afns[p], cfg["slice_s"]))) for p in aplan]
        res = summarize_interleaved(aplan, arates)
        res["server_cpu"] = acpu.summary()
        await apool.aclose()
        if kapool is not None:
            await kapool.aclose()
        await ac.aclose()
        sem = asyncio.Semaphore(1)

        async def sem_pair():
            await sem.acquire()
            sem.release()

        res["asyncio-sem"] = {"rate": await rate_async(sem_pair, cfg["slice_s"] * 2)}
        return res

    out["async"] = asyncio.run(async_part())
    if use_node:
        w = Proc(
            "rates",
            {
                "url": url,
                "key": "peers-unc-rs",
                "rounds": cfg["rounds"],
                "slice_s": cfg["slice_s"],
                "opts": RS_CHAIN_OPTS,
            },
            runner="node",
        )
        try:
            w.recv()
            w.send("go")
            d = w.recv(timeout=120)
        finally:
            w.kill()
        out["node"] = summarize_interleaved(d["plan"], d["rates"])
    out["redis_benchmark"] = core.bench_redis_benchmark(rp, trivial, cfg)
    c.delete(
        "semaphore:peers-unc-rs:sem",
        "semaphore:peers-unc-rs:multi",
        *pool_keys("peers-unc-sync")[:7],
        *pool_keys("peers-unc-async")[:7],
        *pool_keys("peers-unc-sync-keep")[:7],
        *pool_keys("peers-unc-async-keep")[:7],
    )
    return out


def uncontended_rows(U: dict) -> list[dict[str, Any]]:
    """One row per subject: pairs/s, ratio to its own client's ceiling, to redis-py's sync one."""
    rows = []
    ceil_sync = U["sync"]["ceiling"]
    where = {
        "gpulock-sync": ("sync", "redis-py sync"),
        "redislock": ("sync", "redis-py sync"),
        "redispy": ("sync", "redis-py sync"),
        "gpulock-async": ("async", "redis-py asyncio"),
        "gpulock-sync-keep": ("sync", "redis-py sync"),
        "gpulock-async-keep": ("async", "redis-py asyncio"),
        "rs-sem": ("node", "ioredis"),
        "rs-multi": ("node", "ioredis"),
    }
    for key in (
        "gpulock-async",
        "gpulock-async-keep",
        "gpulock-sync",
        "gpulock-sync-keep",
        "rs-sem",
        "rs-multi",
        "redislock",
        "redispy",
    ):
        part, client = where[key]
        d = U.get(part, {}).get(
            key if part != "node" else {"rs-sem": "sem", "rs-multi": "multi"}[key]
        )
        if not d:
            continue
        rows.append(
            {
                "subject": key,
                "rate": d["rate"],
                "ratio": d["ratio"],
                "client": client,
                "ceiling": U[part]["ceiling"],
                "vs_sync_ceiling": d["rate"] / ceil_sync,
                "server_cpu_us": U[part].get("server_cpu", {}).get(key),
            }
        )
    sem = U.get("async", {}).get("asyncio-sem")
    if sem:
        rows.append(
            {
                "subject": "asyncio-sem",
                "rate": sem["rate"],
                "ratio": None,
                "client": "none (in-process)",
                "ceiling": None,
                "vs_sync_ceiling": sem["rate"] / ceil_sync,
            }
        )
    return rows


# ---- chains: hand-off latency, commands per grant, commands per second of waiting --------------------


def _open_window(c: redis.Redis) -> float:
    tx = c.pipeline(transaction=True)
    tx.config_resetstat()
    tx.execute()
    return mono()


def _close_window(c: redis.Redis) -> tuple[float, dict]:
    tx = c.pipeline(transaction=True)
    tx.info("commandstats")
    stats = tx.execute()[0]
    return mono(), stats


def run_chain(url: str, c: redis.Redis, subject: str, n: int, cfg: dict) -> dict[str, Any]:
    """N waiters + 1 holder on one lock of capacity 1, spread over up to max_procs processes
    (asyncio.Semaphore: one process). Windows of INFO commandstats while it runs, then a
    stalled window (one participant holds, N wait)."""
    spec = SUBJECTS[subject]
    name = f"peers-chain-{subject}-{n}"
    keys = keys_of(subject, name)
    uses_redis = subject != "asyncio-sem"
    c.delete(*keys)
    if subject.startswith("gpulock"):
        with Pool.from_url(url, name) as p:
            p.configure(1, max_waiters=max(10_000, 2 * n))
    participants = n + 1
    nprocs = 1 if not spec["xproc"] else min(participants, cfg["max_procs"])
    turn = _turn_file()
    workers: list[Proc] = []
    base = 0
    for k in _spread(participants, nprocs):
        args = {
            "url": url,
            "pool": name,
            "key": name,
            "n": k,
            "base": base,
            "subject": subject,
            "turn": turn,
            "hold_ms": cfg["chain_hold_ms"],
            "kind": "multi" if subject == "rs-multi" else "sem",
            "opts": RS_CHAIN_OPTS if spec["runner"] == "node" else {},
            "client_kw": peer_client_kw(subject),
        }
        base += k
        workers.append(Proc("chain", args, runner=spec["runner"]))
    windows: list[dict] = []
    stall: dict[str, Any] | None = None
    try:
        for w in workers:
            w.recv()
        for w in workers:
            w.send("go")
        if subject.startswith("gpulock"):
            deadline = time.monotonic() + 60
            while c.zcard(pool_keys(name)[3]) < n - 1:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"chain {subject}/{n}: queue never filled")
                time.sleep(0.02)
        time.sleep(cfg["warm_s"] + 1.5 * n / 1000)
        for _ in range(cfg["windows"]):
            if uses_redis:
                t_s = _open_window(c)
                time.sleep(cfg["window_s"])
                t_e, stats = _close_window(c)
            else:
                t_s = mono()
                time.sleep(cfg["window_s"])
                t_e, stats = mono(), None
            windows.append({"t_start": t_s, "t_end": t_e, "commandstats": stats})
        if uses_redis and n >= 2:
            for w in workers:
                w.send("stall")
            for w in workers:
                w.recv()
            time.sleep(cfg["stall_settle_s"])
            t_s = _open_window(c)
            time.sleep(cfg["stall_window_s"])
            t_e, stats = _close_window(c)
            stall = {"t_start": t_s, "t_end": t_e, "commandstats": stats}
        recs, errors, delivered = [], [], {}
        for w in workers:
            w.send("dump")
        for w in workers:
            d = w.recv(timeout=60)
            recs += d["recs"]
            errors += d["errors"]
            delivered.update({int(k): v for k, v in d.get("delivered", {}).items()})
    finally:
        for w in workers:
            w.kill()
        c.delete(*keys)
        os.unlink(turn)
    out = analyse_chain(subject, n, nprocs, recs, windows, stall, errors)
    if delivered:
        out["split"] = split_handoff(recs, windows, delivered)
    return out


def split_handoff(recs: list, windows: list, delivered: dict[int, float]) -> dict[str, Any]:
    """gpulock only: a hand-off's time in two legs, by the moment the waiter's pool listener
    handed the grant to its waiter: previous release() returning -> grant delivered in the
    waiter's process (Redis, pub/sub, waking the process, redis-py's reader), and delivered ->
    acquire() returning (gpulock's own continuation and asyncio's scheduling)."""
    done = sorted(recs, key=lambda r: r[2])
    t0, t1 = windows[0]["t_start"], windows[-1]["t_end"]
    leg1, leg2 = [], []
    for k in range(1, len(done)):
        r, p = done[k], done[k - 1]
        td = delivered.get(int(r[5]))
        if p[4] is None or td is None or not (t0 <= r[2] <= t1):
            continue
        leg1.append((td - p[4]) * 1000)
        leg2.append((r[2] - td) * 1000)
    q = lambda xs: {"p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99)}  # noqa: E731
    return {
        "n": len(leg1),
        "release_return_to_delivered_ms": q(leg1),
        "delivered_to_acquire_return_ms": q(leg2),
    }


def analyse_chain(
    subject: str, n: int, nprocs: int, recs: list, windows: list, stall: dict | None, errors: list
) -> dict[str, Any]:
    """Grants in grant-time order (mutual exclusion orders them: grant k follows the release of
    grant k-1). Hand-off latency: previous holder's release() returning -> this holder's
    acquire() returning (0 when the grant arrived first); also from the release() call."""
    inner = inner_commands(subject)
    done = sorted((r for r in recs), key=lambda r: r[2])
    all_ret, all_call, all_wait, out_w = [], [], [], []
    same_holder = early = 0
    for w in windows:
        lat_ret, lat_call, waits = [], [], []
        grants = 0
        for k in range(1, len(done)):
            r, p = done[k], done[k - 1]
            if not (w["t_start"] <= r[2] <= w["t_end"]):
                continue
            grants += 1
            waits.append((r[2] - r[1]) * 1000)
            if p[4] is None:
                continue
            if r[0] == p[0]:
                same_holder += 1
            d = r[2] - p[4]
            if d < 0:
                early += 1
            lat_ret.append(max(0.0, d) * 1000)
            lat_call.append((r[2] - p[3]) * 1000)
        secs = w["t_end"] - w["t_start"]
        row = {
            "seconds": secs,
            "grants": grants,
            "grants_per_s": grants / secs,
            "samples": len(lat_ret),
            "from_release_return_ms": {
                "p50": percentile(lat_ret, 50),
                "p99": percentile(lat_ret, 99),
                "max": max(lat_ret, default=math.nan),
            },
            "from_release_call_ms": {
                "p50": percentile(lat_call, 50),
                "p99": percentile(lat_call, 99),
            },
            "wait_ms": {
                "p50": percentile(waits, 50),
                "p99": percentile(waits, 99),
                "max": max(waits, default=math.nan),
            },
        }
        if w["commandstats"] is not None:
            client, internal, _ = core.split_commandstats(w["commandstats"], inner)
            row["client_cmds"] = client
            row["client_cmds_per_grant"] = sum(client.values()) / grants if grants else math.nan
            row["inner_cmds_per_grant"] = sum(internal.values()) / grants if grants else math.nan
        out_w.append(row)
        all_ret += lat_ret
        all_call += lat_call
        all_wait += waits
    med = lambda f: median([f(w) for w in out_w])  # noqa: E731
    res: dict[str, Any] = {
        "subject": subject,
        "waiters": n,
        "processes": nprocs,
        "errors": errors[:5],
        "windows": out_w,
        "p50_ms": med(lambda w: w["from_release_return_ms"]["p50"]),
        "p99_ms": med(lambda w: w["from_release_return_ms"]["p99"]),
        "max_ms": max(all_ret, default=math.nan),
        "call_p50_ms": med(lambda w: w["from_release_call_ms"]["p50"]),
        "call_p99_ms": med(lambda w: w["from_release_call_ms"]["p99"]),
        "wait_p50_ms": percentile(all_wait, 50),
        "wait_max_ms": max(all_wait, default=math.nan),
        "grants_per_s": med(lambda w: w["grants_per_s"]),
        "samples": len(all_ret),
        "same_holder_twice": same_holder,
        "granted_before_release_returned": early,
        "samples_ms": {"from_release_return": [round(x, 3) for x in all_ret]},
    }
    if out_w and "client_cmds_per_grant" in out_w[0]:
        res["cmds_per_grant"] = med(lambda w: w["client_cmds_per_grant"])
        res["inner_cmds_per_grant"] = med(lambda w: w["inner_cmds_per_grant"])
        mix: dict[str, int] = {}
        for w in out_w:
            for k, v in w["client_cmds"].items():
                mix[k] = mix.get(k, 0) + v
        g = sum(w["grants"] for w in out_w) or 1
        res["cmd_mix_per_grant"] = {k: v / g for k, v in sorted(mix.items())}
    if stall is not None:
        client, internal, _ = core.split_commandstats(stall["commandstats"], inner)
        secs = stall["t_end"] - stall["t_start"]
        tot = sum(client.values())
        res["stall"] = {
            "seconds": secs,
            "client_cmds": client,
            "client_cmds_per_s": tot / secs,
            "per_waiter_second": tot / secs / n,
            "inner_cmds_per_s": sum(internal.values()) / secs,
        }
    return res


# ---- crash reclaim -------------------------------------------------------------------------------------


def _expiry_local(
    c: redis.Redis, subject: str, name: str, ident: str | None, lock_timeout_ms: int
) -> float | None:
    """CLOCK_MONOTONIC time at which the dead holder's claim expires on the server."""
    if subject in ("redislock", "redispy"):
        key = f"lock:{name}" if subject == "redislock" else name
        t0 = mono()
        pttl = c.pttl(key)
        t1 = mono()
        return None if pttl is None or pttl < 0 else (t0 + t1) / 2 + pttl / 1000
    if subject.startswith("gpulock"):
        exp = c.zscore(pool_keys(name)[1], ident)  # server-clock ms; a dead process renews nothing
        return None if exp is None else (int(exp) * 1000 - core.server_clock_offset(c)) / 1_000_000
    member = ident if subject == "rs-sem" else f"{ident}_0"
    score = c.zscore(f"semaphore:{name}", member)  # Date.now() of the last acquire/refresh, ms
    if score is None:
        return None
    wall_minus_mono = time.time() - mono()
    # removed once the polling waiter's Date.now() - lockTimeout >= score
    return (score + lock_timeout_ms) / 1000 - wall_minus_mono


def reclaim_peer(
    url: str, subject: str, trials: int, ttl_s: float | None, limit_s: float, tag: str = "short"
) -> dict[str, Any]:
    """A holder process acquires and is SIGKILLed while a waiter (another process) waits.
    ``ttl_s``: the short expiry for every one (None: each library's defaults). Reports kill ->
    regained and, when the claim expires, expiry -> regained (the waiter's lag)."""
    spec = SUBJECTS[subject]
    c = redis.Redis.from_url(url, **CLIENT_KW)
    name = f"peers-reclaim-{tag}-{subject}"
    c.delete(*keys_of(subject, name))
    if spec["runner"] == "node":
        opts: dict[str, Any] = {"acquireTimeout": 10**9}
        lock_timeout_ms = 10_000
        if ttl_s is not None:
            lock_timeout_ms = int(ttl_s * 1000)
            opts["lockTimeout"] = lock_timeout_ms
        kind = "multi" if subject == "rs-multi" else "sem"
        args = {"url": url, "key": name, "kind": kind, "limit": 1, "permits": 1, "opts": opts}
    else:
        lock_timeout_ms = 0
        if subject.startswith("gpulock"):
            with Pool.from_url(url, name) as p:
                p.configure(1)
            opts = {} if ttl_s is None else {"ttl": ttl_s}
        elif subject == "redislock":
            opts = {} if ttl_s is None else {"expire": int(ttl_s)}
        else:
            opts = {} if ttl_s is None else {"timeout": ttl_s}
        args = {
            "url": url,
            "pool": name,
            "subject": subject,
            "opts": opts,
            "client_kw": peer_client_kw(subject),
        }
    waiter = Proc("waiter", args, runner=spec["runner"])
    nxt = Proc("holder", args, runner=spec["runner"])
    out_trials = []
    rng = random.Random(zlib.crc32(subject.encode()))
    try:
        waiter.recv()
        for i in range(trials):
            holder, nxt = (
                nxt,
                (Proc("holder", args, runner=spec["runner"]) if i < trials - 1 else None),
            )
            holder.recv()
            holder.send("go")
            h = holder.recv()
            if ttl_s is not None:
                # The waiter arrives at a random moment of the holder's lease, as real ones do
                # (a waiter whose own timers started with the holder's would be a best case).
                time.sleep(rng.uniform(0, ttl_s / 2))
            waiter.send("q")
            waiter.recv()  # queued (about to wait)
            time.sleep(0.05)
            holder.p.send_signal(signal.SIGKILL)
            t_kill = mono()
            holder.kill()
            t_exp = _expiry_local(c, subject, name, h.get("identifier"), lock_timeout_ms)
            try:
                g = waiter.recv(timeout=limit_s)
            except RuntimeError as e:
                t = {
                    "regained": False,
                    "waited_s": mono() - t_kill,
                    "expiry_known": t_exp is not None,
                }
                if waiter.p.poll() is not None:  # the waiter died instead of waiting on
                    t["waiter_failed"] = str(e)[-300:]
                out_trials.append(t)
                break  # the waiter is still blocked; nothing more to learn from this setting
            if "error" in g:
                raise RuntimeError(f"{subject} waiter failed: {g['error']}")
            waiter.recv()  # released
            t = {
                "regained": True,
                "kill_to_regain_ms": (g["granted"] - t_kill) * 1000,
                "held_before_kill_ms": (t_kill - h["acquired"]) * 1000,
            }
            if t_exp is not None:
                t["expiry_to_regain_ms"] = (g["granted"] - t_exp) * 1000
                t["kill_to_expiry_ms"] = (t_exp - t_kill) * 1000
            out_trials.append(t)
    finally:
        waiter.kill()
        if nxt is not None:
            nxt.kill()
        c.delete(*keys_of(subject, name))
        c.close()
    return summarize_reclaim(out_trials, ttl_s)


def summarize_reclaim(trials: list[dict], ttl_s: float | None) -> dict[str, Any]:
    ok = [t for t in trials if t.get("regained")]
    lags = [t["expiry_to_regain_ms"] for t in ok if "expiry_to_regain_ms" in t]
    k2r = [t["kill_to_regain_ms"] for t in ok]
    return {
        "ttl_s": ttl_s,
        "trials": trials,
        "n": len(ok),
        "regained_all": len(ok) == len(trials) and bool(trials),
        "lag_p50_ms": percentile(lags, 50),
        "lag_max_ms": max(lags, default=math.nan),
        "kill_to_regain_p50_ms": percentile(k2r, 50),
        "kill_to_regain_max_ms": max(k2r, default=math.nan),
        "not_regained_after_s": None if ok or not trials else trials[-1].get("waited_s"),
    }


def reclaim_gpulock(url: str, c: redis.Redis, trials: int, ttl_s: float) -> dict[str, Any]:
    """core.py's crash-reclaim harness (SIGKILLed holder process, waiting AsyncPool in another),
    re-expressed as kill -> regained and expiry -> regained on the local clock."""
    r = core.bench_reclaim(url, c, {"reclaim_ttl": ttl_s, "reclaim_trials": trials})
    ts = []
    for t in r["trials"]:
        if "lag_local_ms" not in t:
            continue
        ts.append(
            {
                "regained": True,
                "expiry_to_regain_ms": t["lag_local_ms"],
                "kill_to_expiry_ms": t["kill_before_expiry_ms"],
                "kill_to_regain_ms": t["kill_before_expiry_ms"] + t["lag_local_ms"],
                "lag_server_ms": t["lag_server_ms"],
            }
        )
    out = summarize_reclaim(ts, ttl_s)
    out["core"] = {k: r[k] for k in ("p50_ms", "max_ms", "local_p50_ms", "local_max_ms", "n")}
    return out


def bench_reclaim(
    url: str, c: redis.Redis, cfg: dict, subjects: list[str], default_url: str | None
) -> dict[str, Any]:
    """Short-expiry trials (gpulock first, alone; then the peers side by side, each on its own
    key: their lags are polling intervals, far above what running together adds) and, when
    ``default_url`` is given, one crash per subject with default settings on a second Redis
    server, in the background (so their waiters' polling stays out of this server's counters)."""
    out: dict[str, Any] = {"short": {}, "default": {}, "short_ttl_s": SHORT_TTL_S}
    bg: list[threading.Thread] = []
    results: dict[str, Any] = {}

    def run_bg(key: str, fn, *args) -> None:
        def target():
            try:
                results[key] = fn(*args)
            except Exception:
                results[key] = {"error": traceback.format_exc()}

        t = threading.Thread(target=target, daemon=True)
        t.start()
        bg.append(t)

    if default_url:
        lim = cfg["default_reclaim_limit_s"]
        for s in subjects:
            if s == "asyncio-sem" or s == "gpulock-sync":
                continue
            run_bg("default:" + s, reclaim_peer, default_url, s, 1, None, lim, "default")
    fg: list[threading.Thread] = []
    if "gpulock-async" in subjects:
        if cfg["reclaim_parallel"]:  # alongside the peers' trials (their processes mostly sleep)

            def g_target():
                try:
                    results["short:gpulock-async"] = reclaim_gpulock(
                        url,
                        redis.Redis.from_url(url, **CLIENT_KW),
                        cfg["reclaim_trials"],
                        SHORT_TTL_S,
                    )
                except Exception:
                    results["short:gpulock-async"] = {"error": traceback.format_exc()}

            t = threading.Thread(target=g_target, daemon=True)
            t.start()
            fg.append(t)
        else:  # alone
            out["short"]["gpulock-async"] = reclaim_gpulock(
                url, c, cfg["reclaim_trials"], SHORT_TTL_S
            )
    for s in subjects:
        if s.startswith("gpulock") or s == "asyncio-sem":
            continue

        def target(s=s):
            try:
                results["short:" + s] = reclaim_peer(
                    url, s, cfg["reclaim_trials"], SHORT_TTL_S, SHORT_TTL_S + 10
                )
            except Exception:
                results["short:" + s] = {"error": traceback.format_exc()}

        t = threading.Thread(target=target, daemon=True)
        t.start()
        fg.append(t)
    for t in fg:
        t.join()
    out["_background"] = bg  # joined by the caller at the end of the run
    out["_results"] = results
    return out


def finish_reclaim(rc: dict[str, Any]) -> dict[str, Any]:
    for t in rc.pop("_background", []):
        t.join()
    for k, v in rc.pop("_results", {}).items():
        part, s = k.split(":", 1)
        rc[part][s] = v
    return rc


# ---- fairness under mixed sizes --------------------------------------------------------------------------


def jain(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs or sum(x * x for x in xs) == 0:
        return math.nan
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def bench_fairness(url: str, c: redis.Redis, subject: str, cfg: dict) -> dict[str, Any]:
    """12 participants of sizes 1,1,1,1,2,2,2,4,4,4,8,8 on a weighted semaphore of 8 units, 4
    processes (sizes dealt round-robin), each holding hold_ms then queueing again at once.
    Waits = acquire call -> grant; a wait still open at the end counts with its length so far
    (a starved participant would otherwise have no sample)."""
    name = f"peers-fair-{subject}"
    keys = keys_of(subject, name)
    c.delete(*keys)
    if subject == "gpulock-async":
        with Pool.from_url(url, name) as p:
            p.configure(FAIR_CAPACITY)
    nprocs = 4
    per = [[] for _ in range(nprocs)]
    for i, s in enumerate(FAIR_SIZES):
        per[i % nprocs].append(s)
    workers, base = [], 0
    runner = "node" if subject == "rs-multi" else "py"
    for sizes in per:
        args = {
            "url": url,
            "pool": name,
            "key": name,
            "limit": FAIR_CAPACITY,
            "sizes": sizes,
            "base": base,
            "hold_ms": cfg["fair_hold_ms"],
            "opts": RS_CHAIN_OPTS,
        }
        base += len(sizes)
        workers.append(Proc("fair", args, runner=runner))
    try:
        for w in workers:
            w.recv()
        for w in workers:
            w.send("go")
        t_go = mono()
        time.sleep(cfg["fair_warm_s"] + cfg["fair_s"])
        recs, pending, errors, t_end = [], {}, [], []
        for w in workers:
            w.send("dump")
        for w in workers:
            d = w.recv(timeout=60)
            recs += d["recs"]
            pending.update(d["pending"])
            errors += d["errors"]
            t_end.append(d["t_end"])
    finally:
        for w in workers:
            w.kill()
        c.delete(*keys)
    t_from = t_go + cfg["fair_warm_s"]
    t_to = min(t_end)
    # Participant ids are dealt per process (base + index there): take each one's size from
    # its own records.
    size_of = {int(r[0]): int(r[1]) for r in recs}
    size_of.update({int(k): int(v[1]) for k, v in pending.items()})
    waits: dict[int, list[float]] = {i: [] for i in size_of}
    held = {i: 0.0 for i in size_of}
    for pi, size, t_call, tg, t_rel in recs:
        if t_call >= t_from and tg <= t_to:
            waits[pi].append((tg - t_call) * 1000)
        lo, hi = max(tg, t_from), min(t_rel, t_to)
        if hi > lo:
            held[pi] += (hi - lo) * size
    open_waits = {}
    for k, (t_call, _size) in pending.items():
        w = (t_to - max(t_call, t_from)) * 1000 if t_call < t_to else 0.0
        if t_call < t_from:
            w = (t_to - t_call) * 1000  # started before the window: its whole length so far
        open_waits[int(k)] = w
        waits[int(k)].append(w)
    mean_wait = {i: (sum(v) / len(v) if v else math.nan) for i, v in waits.items()}
    span = t_to - t_from
    by_size: dict[str, Any] = {}
    for s in sorted(set(FAIR_SIZES)):
        ids = [i for i in size_of if size_of[i] == s]
        ws = [x for i in ids for x in waits[i]]
        grants = sum(1 for r in recs if r[0] in ids and t_from <= r[3] <= t_to)
        by_size[str(s)] = {
            "participants": len(ids),
            "grants_per_s": grants / span,
            "mean_wait_ms": sum(ws) / len(ws) if ws else math.nan,
            "p99_wait_ms": percentile(ws, 99),
            "max_wait_ms": max(ws, default=math.nan),
            "share_of_capacity_time": sum(held[i] for i in ids) / (FAIR_CAPACITY * span),
            "open_waits_ms": [round(open_waits[i], 1) for i in ids if i in open_waits],
        }
    all_w = [x for v in waits.values() for x in v]
    return {
        "subject": subject,
        "capacity": FAIR_CAPACITY,
        "sizes": FAIR_SIZES,
        "hold_ms": cfg["fair_hold_ms"],
        "seconds": span,
        "errors": errors[:5],
        "grants": sum(1 for r in recs if t_from <= r[3] <= t_to),
        "jain_mean_wait": jain(list(mean_wait.values())),
        "max_wait_ms": max(all_w, default=math.nan),
        "mean_wait_by_participant_ms": {str(i): v for i, v in mean_wait.items()},
        "utilization": sum(held.values()) / (FAIR_CAPACITY * span),
        "by_size": by_size,
    }


# ---- report --------------------------------------------------------------------------------------------------


def _f(x: Any, fmt: str = "{:.3f}", na: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return na
    return fmt.format(x)


def table(head: list[str], rows: list[list[str]]) -> str:
    w = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    lines = [
        "  ".join(str(h).ljust(w[i]) for i, h in enumerate(head)).rstrip(),
        "  ".join("-" * w[i] for i in range(len(head))),
    ]
    lines += ["  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    return "\n".join(lines)


def label(s: str) -> str:
    return SUBJECTS[s]["label"] if s in SUBJECTS else KEPT_LABELS[s]


def ceiling_rows(U: dict, width: int, cpu: bool = False) -> list[list[str]]:
    """The uncontended table's ceiling rows (each client's single-connection ``EVALSHA``
    rate, then redis-benchmark's), ``width`` cells each; ``cpu``: the fourth cell is the
    ceiling's Redis CPU per call (µs), as keep.py's table shows."""
    rows = []
    for k, lab in (
        ("sync", "ceiling: EVALSHA 'return 1', 1 conn, redis-py sync"),
        ("async", "ceiling: EVALSHA 'return 1', 1 conn, redis-py asyncio"),
        ("node", "ceiling: EVALSHA 'return 1', 1 conn, ioredis (Node)"),
    ):
        if k in U:
            row = [lab, f"{U[k]['ceiling']:,.0f}/s", "100%"]
            if cpu:
                row.append(_f(U[k].get("server_cpu", {}).get("C"), "{:.1f}"))
            rows.append(row + [""] * (width - len(row)))
    rb = U.get("redis_benchmark") or {}
    for k, lab in (("c1", "1 conn"), ("c50", "50 conns")):
        if "rps" in rb.get(k, {}):
            row = [f"ceiling: redis-benchmark evalsha, {lab} (C client)", f"{rb[k]['rps']:,.0f}/s"]
            rows.append(row + [""] * (width - len(row)))
    return rows


def build_tables(R: dict) -> dict[str, str]:
    T: dict[str, str] = {}
    U = R.get("uncontended")
    if U:
        rows = ceiling_rows(U, 5)
        for r in R["uncontended_rows"]:
            s = r["subject"]
            tgt = verdict = ""
            if s.startswith("gpulock"):
                goal = KEPT_TARGET if s in KEPT_LABELS else 0.45
                tgt = f">= {goal:.0%}"
                verdict = "PASS" if r["ratio"] >= goal else f"MISS ({r['ratio'] / goal:.2f}x)"
            rows.append(
                [
                    label(s),
                    f"{r['rate']:,.0f}/s",
                    _f(r["ratio"], "{:.1%}", "n/a") + (f" of {r['client']}" if r["ratio"] else ""),
                    tgt,
                    verdict,
                ]
            )
        T["uncontended"] = table(
            ["uncontended acquire+release", "rate", "of own client's ceiling", "target", "verdict"],
            rows,
        )
    H = R.get("chains") or {}
    if H:
        ns = sorted({int(n) for d in H.values() for n in d})
        lat_n = [n for n in ns if n <= 100]
        rows = []
        for s, d in H.items():
            row = [label(s)]
            for n in lat_n:
                h = d.get(str(n))
                row.append(
                    "-"
                    if not h
                    else f"{_f(h['p50_ms'])} / {_f(h['p99_ms'])} / {_f(h['max_ms'], '{:.2f}')}"
                )
            h10 = d.get("10")
            row.append(_f(h10["wait_max_ms"], "{:,.1f}") if h10 else "-")
            rows.append(row)
        rows.append(
            ["target (gpulock)"]
            + [{1: "", 10: "p50<=0.1 p99<=0.5", 100: "p99<=1.0"}.get(n, "") for n in lat_n]
            + [""]
        )
        T["handoff"] = table(
            ["hand-off, release returns -> next holder (ms)"]
            + [f"{n} waiter{'s' if n > 1 else ''}: p50 / p99 / max" for n in lat_n]
            + ["max wait, 10 waiters (ms)"],
            rows,
        )
        cmd_n = [n for n in ns if n >= 10]
        rows = []
        for s, d in H.items():
            if s == "asyncio-sem":
                rows.append([label(s)] + ["n/a (no Redis)"] * (2 * len(cmd_n)))
                continue
            row = [label(s)]
            for n in cmd_n:
                h = d.get(str(n))
                row.append(_f(h.get("cmds_per_grant") if h else None, "{:,.2f}"))
            for n in cmd_n:
                h = d.get(str(n))
                row.append(_f((h or {}).get("stall", {}).get("per_waiter_second"), "{:,.3f}"))
            rows.append(row)
        rows.append(["target (gpulock)", "<= 4, flat +-20%"] + [""] * (2 * len(cmd_n) - 1))
        T["commands"] = table(
            ["client commands"]
            + [f"per grant, {n} w" for n in cmd_n]
            + [f"per waiter-s, {n} w" for n in cmd_n],
            rows,
        )
    RC = R.get("reclaim")
    if RC:
        rows = []
        for s in SUBJECTS:
            if s == "gpulock-sync":
                continue
            setting, _ = DEFAULTS[s]
            d = RC["default"].get(s)
            sh = RC["short"].get(s)
            if s == "asyncio-sem":
                rows.append([label(s), setting, "n/a", "n/a"])
                continue
            if d is None:
                dflt = "not run (--quick)" if not R["config"]["default_reclaim"] else "-"
                bound = DEFAULTS[s][1]
                dflt += (
                    f"; expect {'never' if bound is None else f'<= {bound:.0f} s after the crash'}"
                )
            elif "error" in d:
                dflt = "error (see JSON)"
            elif d["n"]:
                dflt = f"{d['kill_to_regain_p50_ms'] / 1000:.2f} s after the kill"
            elif d["trials"] and d["trials"][-1].get("waiter_failed"):
                dflt = f"waiter failed after {d['not_regained_after_s']:.0f} s (see JSON)"
            else:
                dflt = f"never: not regained in {d['not_regained_after_s']:.0f} s"
            if sh is None or "error" in (sh or {}):
                lag = "error (see JSON)" if sh else "-"
            else:
                lag = f"{_f(sh['lag_p50_ms'], '{:.1f}')} / {_f(sh['lag_max_ms'], '{:.1f}')}  ({sh['n']} crashes)"
                if s.startswith("gpulock") and "core" in sh:
                    # the definition in docs/BENCHMARKS.md: next grant minus the dead lease's expiry, both on
                    # the server clock (whole ms); the column above is on the waiter's clock.
                    sv = sh["core"]
                    ok = sv["p50_ms"] <= 5 and sv["max_ms"] <= 20
                    lag += (
                        f"; server clock {_f(sv['p50_ms'], '{:.1f}')} / {_f(sv['max_ms'], '{:.0f}')} "
                        f"{'PASS' if ok else 'MISS'}"
                    )
            rows.append(
                [
                    label(s) if not s.startswith("gpulock") else "gpulock (Pool, AsyncPool)",
                    setting,
                    dflt,
                    lag,
                ]
            )
        rows.append(["target (gpulock)", "", "", "server clock: p50 <= 5, max <= 20"])
        T["reclaim"] = table(
            [
                "crash reclaim",
                "default setting",
                "regained with the defaults",
                f"expiry -> regained, {RC['short_ttl_s']:.0f} s expiry: p50 / max (ms)",
            ],
            rows,
        )
    F = R.get("fairness")
    if F:
        rows = []
        for s in SUBJECTS:
            if s == "gpulock-sync":
                continue
            f = F.get(s)
            if f is None or "error" in (f or {}):
                why = (
                    "n/a (not weighted)" if not SUBJECTS[s]["weighted"] else ("error" if f else "-")
                )
                rows.append(
                    [
                        label(s),
                        "yes" if SUBJECTS[s]["weighted"] else "no",
                        "yes" if SUBJECTS[s]["fifo"] else "no",
                        why,
                        "",
                        "",
                        "",
                    ]
                )
                continue
            per = " / ".join(
                _f(f["by_size"][k]["mean_wait_ms"], "{:.0f}") for k in sorted(f["by_size"], key=int)
            )
            gps = " / ".join(
                _f(f["by_size"][k]["grants_per_s"], "{:.0f}") for k in sorted(f["by_size"], key=int)
            )
            rows.append(
                [
                    label(s),
                    "yes",
                    "yes" if SUBJECTS[s]["fifo"] else "no",
                    _f(f["jain_mean_wait"]),
                    _f(f["max_wait_ms"], "{:,.0f}"),
                    per,
                    gps,
                ]
            )
        T["fairness"] = table(
            [
                "fairness, mixed sizes",
                "weighted",
                "FIFO",
                "Jain (mean waits)",
                "max wait (ms)",
                "mean wait ms, size 1/2/4/8",
                "grants/s, size 1/2/4/8",
            ],
            rows,
        )
    return T


def print_tables(R: dict, T: dict[str, str]) -> None:
    M = R["machine"]
    V = R["versions"]
    print(
        f"gpulock {V['gpulock']} vs peers  ({'quick' if R['quick'] else 'full'} run, {R['runtime_s']:.0f} s)"
    )
    print(
        f"machine: {M['cpu']}, {M['cores']} cores; load avg {M['loadavg_start'][0]:.2f} at start, "
        f"{M['loadavg_end'][0]:.2f} at end"
    )
    print(
        f"server {R['server']['version']} ({R['server']['binary']}), loopback TCP; python {M['python']}, "
        f"redis-py {V['redis']} ({M['redis_py_parser']}), python-redis-lock {V['python-redis-lock']}, "
        f"node {V['node']}, redis-semaphore {V['redis-semaphore']}, ioredis {V['ioredis']}"
    )
    if R.get("node_skipped"):
        print(f"redis-semaphore rows skipped: {R['node_skipped']}")
    for k in ("uncontended", "handoff", "commands", "reclaim", "fairness"):
        if k in T:
            print()
            print(T[k])
    print()
    print(f"raw numbers: {R['json_path']}")


def _clean(x: Any) -> Any:
    return core._clean(x)


def run(
    rp: RedisProcess,
    cfg: dict,
    only: set[str],
    quick: bool,
    json_path: str,
    default_server: str | None,
) -> dict[str, Any]:
    """All parts against ``rp``; returns the result dict (also written to ``json_path``)."""
    t0 = time.monotonic()
    use_node, why = node_status()
    subjects = [s for s in SUBJECTS if use_node or SUBJECTS[s]["runner"] != "node"]
    R: dict[str, Any] = {
        "quick": quick,
        "config": cfg,
        "machine": machine_info(),
        "versions": versions(),
        "subjects": {s: SUBJECTS[s] for s in subjects},
        "errors": {},
        "node_skipped": None if use_node else why,
        "defaults": {s: {"setting": v[0], "free_after_s": v[1]} for s, v in DEFAULTS.items()},
    }
    c = redis.Redis.from_url(rp.url, **CLIENT_KW)
    srv = c.info("server")
    R["server"] = {"version": srv.get("redis_version"), "binary": rp.binary}
    if not use_node:
        log(f"redis-semaphore rows skipped: {why}")

    def part(key: str, lab: str, fn, *a, **kw):
        log(lab)
        try:
            R[key] = fn(*a, **kw)
        except Exception:
            R["errors"][key] = traceback.format_exc()
            log(f"FAILED: {lab}\n{R['errors'][key]}")

    dflt_proc = None
    if "reclaim" in only and cfg["default_reclaim"] and default_server:
        dflt_proc = RedisProcess(default_server).start()
    try:
        if "reclaim" in only:  # first: its default-settings crashes run in the background meanwhile
            part(
                "reclaim",
                "crash reclaim (short expiry here; defaults on a second server, in the background)",
                bench_reclaim,
                rp.url,
                c,
                cfg,
                subjects,
                dflt_proc.url if dflt_proc else None,
            )
        if "uncontended" in only:
            part(
                "uncontended",
                "uncontended acquire+release",
                bench_uncontended,
                rp,
                c,
                cfg,
                use_node,
            )
            if "uncontended" in R:
                R["uncontended_rows"] = uncontended_rows(R["uncontended"])
        if "handoff" in only:
            R["chains"] = {}
            for s in subjects:
                R["chains"][s] = {}
                for n in cfg["chain_n"]:
                    if s == "asyncio-sem" and n > 100:
                        continue
                    log(f"chain {s}, {n} waiters")
                    try:
                        R["chains"][s][str(n)] = run_chain(rp.url, c, s, n, cfg)
                    except Exception:
                        R["errors"][f"chain:{s}:{n}"] = traceback.format_exc()
                        log(f"FAILED: chain {s}/{n}\n{R['errors'][f'chain:{s}:{n}']}")
        if "fairness" in only:
            R["fairness"] = {}
            for s in ("gpulock-async", "rs-multi"):
                if s not in subjects:
                    continue
                log(f"fairness, mixed sizes: {s}")
                try:
                    R["fairness"][s] = bench_fairness(rp.url, c, s, cfg)
                except Exception:
                    R["errors"][f"fairness:{s}"] = traceback.format_exc()
                    log(f"FAILED: fairness {s}\n{R['errors'][f'fairness:{s}']}")
        if "reclaim" in R:
            log("waiting for the default-settings crash trials")
            R["reclaim"] = finish_reclaim(R["reclaim"])
            for k, v in list(R["reclaim"]["default"].items()) + list(R["reclaim"]["short"].items()):
                if isinstance(v, dict) and "error" in v:
                    R["errors"][f"reclaim:{k}"] = v["error"]
    finally:
        if dflt_proc is not None:
            dflt_proc.close()
        c.close()
    R["machine"]["loadavg_end"] = list(os.getloadavg())
    R["runtime_s"] = time.monotonic() - t0
    R["json_path"] = json_path
    R["tables"] = build_tables(R)
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(
        json.dumps(_clean(R), separators=(",", ":"), default=str, allow_nan=False) + "\n"
    )
    return R


def pick_server(explicit: str | None = None) -> str:
    """The newest redis-server among PATH and the usual places (a venv may put an older one
    first on PATH), else the embedded Valkey."""
    if explicit:
        return explicit
    from gpulock.embedded import find_server_binary

    cands = {
        p
        for p in (
            shutil.which("redis-server"),
            "/usr/bin/redis-server",
            "/usr/local/bin/redis-server",
        )
        if p and os.access(p, os.X_OK)
    }
    best, best_v = None, ()
    for p in cands:
        try:
            v = subprocess.run([p, "--version"], capture_output=True, text=True, timeout=10).stdout
            m = re.search(r"v=(\d+)\.(\d+)\.(\d+)", v)
            ver = tuple(int(x) for x in m.groups()) if m else (0,)
        except Exception:
            continue
        if ver > best_v:
            best, best_v = p, ver
    return best or find_server_binary("any")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short smoke run")
    ap.add_argument("--json", default=str(HERE / "results" / "peers.json"))
    ap.add_argument("--redis-server", default=None)
    ap.add_argument("--only", default="", help="comma list: uncontended,handoff,reclaim,fairness")
    a = ap.parse_args(argv)
    cfg = QUICK if a.quick else FULL
    only = set(filter(None, a.only.split(","))) or {"uncontended", "handoff", "reclaim", "fairness"}
    binary = pick_server(a.redis_server)
    with RedisProcess(binary) as rp:
        rp.binary = binary
        R = run(rp, cfg, only, a.quick, a.json, binary)
    print_tables(R, R["tables"])
    if R["errors"]:
        print(f"FAILED parts (tracebacks on stderr and in the JSON): {', '.join(R['errors'])}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
