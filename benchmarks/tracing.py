#!/usr/bin/env python
"""What tracing costs an uncontended acquire+release, in one run, on one private Redis.

    python benchmarks/tracing.py                 # 5 rounds of 0.3 s sub-slices
    python benchmarks/tracing.py --rounds 9 --slice 0.5 --json out.json
    python benchmarks/tracing.py --quick         # 1 round of 0.05 s (the smoke test's)

Each variant runs in a worker process of its own (OpenTelemetry's tracer provider is global to
a process and set once):

* ``absent``: OpenTelemetry cannot be imported (``sys.modules["opentelemetry"] = None`` before
  gpulock is imported): every hook of ``gpulock_common.tracing`` is a no-op;
* ``absent-again``: the same in a second process, the control: its difference to ``absent``
  is what two processes of one code differ by in this run (the noise floor);
* ``api``: the OpenTelemetry API importable, no SDK provider set (the default of an
  application that configures nothing): ``tracing.recording()`` is False, nothing is built;
* ``sdk-drop``: an SDK ``TracerProvider`` with a ``BatchSpanProcessor`` to an exporter that
  drops every batch: the cost of making and recording the spans (a ``gpulock.acquire`` and a
  ``gpulock.lease`` span per pair, the processor's queue), without an exporter's I/O;
* ``sdk-memory``: the same provider with a ``SimpleSpanProcessor`` to an in-memory exporter
  (each span handed over as it ends, in the caller's thread; cleared after each slice).

The harness alternates the variants (the order rotated each round, so machine noise, shared
with other jobs, falls on all of them alike); in each round every worker measures a slice per
shell (``Pool`` sync, ``AsyncPool`` async): the single-connection ``EVALSHA`` of ``return 1``
ceiling, pairs, the ceiling again, each ``--slice`` seconds (benchmarks/core.py's method; the
pair rate over the mean of its two ceiling neighbours is the slice's ratio), and the worker's
own CPU time over the pair part (``time.process_time``, all its threads: the span processor's
too). Reported per variant and shell: median pairs/s and its spread (min..max over rounds), the
median ratio, the median client CPU µs per pair and its min..max over the slices, and the
difference to ``absent`` in µs per pair, wall (1e6/rate - 1e6/rate_absent) and client CPU, each
the median over rounds of that round's difference (the variants of a round ran side by side,
so the load common to a round drops out). Also the spans each SDK worker exported against the
pairs it made (2 per pair expected: the check that the variant traced what it measured), and
the time of one ``tracing.recording()`` in each worker (the check an acquire makes; the lease
hooks test ``state.span is not None``): what a pair pays while tracing is off.

Benchmark tool only; nothing here is a test (tests/integration/test_bench_tracing_smoke.py
runs ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from ab import pypath  # noqa: E402

VARIANTS = ("absent", "absent-again", "api", "sdk-drop", "sdk-memory")

WORKER = r"""
import asyncio, json, sys, time
url, variant = sys.argv[1], sys.argv[2]
exported = [0]
memory = None
if variant.startswith("absent"):
    sys.modules["opentelemetry"] = None  # any import of opentelemetry raises ImportError
elif variant.startswith("sdk-"):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor, SimpleSpanProcessor, SpanExporter, SpanExportResult,
    )
    provider = TracerProvider()
    if variant == "sdk-drop":
        class Drop(SpanExporter):
            def export(self, spans):
                exported[0] += len(spans)
                return SpanExportResult.SUCCESS
        provider.add_span_processor(BatchSpanProcessor(Drop()))
    else:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(provider)
import redis
import redis.asyncio as aioredis
from _util import calls_async, calls_sync  # benchmarks/ is on the worker's PYTHONPATH
from gpulock import AsyncPool, Pool
from gpulock_common import tracing
want = {"absent": (False, False), "api": (True, False)}.get(variant.split("-")[0], (True, True))
assert (tracing.ENABLED, tracing.recording()) == want, (variant, tracing.ENABLED)

c = redis.Redis.from_url(url)
trivial = c.script_load("return 1")
name = "tr-" + variant
pool = Pool.from_url(url, name, capacity=2**40)
pool.configure(2**40)
loop = asyncio.new_event_loop()
ac = aioredis.from_url(url)
apool = AsyncPool.from_url(url, name + "-a", capacity=2**40)
loop.run_until_complete(apool.configure(2**40))


def ceil_s():
    c.evalsha(trivial, 0)


made = [0]  # pairs made, the warm-up's too: each SDK variant should export 2 spans a pair


def pair_s():
    pool.acquire(1).release()
    made[0] += 1


async def ceil_a():
    await ac.evalsha(trivial, 0)


async def pair_a():
    await (await apool.acquire(1)).release()
    made[0] += 1


def run_slice(kind, secs):
    if kind == "sync":
        n1, t1 = calls_sync(ceil_s, secs)
        p0 = time.process_time()
        n, t = calls_sync(pair_s, secs)
        p1 = time.process_time()
        n2, t2 = calls_sync(ceil_s, secs)
    else:
        n1, t1 = loop.run_until_complete(calls_async(ceil_a, secs))
        p0 = time.process_time()
        n, t = loop.run_until_complete(calls_async(pair_a, secs))
        p1 = time.process_time()
        n2, t2 = loop.run_until_complete(calls_async(ceil_a, secs))
    if memory is not None:
        exported[0] += len(memory.get_finished_spans())
        memory.clear()
    ceil = (n1 / t1 + n2 / t2) / 2
    return {"rate": n / t, "ratio": (n / t) / ceil, "ceiling": ceil,
            "client_cpu_s": p1 - p0, "pairs": n}


for _ in range(3):  # warm up
    run_slice("sync", 0.05); run_slice("async", 0.05)
print(json.dumps({"ready": variant}), flush=True)
def hook(n):
    # What a pair pays for tracing while it is off: one tracing.recording() per acquire (the
    # lease hooks are a `state.span is not None` test): ns per call, the best of 5 runs.
    rec = tracing.recording
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            rec()
        best = min(best, (time.perf_counter() - t0) / n)
    return {"recording_ns": 1e9 * best}


for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "slice":
        print(json.dumps(run_slice(cmd["kind"], cmd["secs"])), flush=True)
    elif cmd["op"] == "hook":
        print(json.dumps(hook(cmd["n"])), flush=True)
    else:
        break
pool.close()
loop.run_until_complete(apool.aclose())
if variant.startswith("sdk-"):
    provider.shutdown()  # flushes the batch processor's queue
    if memory is not None:
        exported[0] += len(memory.get_finished_spans())
print(json.dumps({"exported": exported[0], "pairs": made[0]}), flush=True)
"""


def _spread(xs: list[float]) -> str:
    return f"{min(xs):.0f}..{max(xs):.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--slice", type=float, default=0.3, help="seconds per sub-slice")
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS)
    )
    ap.add_argument("--quick", action="store_true", help="1 round of 0.05 s sub-slices")
    ap.add_argument("--redis-server", default=None)
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    a = ap.parse_args(argv)
    if a.quick:
        a.rounds, a.slice = 1, 0.05
    variants = [v for v in a.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown or "absent" not in variants:
        ap.error(f"variants: {', '.join(VARIANTS)}, absent among them (got {a.variants})")
    sys.path.insert(0, str(ROOT))
    from gpulock.embedded import RedisProcess, find_server_binary

    binary = a.redis_server or find_server_binary("redis")
    load0 = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    kinds = ("sync", "async")
    res: dict = {v: {k: [] for k in kinds} for v in variants}
    with tempfile.TemporaryDirectory(prefix="gpulock-tracing-") as tmp, RedisProcess(binary) as rp:
        procs = {}
        # this tree's packages, then benchmarks/ (the worker's timed loops, _util)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([pypath(ROOT), str(HERE)]))
        for v in variants:
            procs[v] = subprocess.Popen(
                [sys.executable, "-c", WORKER, rp.url, v],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
                cwd=tmp,  # python -c puts the cwd first on sys.path: an empty one
            )
            hello = procs[v].stdout.readline()
            if not hello:
                raise SystemExit(f"the {v} worker did not start (its stderr above)")
            assert json.loads(hello)["ready"] == v, hello

        def ask(v: str, **cmd: object) -> dict:
            procs[v].stdin.write(json.dumps(cmd) + "\n")
            procs[v].stdin.flush()
            return json.loads(procs[v].stdout.readline())

        for r in range(a.rounds):
            k = r % len(variants)
            order = variants[k:] + variants[:k]  # rotated: each variant first in turn
            for kind in kinds:
                for v in order:
                    res[v][kind].append(ask(v, op="slice", kind=kind, secs=a.slice))
        hooks = {v: ask(v, op="hook", n=20_000 if a.quick else 200_000) for v in variants}
        done = {}
        for v, p in procs.items():
            p.stdin.write(json.dumps({"op": "quit"}) + "\n")
            p.stdin.flush()
            done[v] = json.loads(p.stdout.readline())
            p.stdin.close()
            p.wait(timeout=30)
        version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    load1 = os.getloadavg()
    print(
        f"tracing overhead: {a.rounds} rounds of {a.slice} s sub-slices, {started}; "
        f"{version.strip()[:40]}"
    )
    print(f"load avg {load0[0]:.2f} at start, {load1[0]:.2f} at end; {os.cpu_count()} cores")
    summary: dict = {}
    head = (
        f"{'shell':5s} {'variant':12s} {'pairs/s':>8s} {'min..max':>13s} {'ratio':>6s} "
        f"{'CPU µs/pair':>11s} {'min..max':>11s} {'Δ µs/pair':>9s} {'Δ CPU µs':>8s}"
    )
    print(head)
    for kind in kinds:
        ref = res["absent"][kind]
        for v in variants:
            xs = res[v][kind]
            rate = statistics.median(x["rate"] for x in xs)
            cpus = [1e6 * x["client_cpu_s"] / x["pairs"] for x in xs]
            # paired by round (the variants of a round ran side by side): the median of the
            # rounds' differences to absent, which the load common to a round drops out of
            d_wall = [1e6 / x["rate"] - 1e6 / r["rate"] for x, r in zip(xs, ref)]
            d_cpu = [c - 1e6 * r["client_cpu_s"] / r["pairs"] for c, r in zip(cpus, ref)]
            row = {
                "rate": rate,
                "rate_min": min(x["rate"] for x in xs),
                "rate_max": max(x["rate"] for x in xs),
                "ratio": statistics.median(x["ratio"] for x in xs),
                "client_cpu_us_per_pair": statistics.median(cpus),
                "client_cpu_min": min(cpus),
                "client_cpu_max": max(cpus),
                "delta_us_per_pair": statistics.median(d_wall),
                "delta_cpu_us_per_pair": statistics.median(d_cpu),
            }
            summary[f"{kind}_{v}"] = row
            print(
                f"{kind:5s} {v:12s} {rate:8.0f} {_spread([x['rate'] for x in xs]):>13s} "
                f"{row['ratio']:6.1%} {row['client_cpu_us_per_pair']:11.1f} "
                f"{_spread(cpus):>11s} "
                f"{row['delta_us_per_pair']:+9.1f} {row['delta_cpu_us_per_pair']:+8.1f}"
            )
    print(
        "tracing.recording(), the check an acquire makes: "
        + ", ".join(f"{v} {hooks[v]['recording_ns']:.0f} ns" for v in variants)
    )
    for v in variants:
        if v.startswith("sdk-"):
            print(f"{v}: {done[v]['exported']} spans exported for {done[v]['pairs']} pairs")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(
            json.dumps(
                {
                    "slices": res,
                    "summary": summary,
                    "exported": done,
                    "hooks": hooks,
                    "load": [load0, load1],
                    "rounds": a.rounds,
                    "slice_s": a.slice,
                    "quick": a.quick,
                    "started": started,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
