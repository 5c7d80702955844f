#!/usr/bin/env python
"""gpulock core benchmark: one run, one private Redis, one table (issue 2 item 6).

    python benchmarks/core.py                # full run, about 1.5-2 minutes
    python benchmarks/core.py --quick        # smoke run for CI, about 30 s
    python benchmarks/core.py --json out.json --redis-server /usr/bin/redis-server

It starts its own ``redis-server`` on a free loopback port (never a shared one) and measures,
against that one server:

1. the ceiling: single-connection EVALSHA round trips/s of ``return 1`` with redis-py, sync
   and asyncio, plus ``redis-benchmark`` (C client, 1 and 50 connections) when on PATH;
2. uncontended acquire+release pairs/s of ``Pool`` and ``AsyncPool``, as a ratio to the
   ceiling of the same client kind. Ceiling and subject run in alternating slices and each
   subject slice is divided by its two neighbouring ceiling slices, so load from other jobs
   on the machine cancels out; the ratio reported is the median of those per-slice ratios.
   Two rungs below the pool show where the time goes: the same two scripts called on a bare
   client, and scripts that do no work but take the same arguments and give same-shaped
   replies;
3. hand-off latency in a FIFO chain of N waiters spread over separate processes (capacity
   1, amount 1: every grant is one hand-off; every holder releases at once and queues again,
   so the queue stays at N). The next grant's token is the previous one + 1, which pairs each
   grant with the release that caused it. Reported: from ``release()`` returning to the next
   waiter's ``acquire()`` returning (the definition in docs/BENCHMARKS.md; 0 when the grant arrived first),
   and from the moment ``release()`` was called;
4. client commands per grant in the same chains, from ``INFO commandstats`` over windows
   opened by ``CONFIG RESETSTAT``;
5. crash-reclaim lag: a holder process is SIGKILLed while another process waits; lag = the
   waiter's grant time (server clock) minus the dead lease's server expiry;
6. Redis memory per lease and per waiter (``used_memory`` delta over 10,000 of each).

Calibration rows, same run: the pub/sub floor (a script that only PUBLISHes, heard by a
redis.asyncio subscriber in another process), the 10-waiter chain with every participant in
one process, and python-redis-lock (the closest peer) through the same harness.
benchmarks/README.md says how to read each row.

Speed targets live here, never in tests. Exit status is 0 unless the run failed (or, with
``--strict``, a target was missed).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

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
from gpulock.protocol.request import AcquireOptions, AcquireRequest  # noqa: E402
from gpulock.protocol.keys import pool_keys  # noqa: E402
from gpulock.transport.scripts import scripts  # noqa: E402
from gpulock.embedded import RedisProcess, find_server_binary  # noqa: E402

try:  # the client settings Pool.from_url uses, so the ceiling client is the same kind
    from gpulock._async import _CLIENT_DEFAULTS as CLIENT_KW
except ImportError:  # pragma: no cover
    CLIENT_KW = {"socket_timeout": 5.0, "socket_connect_timeout": 2.0, "health_check_interval": 10}

TARGETS = {
    "pair_ratio": 0.45,  # uncontended pairs/s ÷ single-connection EVALSHA rt/s
    "handoff_p50_ms": 0.1,  # 10 waiters
    "handoff_p99_ms_10": 0.5,
    "handoff_p99_ms_100": 1.0,
    "cmds_per_grant": 4.0,
    "cmds_flat": 0.20,  # ±20 % around the 10-waiter value, 10 → 1,000 waiters
    "reclaim_p50_ms": 5.0,
    "reclaim_max_ms": 20.0,
    "bytes_per_item": 1024,
    "cpu_pair_us_1": 50.0,  # server CPU per uncontended acquire+release, one connection
    "cpu_pair_us_many": 30.0,  # the same with many clients at once
}

FULL = dict(
    slice_s=0.25,
    rounds=7,
    handoff_n=(10, 100, 1000),
    sync_handoff_n=(10,),
    windows=5,
    window_s=1.0,
    warm_s=0.5,
    max_procs=11,
    reclaim_trials=20,
    reclaim_ttl=0.5,
    rb_n50=200_000,
    rb_n1=30_000,
    script_pairs=2000,
    mem_items=10_000,
    floor_msgs=2000,
)
QUICK = dict(
    slice_s=0.12,
    rounds=2,
    handoff_n=(10, 100, 1000),
    sync_handoff_n=(10,),
    windows=2,
    window_s=0.4,
    warm_s=0.2,
    max_procs=6,
    reclaim_trials=5,
    reclaim_ttl=0.2,
    rb_n50=30_000,
    rb_n1=10_000,
    script_pairs=300,
    mem_items=10_000,
    floor_msgs=300,
)

HARNESS_CMDS = {"multi", "exec", "config|resetstat", "info"}


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def script_internal_commands() -> set[str]:
    """Commands the gpulock scripts call with redis.call (lower case). INFO commandstats
    counts those too (as if sent by a client); they are not client round trips."""
    names: set[str] = set()
    for sc in scripts().values():
        names |= {m.lower() for m in re.findall(r"redis\.p?call\(\s*['\"](\w+)['\"]", sc.source)}
    return names


# Commands python-redis-lock's Lua scripts run (its client sends SET NX, BLPOP, EVALSHA).
REDISLOCK_INNER = {"get", "del", "lpush", "pexpire", "ttl", "expire", "keys"}


def split_commandstats(
    stats: dict[str, dict], inner: set[str] | None = None
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(client commands, commands run inside scripts, harness commands) -> calls."""
    inner = script_internal_commands() if inner is None else inner
    client, internal, harness = {}, {}, {}
    for key, v in stats.items():
        name = key[len("cmdstat_") :] if key.startswith("cmdstat_") else key
        calls = int(v["calls"])
        if name in HARNESS_CMDS:
            harness[name] = calls
        elif name.split("|")[0] in inner:
            internal[name] = calls
        else:
            client[name] = calls
    return client, internal, harness


# ---- 1 + 2: ceiling and uncontended pairs -------------------------------------------------------


def _acquire_argv(
    pool: str,
    ttl: float = 30.0,
    waiter_ttl: float = 5.0,
    mode: str = "wait",
    channel: str = "bench",
) -> list[str]:
    req = AcquireRequest.build(
        pool, 1, AcquireOptions(ttl=ttl), waiter_ttl=waiter_ttl, default_ttl=ttl
    )
    return req.argv(mode, channel)  # channel: where a later hand-off grant would be published


_FAKE_ACQ = (
    "return {1, ARGV[2], 1700000000000001, 1700000030000, 1, "
    "1700000000000, 1700000000000000, 1099511627776, 1}"
)
_FAKE_REL = "return {1, 1700000000000, 0, 0}"


def _load_dummy_scripts(c: redis.Redis) -> tuple[str, str, str]:
    trivial = c.script_load("return 1")
    # Same arguments in, same reply shapes out as acquire (granted) and release; no work.
    fake_acq = c.script_load(_FAKE_ACQ)
    fake_rel = c.script_load(_FAKE_REL)
    return trivial, fake_acq, fake_rel


def _dummy_operations(c: redis.Redis, uses_functions: bool) -> dict[str, Any]:
    """Do-nothing stand-ins of acquire and release (same keys and arguments in, same reply
    shapes out) in the form the pool uses: ``{"acquire": Script, "release": Script}`` with
    functions ``bench_noop_acquire``/``_release`` loaded when ``uses_functions``."""
    from gpulock.transport.scripts import Script

    if uses_functions:
        c.function_load(
            "#!lua name=bench_noop\n"
            f"redis.register_function('bench_noop_acquire', function(KEYS, ARGV) {_FAKE_ACQ} end)\n"
            f"redis.register_function('bench_noop_release', function(KEYS, ARGV) {_FAKE_REL} end)\n",
            replace=True,
        )
    out = {}
    for op, src in (("acquire", _FAKE_ACQ), ("release", _FAKE_REL)):
        sha = c.script_load(src)
        out[op] = Script(op, src, sha, f"bench_noop_{op}")
    return out


def server_cpu_s(c: redis.Redis) -> float:
    """The server process's CPU time so far (user + system, seconds; INFO cpu)."""
    i = c.info("cpu")
    return float(i["used_cpu_user"]) + float(i["used_cpu_sys"])


class CpuSlices:
    """Server CPU per call of each subject of an interleaved run: INFO cpu (on its own
    connection) read around every slice, summed per subject, divided by the calls made (one
    call = one acquire+release pair for the pair subjects, one ``return 1`` for "C"). The
    two INFO calls per slice are outside the slice's calls but inside its CPU window: about
    0.1 % of a slice's server CPU."""

    def __init__(self, c: redis.Redis):
        self.c = c
        self.acc: dict[str, list[float]] = {}
        self.last = server_cpu_s(c)

    def measure(self, subject: str, calls: int, seconds: float) -> float:
        now = server_cpu_s(self.c)
        a = self.acc.setdefault(subject, [0.0, 0])
        a[0] += now - self.last
        a[1] += calls
        self.last = server_cpu_s(self.c)
        return calls / seconds

    def summary(self) -> dict[str, float]:
        """Server CPU µs per call, by subject."""
        return {k: 1e6 * cpu / n for k, (cpu, n) in self.acc.items() if n}


async def pairs_many_async(url: str, pool: AsyncPool, cpu: CpuSlices, cfg: dict) -> dict:
    """Many clients at once: 16 tasks of one AsyncPool doing acquire(1)+release back to back
    (redis-py opens one connection per call in flight, up to the pool's cap; calls beyond it
    go out as pipelines), in ``rounds`` windows of 2 slices. Pairs/s and server CPU per pair."""
    tasks_n = 16
    pairs = 0
    secs = 0.0
    cpu_s = 0.0

    async def worker(end: float) -> int:
        n = 0
        while time.perf_counter() < end:
            await (await pool.acquire(1)).release()
            n += 1
        return n

    for _ in range(cfg["rounds"]):
        c0 = server_cpu_s(cpu.c)
        t0 = time.perf_counter()
        end = t0 + 2 * cfg["slice_s"]
        done = await asyncio.gather(*(worker(end) for _ in range(tasks_n)))
        secs += time.perf_counter() - t0
        cpu_s += server_cpu_s(cpu.c) - c0
        pairs += sum(done)
    return {
        "tasks": tasks_n,
        "pairs": pairs,
        "rate": pairs / secs,
        "cpu_us_per_pair": 1e6 * cpu_s / pairs,
        "server_cpu_share": cpu_s / secs,
    }


def bench_pairs_sync(url: str, cfg: dict) -> dict[str, Any]:
    from gpulock.transport.lane import encode, sync_lane
    from gpulock.transport.script_calls import SyncScripts

    c = redis.Redis.from_url(url, **CLIENT_KW)
    trivial, _, _ = _load_dummy_scripts(c)
    name = "bench-pairs-sync"
    keys = pool_keys(name)
    pool = Pool.from_url(url, name, capacity=2**40)
    pool.configure(2**40)
    # The rungs below the pool call what it calls, as it calls it (its client's dialect:
    # FCALL of the library, or EVALSHA), on its own client's lane, without its Python.
    bare = SyncScripts(pool.redis, keys)
    noop = _dummy_operations(c, bare.heads.dialect.functions)
    lane = sync_lane(pool.redis)
    trivial_packed = encode(("EVALSHA", trivial, 0))

    def ceiling():
        c.evalsha(trivial, 0)

    def lane_ceiling():
        lane.execute(trivial_packed)

    def pool_pair():
        pool.acquire(1).release()

    def raw_pair():
        r = bare.call("acquire", _acquire_argv(name))
        bare.call("release", [r[1], r[2]])

    def io_pair():
        r = lane.execute(bare.heads.packed(noop["acquire"], _acquire_argv(name)))
        lane.execute(bare.heads.packed(noop["release"], [r[1], str(r[2])]))

    fns = {
        "C": ceiling,
        "pool": pool_pair,
        "raw_scripts": raw_pair,
        "io_only": io_pair,
        "lane_C": lane_ceiling,
    }
    try:  # the closest peer (38-40 % of the ceiling), measured the same way
        import redis_lock

        peer_lock = redis_lock.Lock(c, "bench-pairs-peer", expire=30)

        def peer_pair():
            peer_lock.acquire()
            peer_lock.release()

        fns["peer_redislock"] = peer_pair
    except ImportError:
        pass
    for f in fns.values():  # warm up: connections, subscription, script cache, imports
        rate_sync(f, 0.1)
    plan = interleave_plan([k for k in fns if k != "C"], cfg["rounds"])
    cpu = CpuSlices(c)
    rates = [cpu.measure(p, *calls_sync(fns[p], cfg["slice_s"])) for p in plan]
    out = summarize_interleaved(plan, rates)
    out["server_cpu"] = cpu.summary()
    out["form"] = "function" if bare.heads.dialect.functions else "script"
    out["lua"] = lua_time_per_op(c, name, cfg["script_pairs"])
    pool.close()
    c.close()
    return out


def loaded_scripts(c: redis.Redis) -> dict:
    """gpulock's scripts, loaded into the server (for raw EVALSHA calls)."""
    sc = scripts()
    for s in sc.values():
        c.script_load(s.source)
    return sc


def lua_time_per_op(c: redis.Redis, name: str, n: int) -> dict[str, Any]:
    """Server-side time per acquire and release call: the Lua work, without network or
    client, in the form a pool on ``c`` uses (a function where the server has them). Taken
    from SLOWLOG with a 0 µs threshold (every command logged with its duration in µs) over
    ``n`` uncontended acquire+release pairs on a fresh pool, plus ``n`` calls of ``return 1``;
    and from INFO commandstats (:func:`commandstats_us_per_call`)."""
    from gpulock.transport.script_calls import SyncScripts

    keys = pool_keys(name + "-lua")
    ops = SyncScripts(c, keys)
    ops.call("configure", [str(2**40), "100000", "set"])  # loads the library, or the scripts
    loaded_scripts(c)
    sc = scripts()
    trivial = c.script_load("return 1")
    form = "function" if ops.heads.dialect.functions else "script"
    ident = {op: (sc[op].function if form == "function" else sc[op].sha) for op in sc}

    def work():
        for _ in range(n):
            r = ops.call("acquire", _acquire_argv(name + "-lua"))
            ops.call("release", [r[1], r[2]])
            c.evalsha(trivial, 0)

    by = evalsha_durations(c, work, 60 * n)
    mean = lambda xs: sum(xs) / len(xs) if xs else math.nan  # noqa: E731
    cs = commandstats_us_per_call(c, ops, name + "-lua", n, trivial)
    out: dict[str, Any] = {
        "form": form,
        "acquire_us": mean(by.get(ident["acquire"], [])),
        "release_us": mean(by.get(ident["release"], [])),
        "trivial_us": mean(by.get(trivial, [])),
        "acquire_p50_us": median(by.get(ident["acquire"], [])),
        "release_p50_us": median(by.get(ident["release"], [])),
        "samples": {k: len(v) for k, v in by.items()},
        "commandstats": cs,
    }
    # Commands each operation runs inside Redis (one uncontended pair).
    c.config_resetstat()
    r = ops.call("acquire", _acquire_argv(name + "-lua"))
    _, inner_a, _ = split_commandstats(c.info("commandstats"))
    c.config_resetstat()
    ops.call("release", [r[1], r[2]])
    _, inner_r, _ = split_commandstats(c.info("commandstats"))
    out["acquire_inner_calls"] = sum(inner_a.values())
    out["release_inner_calls"] = sum(inner_r.values())
    out["acquire_inner"] = inner_a
    out["release_inner"] = inner_r
    c.delete(*keys[:7])
    return out


def _us_per_call(c: redis.Redis) -> float:
    """``usec_per_call`` of the script commands (FCALL and EVALSHA) since CONFIG RESETSTAT."""
    st = c.info("commandstats")
    calls = usec = 0
    for k in ("cmdstat_fcall", "cmdstat_evalsha"):
        calls += int(st.get(k, {}).get("calls", 0))
        usec += int(st.get(k, {}).get("usec", 0))
    return usec / calls if calls else math.nan


def commandstats_us_per_call(
    c: redis.Redis, ops: Any, name: str, n: int, trivial: str
) -> dict[str, float]:
    """Server time per call from INFO commandstats (``usec_per_call`` of FCALL/EVALSHA after
    ``CONFIG RESETSTAT``): ``n`` acquires, then their ``n`` releases, then ``n`` calls of
    ``return 1``, each counted on its own (``ops``: the pool's calling path,
    :class:`gpulock.transport.script_calls.SyncScripts`). Unlike SLOWLOG with a 0 µs threshold
    (which also logs, and so slows, every command a script runs on Redis 7.0), nothing is
    logged."""
    out: dict[str, float] = {}
    c.config_resetstat()
    grants = [ops.call("acquire", _acquire_argv(name)) for _ in range(n)]
    out["acquire_us"] = _us_per_call(c)
    c.config_resetstat()
    for r in grants:
        ops.call("release", [r[1], r[2]])
    out["release_us"] = _us_per_call(c)
    c.config_resetstat()
    for _ in range(n):
        c.evalsha(trivial, 0)
    out["trivial_us"] = _us_per_call(c)
    return out


def evalsha_durations(c: redis.Redis, work, max_len: int) -> dict[str, list[int]]:
    """Run ``work()`` with SLOWLOG logging every command (threshold 0 µs) and return the
    durations (µs, server side) of top-level EVALSHA and FCALL calls, by script SHA or
    function name. Redis 7.0 also logs the commands scripts run, hence the generous
    ``max_len``."""
    old = c.config_get("slowlog-*")
    c.config_set("slowlog-max-len", max_len)
    c.config_set("slowlog-log-slower-than", 0)
    c.slowlog_reset()
    try:
        work()
        entries = c.slowlog_get(max_len)
    finally:
        for k, v in old.items():
            c.config_set(k, v)
        c.slowlog_reset()
    by: dict[str, list[int]] = {}
    for e in entries:
        cmd = e["command"]
        cmd = cmd.decode(errors="replace") if isinstance(cmd, bytes) else str(cmd)
        parts = cmd.split(" ")
        if parts[0].lower() in ("evalsha", "fcall") and len(parts) > 1:
            by.setdefault(parts[1], []).append(int(e["duration"]))
    return by


def lua_by_script(by: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    names = {s.sha: n for n, s in scripts().items()}
    names.update({s.function: n for n, s in scripts().items()})
    scripts.cache_clear()  # workers read lua/ when they started: name their SHAs too
    names.update({s.sha: n for n, s in scripts().items()})
    names.update({s.function: n for n, s in scripts().items()})
    return {
        names.get(sha, sha[:8]): {"calls": len(v), "mean_us": sum(v) / len(v), "p50_us": median(v)}
        for sha, v in by.items()
        if v
    }


async def bench_pairs_async(url: str, cfg: dict) -> dict[str, Any]:
    from gpulock.transport.lane import async_lane, encode
    from gpulock.transport.script_calls import AsyncScripts

    c = aioredis.from_url(url, **CLIENT_KW)
    trivial = await c.script_load("return 1")
    name = "bench-pairs-async"
    keys = pool_keys(name)
    pool = AsyncPool.from_url(url, name, capacity=2**40)
    await pool.configure(2**40)
    bare = AsyncScripts(pool.redis, keys)  # the pool's calling path, without its Python
    sc_sync = redis.Redis.from_url(url, **CLIENT_KW)
    noop = _dummy_operations(sc_sync, bare.heads.dialect.functions)
    sc_sync.close()
    lane = async_lane(pool.redis)
    assert lane is not None
    trivial_packed = encode(("EVALSHA", trivial, 0))

    async def ceiling():
        await c.evalsha(trivial, 0)

    async def lane_ceiling():
        await lane.execute(trivial_packed)

    async def pool_pair():
        await (await pool.acquire(1)).release()

    async def raw_pair():
        r = await bare.call("acquire", _acquire_argv(name))
        await bare.call("release", [r[1], r[2]])

    async def io_pair():
        r = await lane.execute(bare.heads.packed(noop["acquire"], _acquire_argv(name)))
        await lane.execute(bare.heads.packed(noop["release"], [r[1], str(r[2])]))

    fns = {
        "C": ceiling,
        "pool": pool_pair,
        "raw_scripts": raw_pair,
        "io_only": io_pair,
        "lane_C": lane_ceiling,
    }
    for f in fns.values():
        await rate_async(f, 0.1)
    plan = interleave_plan(["pool", "raw_scripts", "io_only", "lane_C"], cfg["rounds"])
    cpu = CpuSlices(redis.Redis.from_url(url, **CLIENT_KW))
    rates = [cpu.measure(p, *(await calls_async(fns[p], cfg["slice_s"]))) for p in plan]
    out = summarize_interleaved(plan, rates)
    out["server_cpu"] = cpu.summary()
    out["form"] = "function" if bare.heads.dialect.functions else "script"
    out["many"] = await pairs_many_async(url, pool, cpu, cfg)
    cpu.c.close()
    await pool.aclose()
    await c.aclose()
    return out


def bench_redis_benchmark(rp: RedisProcess, sha: str, cfg: dict) -> dict[str, Any] | None:
    exe = shutil.which("redis-benchmark")
    if not exe:
        return None
    out = {}
    for conns, n in ((1, cfg["rb_n1"]), (50, cfg["rb_n50"])):
        cmd = [
            exe,
            "-h",
            rp.host,
            "-p",
            str(rp.port),
            "-c",
            str(conns),
            "-n",
            str(n),
            "-P",
            "1",
            "--csv",
            "evalsha",
            sha,
            "0",
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        rows = list(csv.DictReader(io.StringIO(p.stdout)))
        if p.returncode != 0 or not rows:
            out[f"c{conns}"] = {"error": (p.stderr or p.stdout)[-300:]}
            continue
        row = rows[-1]
        out[f"c{conns}"] = {
            "rps": float(row["rps"]),
            "p50_ms": float(row["p50_latency_ms"]),
            "p99_ms": float(row["p99_latency_ms"]),
            "requests": n,
            "command": " ".join(cmd[:1] + ["-h", rp.host, "-p", "PORT"] + cmd[5:]),
        }
    return out


# ---- 3 + 4: hand-off chain --------------------------------------------------------------------


class Worker:
    """A benchmark worker process (benchmarks/_util.py), line protocol over stdin/stdout.
    A reader thread moves its stdout lines into a queue, so ``recv`` can wait with a timeout
    (select() on the pipe would miss lines already read ahead into Python's buffer)."""

    def __init__(self, kind: str, args: dict):
        import queue
        import threading

        self.kind = kind
        self.errf = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen(
            [sys.executable, str(HERE / "_util.py"), "worker", kind, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errf,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:
            self.lines.put(line)
        self.lines.put("")  # EOF

    def send(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def recv(self, timeout: float = 60.0) -> dict:
        import queue

        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        if not line:
            self.errf.seek(0)
            raise RuntimeError(
                f"worker {self.kind} gave no answer within {timeout:.0f} s "
                f"(exit {self.p.poll()}); stderr: {self.errf.read()[-2000:]}{self._stacks()}"
            )
        return json.loads(line)

    def _stacks(self) -> str:
        """Where a silent worker is stuck (py-spy, when installed): for the error message."""
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if self.p.poll() is not None or not os.path.exists(spy):
            return ""
        try:
            d = subprocess.run(
                [spy, "dump", "--pid", str(self.p.pid)], capture_output=True, text=True, timeout=20
            )
            return "\nstacks (py-spy dump):\n" + (d.stdout or d.stderr)[-4000:]
        except Exception as e:  # pragma: no cover - diagnostics only
            return f"\n(py-spy dump failed: {e})"

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
        self.errf.close()


def run_chain(
    url: str, c: redis.Redis, mode: str, n_waiters: int, cfg: dict, max_procs: int | None = None
) -> dict[str, Any]:
    """A FIFO chain of ``n_waiters`` + 1 participants over up to ``max_procs`` processes.
    mode: "async" (AsyncPool tasks), "sync" (Pool threads) or "redislock" (python-redis-lock,
    the closest peer, as a calibration of this harness and machine)."""
    name = f"bench-chain-{mode}-{n_waiters}-{max_procs or cfg['max_procs']}"
    keys = pool_keys(name)
    peer = mode == "redislock"
    cleanup = [f"lock:{name}", f"lock-signal:{name}"] if peer else keys[:7]
    c.delete(*cleanup)
    if not peer:
        with Pool.from_url(url, name) as p:
            p.configure(1, max_waiters=max(10_000, 2 * n_waiters))
    participants = n_waiters + 1
    nprocs = min(participants, max_procs or cfg["max_procs"])
    share = [
        participants // nprocs + (1 if i < participants % nprocs else 0) for i in range(nprocs)
    ]
    workers = [
        Worker(
            f"chain-{mode}",
            {"url": url, "pool": name, "n": k, "amount": 1, "ttl": 30.0, "client_kw": CLIENT_KW},
        )
        for k in share
    ]
    try:
        for w in workers:
            w.recv()
        for w in workers:
            w.send("go")
        deadline = time.monotonic() + 60
        while not peer and c.zcard(keys[3]) < n_waiters - 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"chain {mode}/{n_waiters}: queue never filled")
            time.sleep(0.02)
        time.sleep(cfg["warm_s"] + (0.5 if peer else 0))
        windows = []
        for _ in range(cfg["windows"]):
            tx = c.pipeline(transaction=True)
            tx.hget(keys[0], "grants")
            tx.config_resetstat()
            g0 = int(tx.execute()[0] or 0)
            t_s = mono()
            time.sleep(cfg["window_s"])
            tx = c.pipeline(transaction=True)
            tx.info("commandstats")
            tx.hget(keys[0], "grants")
            stats, g1 = tx.execute()
            t_e = mono()
            grants = int(g1) - g0 if not peer else None
            windows.append(
                {
                    "t_start": t_s,
                    "t_end": t_e,
                    "grants": grants,
                    "commandstats": stats,
                    "queue_len_after": None if peer else c.zcard(keys[3]),
                }
            )
        # One more, short window with SLOWLOG on: Lua time per script in this chain (not in
        # the windows above: logging every command slows the server a little).
        t_sl = mono()
        by = evalsha_durations(c, lambda: time.sleep(min(0.5, cfg["window_s"])), 400_000)
        lua_scripts = lua_by_script(by)
        sl_s = mono() - t_sl
        recs, errors = [], []
        for w in workers:
            w.send("dump")
        for w in workers:
            d = w.recv()
            recs += d["recs"]
            errors += d["errors"]
    finally:
        for w in workers:
            w.kill()
        c.delete(*cleanup)
    out = analyse_chain(mode, n_waiters, nprocs, recs, windows, errors)
    out["lua_by_script"] = lua_scripts
    out["lua_window_s"] = sl_s
    return out


def analyse_chain(
    mode: str, n: int, nprocs: int, recs: list, windows: list, errors: list
) -> dict[str, Any]:
    peer = mode == "redislock"
    if peer:
        # A mutex has no fencing token: order grants by time. Mutual exclusion makes grant k
        # follow the release of grant k-1.
        recs = [(i, *r[1:]) for i, r in enumerate(sorted(recs, key=lambda r: r[1]))]
        for w in windows:
            w["grants"] = sum(1 for r in recs if w["t_start"] <= r[1] <= w["t_end"])
    by_token = {r[0]: r for r in recs}
    out_windows = []
    all_ret, all_full, all_neg = [], [], 0
    for w in windows:
        lat_ret, lat_full, neg = [], [], 0
        for tok, tg, _t0, _tr in recs:
            if not (w["t_start"] <= tg <= w["t_end"]):
                continue
            prev = by_token.get(tok - 1)
            if prev is None:
                continue
            d_ret = tg - prev[3]
            if d_ret < 0:
                neg += 1
            lat_ret.append(max(0.0, d_ret) * 1000)
            lat_full.append((tg - prev[2]) * 1000)
        client, internal, _ = split_commandstats(
            w["commandstats"], REDISLOCK_INNER if peer else None
        )
        g = max(1, w["grants"])
        ev = w["commandstats"].get("cmdstat_evalsha", {"usec": 0})
        out_windows.append(
            {
                "grants": w["grants"],
                "seconds": w["t_end"] - w["t_start"],
                "handoffs_per_s": w["grants"] / (w["t_end"] - w["t_start"]),
                "samples": len(lat_ret),
                "granted_before_release_returned": neg,
                "from_release_return_ms": {
                    "p50": percentile(lat_ret, 50),
                    "p99": percentile(lat_ret, 99),
                    "max": max(lat_ret, default=math.nan),
                },
                "from_release_call_ms": {
                    "p50": percentile(lat_full, 50),
                    "p99": percentile(lat_full, 99),
                    "max": max(lat_full, default=math.nan),
                },
                "client_cmds": client,
                "client_cmds_per_grant": sum(client.values()) / g,
                "script_inner_cmds_per_grant": sum(internal.values()) / g,
                "lua_us_per_grant": ev["usec"] / g,
                "queue_len_after": w["queue_len_after"],
            }
        )
        all_ret += lat_ret
        all_full += lat_full
        all_neg += neg
    med = lambda path: median([_get(w, path) for w in out_windows])  # noqa: E731
    return {
        "mode": mode,
        "waiters": n,
        "processes": nprocs,
        "errors": errors[:5],
        "windows": out_windows,
        "p50_ms": med("from_release_return_ms.p50"),
        "p99_ms": med("from_release_return_ms.p99"),
        "max_ms": max(all_ret, default=math.nan),
        "full_p50_ms": med("from_release_call_ms.p50"),
        "full_p99_ms": med("from_release_call_ms.p99"),
        "full_max_ms": max(all_full, default=math.nan),
        "pooled": {
            "from_release_return_ms": {
                "p50": percentile(all_ret, 50),
                "p99": percentile(all_ret, 99),
            },
            "from_release_call_ms": {
                "p50": percentile(all_full, 50),
                "p99": percentile(all_full, 99),
            },
        },
        "samples": len(all_ret),
        "granted_before_release_returned": all_neg,
        "cmds_per_grant": med("client_cmds_per_grant"),
        "inner_cmds_per_grant": med("script_inner_cmds_per_grant"),
        "lua_us_per_grant": med("lua_us_per_grant"),
        "handoffs_per_s": med("handoffs_per_s"),
        "samples_ms": {
            "from_release_return": [round(x, 3) for x in all_ret],
            "from_release_call": [round(x, 3) for x in all_full],
        },
    }


def _get(d: dict, path: str) -> Any:
    for k in path.split("."):
        d = d[k]
    return d


def bench_pubsub_floor(url: str, c: redis.Redis, cfg: dict) -> dict[str, Any]:
    """The floor under any hand-off by pub/sub with redis-py on this machine: this process
    calls EVALSHA of a script that only PUBLISHes a sequence number; a redis.asyncio
    subscriber in another process notes when it arrives. One message per ~1 ms (no queueing)."""
    ch = "bench-floor"
    sha = c.script_load("redis.call('PUBLISH', KEYS[1], ARGV[1]) return 1")
    w = Worker("subscriber", {"url": url, "channel": ch, "client_kw": CLIENT_KW})
    sent: dict[str, tuple[float, float]] = {}
    try:
        w.recv()
        time.sleep(0.2)
        for i in range(cfg["floor_msgs"]):
            t0 = mono()
            c.evalsha(sha, 1, ch, str(i))
            sent[str(i)] = (t0, mono())
            time.sleep(0.001)
        time.sleep(0.2)
        w.send("stop")
        got = w.recv()["got"]
    finally:
        w.kill()
    from_call = [(got[k] - t0) * 1000 for k, (t0, _) in sent.items() if k in got]
    from_ret = [max(0.0, got[k] - tr) * 1000 for k, (_, tr) in sent.items() if k in got]
    call_ms = [(tr - t0) * 1000 for t0, tr in sent.values()]
    return {
        "messages": len(sent),
        "received": len(from_call),
        "from_call_ms": {"p50": percentile(from_call, 50), "p99": percentile(from_call, 99)},
        "from_return_ms": {"p50": percentile(from_ret, 50), "p99": percentile(from_ret, 99)},
        "evalsha_call_ms": {"p50": percentile(call_ms, 50), "p99": percentile(call_ms, 99)},
    }


# ---- 5: crash reclaim ---------------------------------------------------------------------------


def server_clock_offset(c: redis.Redis, samples: int = 15) -> float:
    """Server clock (µs, TIME) minus local CLOCK_MONOTONIC (µs), from the sample with the
    shortest round trip (its midpoint is closest to when TIME ran)."""
    best = None
    for _ in range(samples):
        a = mono()
        s, us = c.time()
        b = mono()
        if best is None or b - a < best[0]:
            best = (b - a, (s * 1_000_000 + us) - (a + b) / 2 * 1_000_000)
    return best[1]


def bench_reclaim(url: str, c: redis.Redis, cfg: dict) -> dict[str, Any]:
    name = "bench-reclaim"
    keys = pool_keys(name)
    with Pool.from_url(url, name) as p:
        p.configure(1)
    args = {"url": url, "pool": name, "amount": 1, "ttl": cfg["reclaim_ttl"]}
    waiter = Worker("reclaim-waiter", {**args, "ttl": 30.0})
    nxt = Worker("holder", args)
    trials = []
    try:
        waiter.recv()
        for _ in range(cfg["reclaim_trials"]):
            holder, nxt = nxt, Worker("holder", args)  # next holder warms up during this trial
            holder.recv()
            holder.send("go")
            lease = holder.recv()
            waiter.send("q")
            q = waiter.recv()
            holder.p.send_signal(signal.SIGKILL)
            t_kill = mono()
            holder.kill()
            exp = c.zscore(keys[1], lease["lease_id"])  # final: a dead process renews nothing
            offset = server_clock_offset(c)
            g = waiter.recv(timeout=cfg["reclaim_ttl"] + 10)
            if "error" in g:
                raise RuntimeError(f"reclaim waiter failed: {g['error']}")
            waiter.recv()  # released
            if exp is None or q.get("queued") is None:
                trials.append(
                    {
                        "skipped": "the holder's lease was gone before the kill or before "
                        "the waiter queued (machine too slow?)",
                        **lease,
                    }
                )
                continue
            exp_ms = int(exp)
            grant_ms = g["expires_ms"] - g["ttl_ms"]
            exp_local = (exp_ms * 1000 - offset) / 1_000_000
            trials.append(
                {
                    "token_dead": lease["token"],
                    "token_next": g["token"],
                    "queued_position": q.get("queued"),
                    "dead_expiry_ms": exp_ms,
                    "grant_server_ms": grant_ms,
                    "lag_server_ms": grant_ms - exp_ms,
                    "lag_local_ms": (g["t_local"] - exp_local) * 1000,
                    "kill_before_expiry_ms": (exp_local - t_kill) * 1000,
                    "renewed_before_kill": exp_ms != lease["expires_ms"],
                }
            )
    finally:
        nxt.kill()
        waiter.kill()
        c.delete(*keys[:7])
    good = [t for t in trials if "lag_server_ms" in t]
    ls = [t["lag_server_ms"] for t in good]
    ll = [t["lag_local_ms"] for t in good]
    return {
        "ttl_s": cfg["reclaim_ttl"],
        "trials": trials,
        "n": len(good),
        "p50_ms": percentile(ls, 50),
        "max_ms": max(ls, default=math.nan),
        "local_p50_ms": percentile(ll, 50),
        "local_max_ms": max(ll, default=math.nan),
    }


# ---- 6: memory -----------------------------------------------------------------------------------


def bench_memory(c: redis.Redis, n: int) -> dict[str, Any]:
    sc = loaded_scripts(c)
    out: dict[str, Any] = {"items": n}

    def used() -> dict[str, int]:
        c.ping()
        m = c.info("memory")
        return {"used_memory": m["used_memory"], "used_memory_dataset": m["used_memory_dataset"]}

    def run(keys: list[str], argvs: list[list[str]], expect: int) -> None:
        for i in range(0, len(argvs), 1000):
            pipe = c.pipeline(transaction=False)
            for a in argvs[i : i + 1000]:
                pipe.evalsha(sc["acquire"].sha, len(keys), *keys, *a)
            for r in pipe.execute():
                assert int(r[0]) == expect, r

    # Leases: n grants on a pool big enough for all; default holder metadata (host, pid).
    lk = pool_keys("bench-mem-leases")
    c.evalsha(sc["configure"].sha, 8, *lk, str(2**40), "100000", "set")
    argvs = [_acquire_argv("bench-mem-leases", ttl=3600) for _ in range(n)]
    out["meta_bytes"] = len(argvs[0][6])
    before = used()
    run(lk, argvs, 1)
    after = used()
    out["lease"] = {k: (after[k] - before[k]) / n for k in before}
    out["lease_keys"] = {
        k.rsplit(":", 1)[1]: c.memory_usage(k, samples=0) for k in lk[1:3] + lk[6:7]
    }

    # Waiters: one lease fills the pool, then n requests queue behind it.
    wk = pool_keys("bench-mem-waiters")
    c.evalsha(sc["configure"].sha, 8, *wk, "1", str(2 * n + 10), "set")
    run(wk, [_acquire_argv("bench-mem-waiters", ttl=3600)], 1)
    argvs = [_acquire_argv("bench-mem-waiters", ttl=3600, waiter_ttl=3600) for _ in range(n)]
    before = used()
    run(wk, argvs, 0)
    after = used()
    out["waiter"] = {k: (after[k] - before[k]) / n for k in before}
    out["waiter_keys"] = {k.rsplit(":", 1)[1]: c.memory_usage(k, samples=0) for k in wk[3:6]}
    c.delete(*lk[:7], *wk[:7])
    return out


# ---- report -------------------------------------------------------------------------------------


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}/s"


def verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "MISS")


def build_rows(R: dict) -> list[tuple[str, str, str, str]]:
    T = TARGETS
    rows: list[tuple[str, str, str, str]] = []
    ps, pa = R.get("pairs_sync"), R.get("pairs_async")
    if ps:
        rows.append(
            (
                "ceiling: EVALSHA 'return 1', 1 conn, redis-py sync",
                fmt_rate(ps["ceiling"]),
                "",
                "(ceiling)",
            )
        )
    if pa:
        rows.append(
            (
                "ceiling: EVALSHA 'return 1', 1 conn, redis-py asyncio",
                fmt_rate(pa["ceiling"]),
                "",
                "(ceiling)",
            )
        )
    rb = R.get("redis_benchmark") or {}
    for k, label in (("c1", "1 conn"), ("c50", "50 conns")):
        if "rps" in rb.get(k, {}):
            rows.append(
                (
                    f"ceiling: redis-benchmark evalsha, {label} (C client)",
                    fmt_rate(rb[k]["rps"]),
                    "",
                    "(info)",
                )
            )
    for kind, d, ceil in (("sync Pool", ps, "sync"), ("AsyncPool", pa, "async")):
        if not d:
            continue
        ratio = d["pool"]["ratio"]
        rows.append(
            (
                f"uncontended acquire+release, {kind}",
                f"{fmt_rate(d['pool']['rate'])} = {ratio:.1%} of {ceil} ceiling",
                f">= {T['pair_ratio']:.0%}",
                f"{verdict(ratio >= T['pair_ratio'])} ({ratio / T['pair_ratio']:.2f}x)",
            )
        )
        form = d.get("form", "script")
        rows.append(
            (
                f"  same pair, gpulock {form}s on the pool's lane, no pool Python ({ceil})",
                f"{d['raw_scripts']['ratio']:.1%} of ceiling",
                "",
                "(where the time goes)",
            )
        )
        rows.append(
            (
                f"  same I/O, {form}s that do nothing ({ceil})",
                f"{d['io_only']['ratio']:.1%} of ceiling",
                "",
                "(where the time goes)",
            )
        )
        if "lane_C" in d:
            lc = d["lane_C"]
            rows.append(
                (
                    f"  'return 1' on the pool's lane ({ceil}); pair as a share of it",
                    f"{fmt_rate(lc['rate'])} = {lc['ratio']:.0%} of ceiling; pair "
                    f"{d['pool']['rate'] / lc['rate']:.1%}",
                    "",
                    "(info: the client's own floor)",
                )
            )
        if "peer_redislock" in d:
            rows.append(
                (
                    "  python-redis-lock acquire+release (sync)",
                    f"{fmt_rate(d['peer_redislock']['rate'])} = {d['peer_redislock']['ratio']:.1%} of ceiling",
                    "",
                    "(peer, same run)",
                )
            )
    for kind, d in (("sync", ps), ("async", pa)):
        sc = (d or {}).get("server_cpu")
        if sc and "pool" in sc:
            rows.append(
                (
                    f"  server CPU per pair, 1 conn ({kind}): pool / bare / no-op / 'return 1' (per call)",
                    f"{sc['pool']:.1f} / {sc.get('raw_scripts', math.nan):.1f} / "
                    f"{sc.get('io_only', math.nan):.1f} / {sc.get('C', math.nan):.1f} us (INFO cpu)",
                    f"<= {T['cpu_pair_us_1']:.0f} us",
                    verdict(sc["pool"] <= T["cpu_pair_us_1"]),
                )
            )
    many = (pa or {}).get("many")
    if many:
        rows.append(
            (
                f"  server CPU per pair, many clients ({many['tasks']} AsyncPool tasks)",
                f"{many['cpu_us_per_pair']:.1f} us (INFO cpu); {fmt_rate(many['rate'])} pairs, "
                f"server {many['server_cpu_share']:.0%} busy",
                f"<= {T['cpu_pair_us_many']:.0f} us",
                verdict(many["cpu_us_per_pair"] <= T["cpu_pair_us_many"]),
            )
        )
    if ps:
        lua = ps["lua"]
        rows.append(
            (
                f"  Lua time per call, uncontended ({lua.get('form', 'script')}s): acquire / release / 'return 1'",
                f"{lua['acquire_us']:.1f} / {lua['release_us']:.1f} / {lua['trivial_us']:.1f} us (SLOWLOG)",
                "",
                "(info)",
            )
        )
        cs = lua.get("commandstats")
        if cs:
            rows.append(
                (
                    "  same, INFO commandstats usec_per_call",
                    f"{cs['acquire_us']:.1f} / {cs['release_us']:.1f} / {cs['trivial_us']:.1f} us",
                    "",
                    "(info)",
                )
            )
    fl = R.get("pubsub_floor")
    if fl:
        rows.append(
            (
                "floor: EVALSHA->PUBLISH->redis.asyncio subscriber, 2 procs",
                f"p50 {fl['from_return_ms']['p50']:.3f}  p99 {fl['from_return_ms']['p99']:.3f} ms from return; "
                f"p50 {fl['from_call_ms']['p50']:.3f} from call",
                "",
                "(floor)",
            )
        )
    for key, label in (
        ("handoff_async", "async"),
        ("handoff_async_1proc", "async"),
        ("handoff_sync", "sync"),
        ("handoff_peer", "python-redis-lock"),
    ):
        for n, h in sorted((R.get(key) or {}).items(), key=lambda kv: int(kv[0])):
            n = int(n)
            p99_t = (
                T["handoff_p99_ms_10"]
                if n <= 10
                else (T["handoff_p99_ms_100"] if n <= 100 else None)
            )
            p50_t = T["handoff_p50_ms"] if n <= 10 else None
            info = key in ("handoff_peer", "handoff_async_1proc")
            if info:
                p99_t = p50_t = None
            tgt = []
            ok = True
            if p50_t is not None:
                tgt.append(f"p50<={p50_t}")
                ok &= h["p50_ms"] <= p50_t
            if p99_t is not None:
                tgt.append(f"p99<={p99_t}")
                ok &= h["p99_ms"] <= p99_t
            procs = (
                f"{h['processes']} procs" if h["processes"] > 1 else "1 proc, no other subscribers"
            )
            rows.append(
                (
                    f"hand-off {n} waiters, {label} ({procs}), release returns -> held",
                    f"p50 {h['p50_ms']:.3f}  p99 {h['p99_ms']:.3f}  max {h['max_ms']:.2f} ms",
                    " ".join(tgt) + (" ms" if tgt else ""),
                    verdict(ok if tgt else None)
                    if not info
                    else ("(peer, same run)" if key == "handoff_peer" else "(info)"),
                )
            )
            rows.append(
                (
                    "  same, from release() call -> held",
                    f"p50 {h['full_p50_ms']:.3f}  p99 {h['full_p99_ms']:.3f}  max {h['full_max_ms']:.2f} ms",
                    "",
                    f"({h['samples']} hand-offs, {h['handoffs_per_s']:,.0f}/s)",
                )
            )
    ha = R.get("handoff_async") or {}
    if ha:
        lbs = ha[min(ha, key=int)].get("lua_by_script", {})
        if "release" in lbs and "acquire" in lbs:
            rows.append(
                (
                    f"  Lua time per call in the {min(ha, key=int)}-waiter chain: release+grant / acquire (queue)",
                    f"{lbs['release']['p50_us']:.0f} / {lbs['acquire']['p50_us']:.0f} us p50 (SLOWLOG)",
                    "",
                    "(info)",
                )
            )
        cpg = {int(n): h["cmds_per_grant"] for n, h in ha.items()}
        ns = sorted(cpg)
        base = cpg[ns[0]]
        spread = max(abs(v / base - 1) for v in cpg.values()) if base else math.inf
        ok = max(cpg.values()) <= T["cmds_per_grant"] and spread <= T["cmds_flat"]
        rows.append(
            (
                f"client commands per grant, {' / '.join(map(str, ns))} waiters",
                " / ".join(f"{cpg[n]:.2f}" for n in ns) + f"  (spread {spread:+.0%})",
                f"<= {T['cmds_per_grant']:.0f}, flat +-{T['cmds_flat']:.0%}",
                verdict(ok),
            )
        )
        for n, h in (R.get("handoff_sync") or {}).items():
            rows.append(
                (
                    f"  client commands per grant, sync, {n} waiters",
                    f"{h['cmds_per_grant']:.2f}",
                    "",
                    "(info)",
                )
            )
        for n, h in (R.get("handoff_peer") or {}).items():
            rows.append(
                (
                    f"  client commands per grant, python-redis-lock, {n} waiters",
                    f"{h['cmds_per_grant']:.2f}",
                    "",
                    "(peer, same run)",
                )
            )
        inner = {int(n): h["inner_cmds_per_grant"] for n, h in ha.items()}
        rows.append(
            (
                "  commands run inside scripts per grant",
                " / ".join(f"{inner[n]:.1f}" for n in ns),
                "",
                "(info)",
            )
        )
    rc = R.get("reclaim")
    if rc:
        ok = rc["p50_ms"] <= T["reclaim_p50_ms"] and rc["max_ms"] <= T["reclaim_max_ms"]
        rows.append(
            (
                f"crash reclaim lag after server expiry ({rc['n']} kills, ttl {rc['ttl_s']} s)",
                f"p50 {rc['p50_ms']:.1f}  max {rc['max_ms']:.1f} ms (server clock, 1 ms steps)",
                f"p50<={T['reclaim_p50_ms']:.0f} max<={T['reclaim_max_ms']:.0f} ms",
                verdict(ok),
            )
        )
        rows.append(
            (
                "  same, to the waiter's acquire returning (local clock)",
                f"p50 {rc['local_p50_ms']:.2f}  max {rc['local_max_ms']:.2f} ms",
                "",
                "(info)",
            )
        )
    m = R.get("memory")
    if m:
        for k in ("lease", "waiter"):
            v = m[k]["used_memory"]
            rows.append(
                (
                    f"Redis memory per {k} (used_memory / {m['items']:,}, {m['meta_bytes']} B metadata)",
                    f"{v:,.0f} B",
                    "<= 1 KiB",
                    verdict(v <= T["bytes_per_item"]),
                )
            )
    return rows


def print_report(R: dict, rows: list) -> None:
    M = R["machine"]
    print(
        f"gpulock {R['gpulock']} core benchmark  ({'quick' if R['quick'] else 'full'} run, "
        f"{R['runtime_s']:.0f} s)"
    )
    print(
        f"machine: {M['cpu']}, {M['cores']} cores; load avg {M['loadavg_start'][0]:.2f} at start, "
        f"{M['loadavg_end'][0]:.2f} at end"
    )
    print(
        f"python {M['python']}, redis-py {M['redis_py']} ({M['redis_py_parser']} parser), "
        f"server {R['server']['version']} ({R['server']['binary']}), loopback TCP"
    )
    print()
    w = [
        max(len(r[i]) for r in rows + [("metric", "value", "target", "verdict")]) for i in range(4)
    ]
    head = ("metric", "value", "target", "verdict")
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(head)).rstrip())
    print("  ".join("-" * w[i] for i in range(4)))
    for r in rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip())
    print()
    ha = R.get("handoff_async") or {}
    if ha:
        big = ha[max(ha, key=int)]
        mix = {}
        for win in big["windows"]:
            for k, v in win["client_cmds"].items():
                mix[k] = mix.get(k, 0) + v
        g = sum(win["grants"] for win in big["windows"]) or 1
        print(
            "Commands per grant count every top-level command clients sent during the window "
            "(INFO commandstats after CONFIG RESETSTAT), excluding the commands the gpulock "
            "scripts run inside Redis (" + ", ".join(sorted(script_internal_commands())) + ", "
            "which commandstats also counts) and the harness's own MULTI/EXEC/CONFIG/INFO. "
            f"At {big['waiters']} waiters: "
            + ", ".join(f"{k} {v / g:.3f}" for k, v in sorted(mix.items()))
            + "."
        )
        print(
            "Hand-off: N waiters + 1 holder in a FIFO chain (capacity 1) across separate processes; "
            "latency from the previous holder's release() return (0 when the grant arrived first) "
            "to the next waiter's acquire() return, CLOCK_MONOTONIC; p50/p99 are medians over "
            f"{len(big['windows'])} windows, max over all."
        )
    print(f"raw numbers: {R['json_path']}")


def _clean(x: Any) -> Any:
    """NaN/inf (a part with no samples) become null, so the file is standard JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="short smoke run (CI): fewer, shorter repeats"
    )
    ap.add_argument(
        "--json", default=str(HERE / "results" / "core.json"), help="where to write raw numbers"
    )
    ap.add_argument(
        "--redis-server", default=None, help="server binary (default: redis-server on PATH)"
    )
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    ap.add_argument(
        "--only", default="", help="comma list of parts to run: pairs,rb,handoff,reclaim,memory"
    )
    a = ap.parse_args(argv)
    cfg = QUICK if a.quick else FULL
    only = set(filter(None, a.only.split(","))) or {"pairs", "rb", "handoff", "reclaim", "memory"}
    t0 = time.monotonic()
    binary = a.redis_server
    if binary is None:
        try:
            binary = find_server_binary("redis")
        except FileNotFoundError:
            binary = find_server_binary("any")
    R: dict[str, Any] = {
        "quick": a.quick,
        "config": cfg,
        "targets": TARGETS,
        "gpulock": gpulock.__version__,
        "machine": machine_info(),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }
    with RedisProcess(binary) as rp:
        c = redis.Redis.from_url(rp.url, **CLIENT_KW)
        srv = c.info("server")
        R["server"] = {
            "version": srv.get("redis_version"),
            "binary": binary,
            "valkey_version": srv.get("valkey_version"),
        }
        for s in scripts().values():
            c.script_load(s.source)
        R["errors"] = {}

        def part(key: str, label: str, fn, *args, **kw) -> None:
            """Run one measurement; a failure is reported (and fails the run) but does not
            stop the others."""
            log(label)
            try:
                R[key] = fn(*args, **kw)
            except Exception:
                R["errors"][key] = traceback.format_exc()
                log(f"FAILED: {label}\n{R['errors'][key]}")

        def chains(mode: str, ns, **kw) -> dict:
            return {str(n): run_chain(rp.url, c, mode, n, cfg, **kw) for n in ns}

        if "pairs" in only:
            part("pairs_sync", "ceiling and uncontended pairs, sync", bench_pairs_sync, rp.url, cfg)
            part(
                "pairs_async",
                "ceiling and uncontended pairs, asyncio",
                lambda: asyncio.run(bench_pairs_async(rp.url, cfg)),
            )
        if "rb" in only:
            part(
                "redis_benchmark",
                "redis-benchmark",
                bench_redis_benchmark,
                rp,
                c.script_load("return 1"),
                cfg,
            )
        if "handoff" in only:
            part(
                "handoff_async",
                f"hand-off chains, asyncio, {cfg['handoff_n']} waiters",
                chains,
                "async",
                cfg["handoff_n"],
            )
            part(
                "handoff_sync",
                f"hand-off chains, sync, {cfg['sync_handoff_n']} waiters",
                chains,
                "sync",
                cfg["sync_handoff_n"],
            )
            part(
                "handoff_async_1proc",
                "hand-off chain, asyncio, 10 waiters, all in one process",
                chains,
                "async",
                (10,),
                max_procs=1,
            )
            part("pubsub_floor", "pub/sub floor", bench_pubsub_floor, rp.url, c, cfg)
            try:
                import redis_lock  # noqa: F401
            except ImportError:
                log("python-redis-lock not installed: no peer rows (pip install -e '.[bench]')")
            else:
                part(
                    "handoff_peer",
                    "hand-off chain, python-redis-lock (peer calibration), 10 waiters",
                    chains,
                    "redislock",
                    (10,),
                )
        if "reclaim" in only:
            part("reclaim", "crash reclaim", bench_reclaim, rp.url, c, cfg)
        if "memory" in only:
            part("memory", "memory", bench_memory, c, cfg["mem_items"])
        c.close()
    R["machine"]["loadavg_end"] = list(os.getloadavg())
    R["runtime_s"] = time.monotonic() - t0
    R["json_path"] = a.json
    rows = build_rows(R)
    R["table"] = [dict(zip(("metric", "value", "target", "verdict"), r)) for r in rows]
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(
        json.dumps(_clean(R), separators=(",", ":"), default=str, allow_nan=False) + "\n"
    )
    print_report(R, rows)
    if R["errors"]:
        print(f"FAILED parts (tracebacks on stderr and in the JSON): {', '.join(R['errors'])}")
        return 2
    missed = [r for r in rows if r[3].startswith("MISS")]
    return 1 if (a.strict and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
