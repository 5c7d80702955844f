#!/usr/bin/env python
"""A/B of two gpulock versions in one run, on one private Redis: uncontended pairs.

    python benchmarks/ab.py --base HEAD~1            # working tree (B) against a commit (A)
    python benchmarks/ab.py --base main --rounds 12 --slice 0.25
    python benchmarks/ab.py --base 736fbbd --new 503935c     # two commits
    python benchmarks/ab.py --base HEAD --b-variant scripts   # one tree, one mechanism off

Each side runs in its own worker process (side A imports the ``--base`` commit, exported with
``git archive`` into a temporary folder; side B the working tree), so both sides' scripts are
loaded in the same server under their own SHAs. A worker answers one command at a time; the
harness alternates A and B, round after round. For each of ``Pool`` (sync) and ``AsyncPool``
a slice is ``return 1`` ceiling, pool pairs, ceiling, each ``--slice`` seconds, measured by
the worker itself; the slice's ratio is its pair rate over the mean of its two ceiling
neighbours (core.py's method), and the server CPU of the pair part (INFO cpu, read around it
on the worker's own connection) is divided by the pairs made, and so is the worker's own CPU
time (all its threads; time.process_time). Reported: median ratio, median
pairs/s, server and client CPU per pair per side (also for "many": 16 AsyncPool tasks doing
pairs at once for two sub-slices; no ratio), and the Lua time per call of each side's
acquire and release (INFO commandstats ``usec_per_call``, raw EVALSHA: five alternating runs
of ``--lua-n``/5 calls each, the median).

``--a-variant``/``--b-variant`` switch one mechanism off on a side, to measure it alone with
the same code: ``scripts`` (EVALSHA of the scripts instead of FCALL of the library),
``redispy`` (script calls through redis-py's ``execute_command`` instead of the lane),
``nobatch`` (AsyncPool: each call on a connection of its own, no batching of overlapping
calls).

Benchmark tool only; nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

WORKER = r"""
import asyncio, json, os, sys, time
import redis
from _util import calls_async, calls_sync  # benchmarks/ is on the worker's PYTHONPATH
import redis.asyncio as aioredis
from gpulock import Pool, AsyncPool
from gpulock.protocol.keys import pool_keys
from gpulock.transport.scripts import scripts
from gpulock.protocol.request import AcquireRequest
try:
    from gpulock._async import _CLIENT_DEFAULTS as KW
except ImportError:
    KW = {}
import inspect
if "options" in inspect.signature(AcquireRequest.build).parameters:  # one AcquireOptions
    from gpulock_common.options import AcquireOptions
    def _request(pool):
        return AcquireRequest.build(pool, 1, AcquireOptions(ttl=30.0), waiter_ttl=5.0,
                                    default_ttl=30.0)
else:  # a version before it: the options as keywords
    def _request(pool):
        return AcquireRequest.build(pool, 1, ttl=30.0, timeout=None, holder=None,
                                    request_id=None, waiter_ttl=5.0, default_ttl=30.0)

url, side = sys.argv[1], sys.argv[2]
variant = set(filter(None, os.environ.get("GPULOCK_AB_VARIANT", "").split(",")))
c = redis.Redis.from_url(url, **KW)
trivial = c.script_load("return 1")
name = "ab-" + side
pool = Pool.from_url(url, name, capacity=2**40)
pool.configure(2**40)
loop = asyncio.new_event_loop()
ac = aioredis.from_url(url, **KW)
apool = AsyncPool.from_url(url, name + "-a", capacity=2**40)
loop.run_until_complete(apool.configure(2**40))
# Variants of one tree (--a-variant/--b-variant), to measure one mechanism on its own:
# "scripts": EVALSHA instead of the function library; "redispy": script calls through
# redis-py's execute_command instead of the lane; "nobatch": AsyncPool calls each on a
# connection of its own until all slots are busy (no batching of overlapping calls).
if "scripts" in variant:
    from gpulock.transport.dialect import dialect_of
    for cl in (pool.redis, apool.redis):
        dialect_of(cl).functions = False
if "redispy" in variant:
    pool._scripts.lane = None
    apool._scripts.lane = None
if "nobatch" in variant:
    async def _direct(scripts, sc, args):
        return await scripts.send(sc, args)
    apool._scripts.first = _direct


def cpu():
    i = c.info("cpu")
    return float(i["used_cpu_user"]) + float(i["used_cpu_sys"])


def ceil_s():
    c.evalsha(trivial, 0)


def pair_s():
    pool.acquire(1).release()


async def ceil_a():
    await ac.evalsha(trivial, 0)


async def pair_a():
    await (await apool.acquire(1)).release()


async def many(secs, tasks=16):
    end = time.perf_counter() + secs

    async def one():
        n = 0
        while time.perf_counter() < end:
            await (await apool.acquire(1)).release()
            n += 1
        return n

    return sum(await asyncio.gather(*(one() for _ in range(tasks))))


def run_slice(kind, secs):
    if kind == "many":
        c0, p0, t0 = cpu(), time.process_time(), time.perf_counter()
        n = loop.run_until_complete(many(2 * secs))
        c1, p1, t1 = cpu(), time.process_time(), time.perf_counter()
        return {"rate": n / (t1 - t0), "ratio": float("nan"), "cpu_s": c1 - c0,
                "client_cpu_s": p1 - p0, "pairs": n}
    if kind == "sync":
        n1, t1 = calls_sync(ceil_s, secs)
        c0, p0 = cpu(), time.process_time()
        n, t = calls_sync(pair_s, secs)
        c1, p1 = cpu(), time.process_time()
        n2, t2 = calls_sync(ceil_s, secs)
    else:
        n1, t1 = loop.run_until_complete(calls_async(ceil_a, secs))
        c0, p0 = cpu(), time.process_time()
        n, t = loop.run_until_complete(calls_async(pair_a, secs))
        c1, p1 = cpu(), time.process_time()
        n2, t2 = loop.run_until_complete(calls_async(ceil_a, secs))
    ceil = (n1 / t1 + n2 / t2) / 2
    return {"rate": n / t, "ratio": (n / t) / ceil, "cpu_s": c1 - c0, "client_cpu_s": p1 - p0,
            "pairs": n}


def lua(nn):
    # Each side's scripts as its Pool calls them (FCALL where the side uses the function
    # library, else EVALSHA); usec_per_call of whichever command ran.
    sc = scripts()
    for s in sc.values():
        c.script_load(s.source)
    keys = pool_keys(name + "-lua")
    c.evalsha(sc["configure"].sha, len(keys), *keys, str(2**40), "100000", "set")
    own = getattr(pool, "_scripts", None)
    if own is not None:
        from gpulock.transport.script_calls import SyncScripts
        own = SyncScripts(c, keys)
        own.heads.dialect.functions = pool._scripts.heads.dialect.functions
        run = lambda op, args: own.call(op, args)  # noqa: E731
        run("reap", [])  # loads the library
    else:
        run = lambda op, args: c.evalsha(sc[op].sha, len(keys), *keys, *args)  # noqa: E731

    def us():
        st = c.info("commandstats")
        calls = sum(int(st.get(k, {}).get("calls", 0)) for k in ("cmdstat_evalsha", "cmdstat_fcall"))
        usec = sum(int(st.get(k, {}).get("usec", 0)) for k in ("cmdstat_evalsha", "cmdstat_fcall"))
        return usec / max(1, calls)

    out = {}
    reqs = [_request(name + "-lua") for _ in range(nn)]
    c.config_resetstat()
    gs = [run("acquire", r.argv("wait", "ab")) for r in reqs]
    out["acquire_us"] = us()
    c.config_resetstat()
    for g in gs:
        run("release", [g[1], g[2]])
    out["release_us"] = us()
    c.config_resetstat()
    return out


for _ in range(3):  # warm up
    run_slice("sync", 0.05); run_slice("async", 0.05)
import gpulock
print(json.dumps({"ready": side, "gpulock": gpulock.__file__}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "slice":
        print(json.dumps(run_slice(cmd["kind"], cmd["secs"])), flush=True)
    elif cmd["op"] == "lua":
        print(json.dumps(lua(cmd["n"])), flush=True)
    else:
        break
pool.close()
loop.run_until_complete(apool.aclose())
"""


def export(rev: str, dest: Path) -> None:
    """The tree of ``rev`` (git archive) under ``dest``."""
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch.stdout, check=True)


def pypath(root: Path) -> str:
    """The PYTHONPATH that imports the packages of the tree at ``root`` (gpulock, the service,
    the SDK, gpulock-common)."""
    return os.pathsep.join(
        str(root / p) for p in ("", "service", "clients/python", "clients/common")
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD", help="side A: a git revision (default HEAD)")
    ap.add_argument("--new", default=None, help="side B: a git revision (default: working tree)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--slice", type=float, default=0.2, help="seconds per sub-slice")
    ap.add_argument("--lua-n", type=int, default=2000)
    ap.add_argument("--redis-server", default=None)
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    ap.add_argument(
        "--a-variant",
        default="",
        help="comma list applied to side A: scripts (EVALSHA, not functions), redispy "
        "(calls through redis-py, not the lane), nobatch (AsyncPool: no batching)",
    )
    ap.add_argument("--b-variant", default="", help="the same for side B")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from gpulock.embedded import RedisProcess, find_server_binary

    binary = a.redis_server or find_server_binary("redis")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="gpulock-ab-") as tmp, RedisProcess(binary) as rp:
        sides = {"A": Path(tmp) / "A", "B": ROOT if a.new is None else Path(tmp) / "B"}
        for s, rev in (("A", a.base), ("B", a.new)):
            if rev is not None:
                sides[s].mkdir()
                export(rev, sides[s])
        (Path(tmp) / "cwd").mkdir()
        procs = {}
        for s, root in sides.items():
            env = dict(
                os.environ,
                # the tree's packages, then benchmarks/ (the worker's timed loops, _util)
                PYTHONPATH=os.pathsep.join([pypath(root), str(HERE)]),
                GPULOCK_AB_VARIANT=a.a_variant if s == "A" else a.b_variant,
            )
            procs[s] = subprocess.Popen(
                [sys.executable, "-c", WORKER, rp.url, s],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                cwd=Path(tmp) / "cwd",  # python -c puts the cwd first on sys.path: an empty one
            )
            hello = json.loads(procs[s].stdout.readline())
            assert hello["ready"] == s, hello
            assert Path(hello["gpulock"]).resolve().is_relative_to(root.resolve()), (s, hello)

        def ask(s: str, **cmd: object) -> dict:
            procs[s].stdin.write(json.dumps(cmd) + "\n")
            procs[s].stdin.flush()
            return json.loads(procs[s].stdout.readline())

        kinds = ("sync", "async", "many")
        res: dict = {s: {k: [] for k in kinds} for s in sides}
        for r in range(a.rounds):
            order = ("A", "B") if r % 2 == 0 else ("B", "A")
            for kind in kinds:
                for s in order:
                    res[s][kind].append(ask(s, op="slice", kind=kind, secs=a.slice))
        lua_runs: dict = {s: [] for s in sides}
        for r in range(5):  # alternating, the median of five of each
            for s in ("A", "B") if r % 2 == 0 else ("B", "A"):
                lua_runs[s].append(ask(s, op="lua", n=a.lua_n // 5))
        lua = {
            s: {k: statistics.median(x[k] for x in xs) for k in xs[0]} for s, xs in lua_runs.items()
        }
        for p in procs.values():
            p.stdin.write(json.dumps({"op": "quit"}) + "\n")
            p.stdin.close()
            p.wait(timeout=30)
        version = subprocess.run(
            [binary, "--version"], capture_output=True, text=True
        ).stdout.strip()
    load1 = os.getloadavg()
    va = f" [{a.a_variant}]" if a.a_variant else ""
    vb = f" [{a.b_variant}]" if a.b_variant else ""
    print(
        f"A = {a.base}{va}, B = {a.new or 'working tree'}{vb}; {a.rounds} rounds of {a.slice} s "
        f"sub-slices; {version}"
    )
    print(f"load avg {load0[0]:.2f} at start, {load1[0]:.2f} at end")
    summary: dict = {}
    for kind in kinds:
        for s in sides:
            xs = res[s][kind]
            ratio = statistics.median(x["ratio"] for x in xs)
            rate = statistics.median(x["rate"] for x in xs)
            pairs = sum(x["pairs"] for x in xs)
            cpu = 1e6 * sum(x["cpu_s"] for x in xs) / pairs
            ccpu = 1e6 * sum(x["client_cpu_s"] for x in xs) / pairs
            summary[f"{kind}_{s}"] = {
                "ratio": ratio,
                "rate": rate,
                "cpu_us_per_pair": cpu,
                "client_cpu_us_per_pair": ccpu,
            }
            print(
                f"{kind:5s} {s}: {ratio:6.1%} of ceiling, {rate:7.0f} pairs/s, "
                f"server CPU {cpu:6.1f} us/pair, client CPU {ccpu:6.1f} us/pair"
            )
    for s in sides:
        print(
            f"lua {s}: acquire {lua[s]['acquire_us']:.1f} us, release {lua[s]['release_us']:.1f} us"
        )
    if a.json:
        Path(a.json).write_text(
            json.dumps({"slices": res, "lua": lua, "summary": summary, "load": [load0, load1]})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
