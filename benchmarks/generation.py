#!/usr/bin/env python
"""Generation benchmark: admitting LLM generations by their KV cache on a fixed budget, with
gpulock's leases grown chunk by chunk (``lease.resize``), with gpulock's leases of the whole
generation up front, and with a semaphore in each worker (docs/BENCHMARKS.md, section 13).

    python benchmarks/generation.py            # full run, about 4 minutes
    python benchmarks/generation.py --quick    # smoke run (CI), about 20 s

This measures admission, not a model: decoding is simulated (a stream sleeps ``token_ms`` per
token, in steps of ``step_tokens``; its prefill sleeps ``prefill_ms_per_1k`` per 1,000 tokens of
context and yields the first token). Bytes are a real model's: Llama-2-7B in fp16 through
:mod:`gpulock.estimates` (0.5 MiB of KV cache per token; a lease is
``GenerationPlan.size_for``: KV, activations, 2 MiB rounding).

``clients`` closed-loop clients, spread over ``workers`` worker processes (each one asyncio loop
and one pool object, as a uvicorn worker), send generations back to back: 70 % short (prompt
16-512 tokens, max_tokens 32-64), 30 % long (prompt 128-1024, max_tokens 512-1024); a stream
stops, as at an end-of-sequence token, after a uniformly drawn 50-100 % of its max_tokens.
Every mode sees the same sequence of requests per client. Modes:

* ``elastic``: ``Growth.grow(chunk, chunk)``: the lease covers the context and ``chunk`` new
  tokens and grows by ``lease.resize`` before each further chunk, waiting as long as it takes.
  A new stream is admitted only when its first lease fits now and no growth waits
  (``acquire(timeout=0)``, tried again every ``poll_s``);
* ``elastic-queued``: the same leases, but a new stream queues for its first lease (FIFO, as a
  plain ``acquire``); a growth queues at its lease's place, ahead of the new streams queued
  (docs/SEMANTICS.md, "Resizing a lease": running streams' growths come before new streams, as
  in vLLM's scheduler) and waits up to ``grow_timeout_s`` (None: as long as it takes);
  ``elastic-backfill``: the same on a backfill pool;
* ``reserve``: ``Growth.reserve_max()``: context + max_tokens leased up front, never resized;
* ``per-worker``: no gpulock; each worker admits at most K streams at once with its own
  ``asyncio.Semaphore(K)``, K = its share of the budget (budget / workers) over the mean
  reserve_max size of the workload (sampled from the same generator), the practice before a
  shared pool; ``per-worker-safe``: K over the largest possible generation, which never
  overruns.

A growth that fails (``ResizeRefused``: every other holder waits to grow, so waiting could only
deadlock; or ``AcquireTimeout`` in the queued modes) **preempts** the stream: it releases its
lease and asks again for its prompt plus the tokens made so far as context, recomputing its
cache (vLLM's recompute preemption); its tokens so far count, and it goes on from there.

Measured over a window after a warm-up (``FULL`` / ``QUICK``): streams admitted at once
(time-weighted mean and max), tokens/s, time to first token (from the request to the end of
its prefill) p50/p99 of the requests made in the window, budget use (time-weighted KV bytes in
use / budget; a stream uses the KV of its context and tokens, counted from the start of each
step), the pool's own count (``used`` sampled from Redis every ``sample_s``: mean and max of
capacity), overruns (times the KV in use across all workers went over the budget: a CUDA OOM
on a GPU; and the share of the window it was over), preemptions (and the streams finished in
the window that were preempted), streams finished. gpulock's modes must have 0 overruns and
never a Redis sample over capacity: the run fails otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _util import machine_info, percentile  # noqa: E402

import gpulock  # noqa: E402
from gpulock.estimates import DecoderShape, GenerationPlan, Growth  # noqa: E402

MiB, GiB = 2**20, 2**30
mono = time.monotonic

# Llama-2-7B, fp16 (its config.json): 0.5 MiB of KV cache per token
LLAMA2_7B = DecoderShape(
    layers=32,
    kv_heads=32,
    head_dim=128,
    bytes_per_element=2,
    hidden=4096,
    heads=32,
    intermediate=11008,
    vocab=32000,
)
FULL: dict[str, Any] = dict(
    budget=24 * GiB,
    workers=4,
    clients=128,
    token_ms=2.0,
    step_tokens=16,
    prefill_ms_per_1k=20.0,
    chunk=64,
    grow_timeout_s=None,
    warm_s=5.0,
    duration_s=30.0,
    sample_s=0.02,
    poll_s=0.02,
    modes=(
        "elastic",
        "elastic-queued",
        "elastic-backfill",
        "reserve",
        "per-worker",
        "per-worker-safe",
    ),
)
QUICK: dict[str, Any] = dict(
    FULL,
    budget=6 * GiB,
    workers=2,
    clients=32,
    token_ms=1.0,
    warm_s=1.0,
    duration_s=2.5,
    modes=("elastic", "elastic-queued", "reserve", "per-worker"),
)
LABELS = {
    "elastic": "gpulock elastic: admit when room, growths wait",
    "elastic-queued": "gpulock elastic: new streams queue, growths wait",
    "elastic-backfill": "same, backfill pool",
    "reserve": "gpulock, reserve max up front",
    "per-worker": "semaphore per worker (K from the mean)",
    "per-worker-safe": "semaphore per worker (K from the largest)",
}

POOL_MODES = ("elastic", "elastic-queued", "elastic-backfill", "reserve")


def draw(rng: random.Random) -> tuple[int, int, int, str]:
    """One request: (prompt tokens, max_tokens, tokens it generates before its end, kind)."""
    if rng.random() < 0.7:
        p, m, kind = rng.randint(16, 512), rng.randint(32, 64), "short"
    else:
        p, m, kind = rng.randint(128, 1024), rng.randint(512, 1024), "long"
    return p, m, max(1, round(m * rng.uniform(0.5, 1.0))), kind


def growth_of(mode: str, chunk: int) -> Growth:
    return Growth.grow(chunk, chunk) if mode.startswith("elastic") else Growth.reserve_max()


def per_worker_k(cfg: dict[str, Any], safe: bool) -> int:
    """K of the per-worker modes: a worker's share of the budget over the mean reserve_max size
    of the workload (20,000 draws), or over the largest size it can draw (``safe``)."""
    if safe:
        biggest = GenerationPlan(LLAMA2_7B, 1024, 1024).max_size
        return max(1, cfg["budget"] // cfg["workers"] // biggest)
    rng = random.Random(12345)
    sizes = [GenerationPlan(LLAMA2_7B, *draw(rng)[:2]).max_size for _ in range(20000)]
    return max(1, int(cfg["budget"] / cfg["workers"] / (sum(sizes) / len(sizes))))


# ---- the worker process ----------------------------------------------------------------------


def _emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


async def worker(a: dict[str, Any]) -> None:
    """One worker process: ``a["clients"]`` clients in one event loop until ``go``'s end time;
    then every stream is cancelled (its lease released) and the records are printed."""
    import faulthandler
    import signal

    from gpulock_common.aio import stop_tasks

    from gpulock import AcquireTimeout, AsyncPool, ResizeRefused

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung worker's stacks

    mode, cfg = a["mode"], a["cfg"]
    uses_pool = mode in POOL_MODES
    pool = AsyncPool.from_url(a["url"], a["pool"]) if uses_pool else None
    sem = asyncio.Semaphore(a["k"]) if not uses_pool else None
    growth = growth_of(mode, cfg["chunk"])
    kvt = LLAMA2_7B.kv_bytes_per_token
    token_s, step = cfg["token_ms"] / 1000, cfg["step_tokens"]
    # one per request: [asked, first admitted, first token, finished, prompt, max_tokens, tokens
    # it makes, tokens made, preemptions, kind]
    streams: list[list[Any]] = []
    admits: list[tuple[float, int]] = []  # streams holding their admission: (time, +1 / -1)
    preempts: list[tuple[float, str]] = []  # (time, the growth's error: refused or timed out)
    used: list[tuple[float, int]] = []  # KV bytes in use: (time, change)
    leased: list[tuple[float, int]] = []  # bytes this worker's leases hold: (time, change)
    tokens: list[tuple[float, int]] = []  # tokens made: (time the step ended, how many)
    resizes = [0]
    errors: list[str] = []
    if pool is not None:
        await pool.status(limit=0)  # connected and scripts loaded before "go"
    _emit({"ready": os.getpid()})
    loop = asyncio.get_running_loop()
    line = await loop.run_in_executor(None, sys.stdin.readline)
    t_end = float(line.split()[1])

    async def segment(rec: list[Any], p: int, m: int, target: int) -> tuple[int, bool]:
        """Admit the stream with ``p`` tokens of context and up to ``m`` to generate, and
        generate ``target`` tokens (its prefill makes the first); returns (tokens made, whether
        a refused or timed-out growth preempted it)."""
        plan = GenerationPlan(LLAMA2_7B, p, m, growth=growth)
        lease = None
        in_use = held = g = 0
        admitted = False
        try:
            if pool is not None and mode == "elastic":
                # admitted only when it fits now and no growth waits (never queued)
                while lease is None:
                    try:
                        lease = await pool.acquire(plan.size_for(0), timeout=0)
                    except AcquireTimeout:
                        await asyncio.sleep(cfg["poll_s"])
                held = lease.amount
                leased.append((mono(), held))
            elif pool is not None:
                lease = await pool.acquire(plan.size_for(0), timeout=60)
                held = lease.amount
                leased.append((mono(), held))
            else:
                assert sem is not None
                await sem.acquire()
            admitted = True
            t = mono()
            admits.append((t, 1))
            if rec[1] is None:
                rec[1] = t
            while g < target:
                need = plan.size_for(g)
                if lease is not None and need > held:
                    try:
                        # waits (up to grow_timeout_s in the queued modes), refused only
                        # where waiting could only deadlock
                        timeout = None if mode == "elastic" else cfg["grow_timeout_s"]
                        await lease.resize(need, timeout=timeout)
                    except (ResizeRefused, AcquireTimeout) as e:
                        preempts.append((mono(), type(e).__name__))
                        return g, True  # preempted: its leases released below
                    resizes[0] += 1
                    leased.append((mono(), need - held))
                    held = need
                end = min(plan.chunk_end(g), target, 1 if g == 0 else g + step)
                t = mono()
                used.append((t, kvt * (p + end) - in_use))  # the step's cache, from its start
                in_use = kvt * (p + end)
                dur = p * cfg["prefill_ms_per_1k"] / 1e6 if g == 0 else (end - g) * token_s
                await asyncio.sleep(dur)
                t = mono()
                tokens.append((t, end - g))
                if rec[2] is None:
                    rec[2] = t
                g = end
            return g, False
        finally:
            t = mono()
            if in_use:
                used.append((t, -in_use))
            if admitted:
                admits.append((t, -1))
            if lease is not None:
                leased.append((t, -held))
                await lease.release()
            elif sem is not None and admitted:
                sem.release()

    async def one(rng: random.Random) -> None:
        """One request, to its end: admitted again after each preemption with its prompt and
        the tokens made so far as context (its cache recomputed)."""
        p, m, g_stop, kind = draw(rng)
        rec: list[Any] = [mono(), None, None, None, p, m, g_stop, 0, 0, kind]
        streams.append(rec)
        done = 0
        while done < g_stop:
            got, preempted = await segment(rec, p + done, m - done, g_stop - done)
            done = rec[7] = done + got
            rec[8] += int(preempted)
        rec[3] = mono()

    async def client(i: int) -> None:
        rng = random.Random(a["seed"] * 100_000 + a["index"] * 1000 + i)
        while mono() < t_end:  # a cancellation lost below (redis-py) still ends the loop
            try:
                await one(rng)
            except gpulock.GpuLockError as e:
                errors.append(f"{type(e).__name__}: {e}")

    tasks = [asyncio.create_task(client(i)) for i in range(a["clients"])]
    await asyncio.sleep(max(0.0, t_end - mono()))
    await stop_tasks(tasks)
    if pool is not None:
        await pool.aclose()
    _emit(
        {
            "streams": streams,
            "admits": admits,
            "preempts": preempts,
            "used": used,
            "leased": leased,
            "tokens": tokens,
            "resizes": resizes[0],
            "errors": errors[:5],
            "error_count": len(errors),
        }
    )


# ---- the harness -----------------------------------------------------------------------------


def sweep(events: list[tuple[float, int]], t0: float, t1: float, limit: float) -> dict[str, Any]:
    """A step function given by its changes ``events`` (time, change), over [t0, t1]: its
    time-weighted mean, its max, how many times it went above ``limit`` (entries, counted
    from t0; already above at t0 counts one) and the share of the window it was above."""
    ev = sorted(events)
    cur = 0.0
    i = 0
    while i < len(ev) and ev[i][0] <= t0:
        cur += ev[i][1]
        i += 1
    area = over_s = 0.0
    peak, entries, last = cur, int(cur > limit), t0
    while i < len(ev) and ev[i][0] <= t1:
        t, d = ev[i]
        area += cur * (t - last)
        over_s += (t - last) if cur > limit else 0.0
        last = t
        before = cur
        cur += d
        peak = max(peak, cur)
        entries += int(cur > limit >= before)
        i += 1
    area += cur * (t1 - last)
    over_s += (t1 - last) if cur > limit else 0.0
    return {
        "mean": area / (t1 - t0),
        "max": peak,
        "over_entries": entries,
        "over_share": over_s / (t1 - t0),
    }


def series(events: list[tuple[float, int]], t0: float, t1: float, dt: float) -> list[float]:
    """The step function's value every ``dt`` seconds from t0 to t1 (for the plot)."""
    ev = sorted(events)
    out, cur, i, t = [], 0.0, 0, t0
    while t <= t1:
        while i < len(ev) and ev[i][0] <= t:
            cur += ev[i][1]
            i += 1
        out.append(cur)
        t += dt
    return out


async def _sample(url: str, name: str, stop: asyncio.Event, every: float) -> list[list[float]]:
    """(time, the pool's used bytes) from Redis every ``every`` seconds until ``stop``."""
    from gpulock import AsyncPool

    pool = AsyncPool.from_url(url, name)
    out: list[list[float]] = []
    try:
        while not stop.is_set():
            s = await pool.status(limit=0)
            out.append([mono(), s.used])
            await asyncio.sleep(every)
    finally:
        await pool.aclose()
    return out


def run_mode(url: str, mode: str, cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """One mode: W fresh worker processes, a fresh pool; returns its measurements."""
    name = f"gen-{mode}-{seed}"
    uses_pool = mode in POOL_MODES
    k = per_worker_k(cfg, safe=mode == "per-worker-safe") if not uses_pool else None
    if uses_pool:
        from gpulock import Pool

        with Pool.from_url(url, name) as admin:
            policy = "backfill" if mode == "elastic-backfill" else "fifo"
            admin.configure(cfg["budget"], max_waiters=10_000, policy=policy)
    per = [cfg["clients"] // cfg["workers"]] * cfg["workers"]
    for j in range(cfg["clients"] % cfg["workers"]):
        per[j] += 1
    procs = []
    for j, n in enumerate(per):
        a = dict(mode=mode, cfg=cfg, url=url, pool=name, k=k, clients=n, index=j, seed=seed)
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(a)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=HERE.parent,
            )
        )
    try:
        for pr in procs:
            line = pr.stdout.readline()  # type: ignore[union-attr]
            if not line.startswith('{"ready"'):
                raise RuntimeError(f"{mode}: a worker did not start: {line!r}")
        go = mono()
        t0, t1 = go + cfg["warm_s"], go + cfg["warm_s"] + cfg["duration_s"]
        for pr in procs:
            pr.stdin.write(f"go {t1}\n")  # type: ignore[union-attr]
            pr.stdin.flush()  # type: ignore[union-attr]

        async def sample() -> list[list[float]]:
            if not uses_pool:
                await asyncio.sleep(t1 - mono())
                return []
            stop = asyncio.Event()
            task = asyncio.create_task(_sample(url, name, stop, cfg["sample_s"]))
            await asyncio.sleep(max(0.0, t1 - mono()))
            stop.set()
            return await task

        samples = asyncio.run(sample())
        outs = []
        for pr in procs:
            line = pr.stdout.readline()  # type: ignore[union-attr]
            outs.append(json.loads(line))
            pr.wait(timeout=30)
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
    streams = [s for o in outs for s in o["streams"]]
    used = [tuple(e) for o in outs for e in o["used"]]
    leased = [tuple(e) for o in outs for e in o["leased"]]
    budget = cfg["budget"]
    adm = [tuple(e) for o in outs for e in o["admits"]]
    conc = sweep(adm, t0, t1, math.inf)
    u = sweep(used, t0, t1, budget)
    lz = sweep(leased, t0, t1, budget)
    made = sum(n for o in outs for t, n in o["tokens"] if t0 <= t <= t1)
    asked = [s for s in streams if t0 <= s[0] <= t1]
    ttft = [(s[2] - s[0]) * 1000 for s in asked if s[2] is not None]
    in_win = [x for x in samples if t0 <= x[0] <= t1]
    ended = [s for s in streams if s[3] is not None and t0 <= s[3] <= t1]
    return {
        "mode": mode,
        "label": LABELS[mode],
        "k_per_worker": k,
        "window_s": t1 - t0,
        "concurrent_mean": conc["mean"],
        "concurrent_max": conc["max"],
        "tokens_per_s": made / (t1 - t0),
        "ttft_ms": {
            "n": len(ttft),
            "p50": percentile(ttft, 50),
            "p99": percentile(ttft, 99),
            "max": max(ttft, default=math.nan),
            "no_first_token_by_end": len(asked) - len(ttft),
        },
        "use": u["mean"] / budget,
        "use_max": u["max"] / budget,
        "overruns": u["over_entries"],
        "over_share": u["over_share"],
        "leased_mean": lz["mean"] / budget if uses_pool else None,
        "redis_used_mean": (sum(x[1] for x in in_win) / len(in_win) / budget if in_win else None),
        "redis_used_max": max((x[1] for x in in_win), default=None),
        "redis_samples": len(in_win),
        "redis_over_capacity": sum(1 for x in in_win if x[1] > budget),
        "preemptions": sum(1 for o in outs for t, _ in o["preempts"] if t0 <= t <= t1),
        "preempted_refused": sum(
            1 for o in outs for t, e in o["preempts"] if t0 <= t <= t1 and e != "AcquireTimeout"
        ),
        "preempted_streams": sum(1 for s in ended if s[8]),
        "finished": len(ended),
        "finished_by_kind": {
            kind: sum(1 for s in ended if s[9] == kind) for kind in ("short", "long")
        },
        "resizes": sum(o["resizes"] for o in outs),
        "errors": [e for o in outs for e in o["errors"]][:5],
        "error_count": sum(o["error_count"] for o in outs),
        "use_series": [x / budget for x in series(used, t0, t1, 0.1)],
    }


def build_table(R: dict[str, Any]) -> str:
    """The runs as a Markdown table."""
    head = [
        "mode",
        "streams at once: mean / max",
        "tokens/s",
        "TTFT p50 / p99 (ms)",
        "budget use: KV in use (mean / max)",
        "pool used, Redis (mean / max)",
        "overruns (time over)",
        "preempted (streams)",
        "finished",
    ]
    rows = []
    for r in R["runs"]:
        k = f", K={r['k_per_worker']}" if r["k_per_worker"] else ""
        red = (
            f"{r['redis_used_mean']:.0%} / {r['redis_used_max'] / R['config']['budget']:.0%}"
            if r["redis_used_mean"] is not None
            else "-"
        )
        rows.append(
            [
                r["label"].replace(")", f"{k})") if k else r["label"],
                f"{r['concurrent_mean']:.1f} / {r['concurrent_max']:.0f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f}",
                f"{r['use']:.0%} / {r['use_max']:.0%}",
                red,
                f"{r['overruns']:,} ({r['over_share']:.0%})",
                f"{r['preemptions']:,} ({r['preempted_streams']:,})",
                f"{r['finished']:,}",
            ]
        )
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def params_line(R: dict[str, Any]) -> str:
    c = R["config"]
    gt = "none" if c["grow_timeout_s"] is None else f"{c['grow_timeout_s']:g} s"
    return (
        f"Llama-2-7B fp16 ({LLAMA2_7B.kv_bytes_per_token // 1024} KiB of KV per token), budget "
        f"{c['budget'] / GiB:g} GiB, {c['clients']} clients over {c['workers']} worker processes, "
        f"{c['token_ms']:g} ms a token in steps of {c['step_tokens']}, prefill "
        f"{c['prefill_ms_per_1k']:g} ms per 1k tokens, elastic chunk {c['chunk']} tokens, growth "
        f"timeout {gt}; {c['duration_s']:g} s window after {c['warm_s']:g} s "
        f"warm-up; 70 % short (prompt 16-512, max_tokens 32-64), 30 % long (prompt 128-1024, "
        f"max_tokens 512-1024), each stopping after 50-100 % of its max_tokens"
    )


def run(
    cfg: dict[str, Any], quick: bool, json_path: str, server: str | None, modes: list[str]
) -> dict[str, Any]:
    from core import _clean
    from peers import pick_server

    from gpulock.embedded import RedisProcess

    t_all = mono()
    R: dict[str, Any] = {
        "quick": quick,
        "config": cfg,
        "machine": machine_info(),
        "gpulock": gpulock.__version__,
        "kv_bytes_per_token": LLAMA2_7B.kv_bytes_per_token,
        "runs": [],
    }
    with RedisProcess(pick_server(server)) as rp:
        R["server"] = rp.binary if hasattr(rp, "binary") else None
        for mode in modes:
            print(f"# {mode}", file=sys.stderr, flush=True)
            R["runs"].append(run_mode(rp.url, mode, cfg, seed=7))
    R["machine"]["loadavg_end"] = list(os.getloadavg())
    R["runtime_s"] = mono() - t_all
    R["params"] = params_line(R)
    R["table"] = build_table(R)
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(
        json.dumps(_clean(R), separators=(",", ":"), default=str, allow_nan=False) + "\n"
    )
    R["json_path"] = json_path
    return R


def failures(R: dict[str, Any]) -> list[str]:
    """What must not happen: errors, a gpulock mode over the budget, a Redis sample over the
    capacity."""
    bad = []
    for r in R["runs"]:
        if r["error_count"]:
            bad.append(f"{r['mode']}: {r['error_count']} errors, e.g. {r['errors'][:1]}")
        if r["mode"] in POOL_MODES and (r["overruns"] or r["redis_over_capacity"]):
            bad.append(f"{r['mode']}: {r['overruns']} overruns, {r['redis_over_capacity']} samples")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small, about 15 s")
    ap.add_argument(
        "--json",
        default=None,
        help="raw numbers (default: results/generation.json, or results/quick/ for --quick)",
    )
    ap.add_argument("--redis-server", default=None)
    ap.add_argument("--modes", default=None, help="comma list (default: the run's modes)")
    ap.add_argument(
        "--plot",
        default=None,
        help="write the plot here (default: benchmarks/results/generation.png on a full run)",
    )
    ap.add_argument(
        "--grow-timeout",
        type=float,
        default=None,
        help="seconds a growth may wait (default: the run's)",
    )
    ap.add_argument(
        "--chunk", type=int, default=None, help="elastic chunk, tokens (default: the run's)"
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        asyncio.run(worker(json.loads(a.worker)))
        return 0
    cfg = dict(QUICK if a.quick else FULL)
    if a.grow_timeout is not None:
        cfg["grow_timeout_s"] = a.grow_timeout
    if a.chunk is not None:
        cfg["chunk"] = a.chunk
    modes = a.modes.split(",") if a.modes else list(cfg["modes"])
    unknown = set(modes) - set(LABELS)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; known: {', '.join(LABELS)}")
    json_path = a.json or str(HERE / "results" / ("quick" if a.quick else "") / "generation.json")
    R = run(cfg, a.quick, json_path, a.redis_server, modes)
    plot = a.plot or (None if a.quick else str(HERE / "results" / "generation.png"))
    if plot and R["runs"]:
        from plots import plot_generation

        plot_generation(R, Path(plot))
        print(f"plot: {plot}")
    M = R["machine"]
    print(
        f"gpulock {R['gpulock']} generation benchmark ({'quick' if R['quick'] else 'full'} run, "
        f"{R['runtime_s']:.0f} s); {M['cpu']}, {M['cores']} cores, load avg "
        f"{M['loadavg_start'][0]:.2f} at start, {M['loadavg_end'][0]:.2f} at end"
    )
    print(R["params"])
    print()
    print(R["table"])
    print()
    print(f"raw numbers: {R['json_path']}")
    bad = failures(R)
    if bad:
        print("FAILED: " + "; ".join(bad))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
