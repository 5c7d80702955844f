#!/usr/bin/env python
"""Dynamic batching in the embeddings service, with and without, in one run.

    python benchmarks/batching.py --quick          # about 2 minutes on CPU
    python benchmarks/batching.py                  # more requests per cell
    python benchmarks/batching.py --out /tmp/batching.json

One private Redis; the service (``uvicorn gpulock_service.app:app``, one worker, 2 executor
threads, ``GPULOCK_DEVICE=cpu``) started twice with the real model (all-MiniLM-L6-v2):
``GPULOCK_BATCH=true`` and ``false``, each on its own pool. For 1, 8, 32 and 128 concurrent
clients (each on its own keep-alive connection, requests back to back, one sentence a
request) of short (6 tokens) and long (71 tokens) texts: sentences/s and the p50/p99
latency. The cells run batched and unbatched alternately, after one warm-up request each.

The overhead of a batch of one: two more services with the ``sleep`` test model at 0 s (the
model costs nothing, so what is left is the service's and gpulock's), batching on and off,
one client sending to them in turn (paired, so drift hits both), ``--overhead-n`` requests
each: the median of the paired differences.

Prints a Markdown table (docs/BENCHMARKS.md has this run's) and writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _util import machine_info, median, percentile  # noqa: E402

from gpulock.embedded import RedisProcess, free_port  # noqa: E402

SHORT = "the quick brown fox"
LONG = (
    "GPU memory is leased from a Redis-backed pool before each model call so that workers "
    "on one device never together ask for more than it has; requests that do not fit wait "
    "in a first-in first-out queue and are granted as soon as earlier leases are released "
    "again, with a heartbeat renewing every lease while its work runs"
)


class Svc:
    def __init__(self, redis_url: str, pool: str, env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        e = dict(os.environ)
        path = [str(ROOT), str(ROOT / "service"), str(ROOT / "clients" / "common")]
        e.update(
            {
                "PYTHONPATH": os.pathsep.join(path + [e.get("PYTHONPATH", "")]),
                "GPULOCK_REDIS_URL": redis_url,
                "GPULOCK_POOL": pool,
                "GPULOCK_CAPACITY": "8GiB",
                "GPULOCK_CONFIGURE": "set",
                "GPULOCK_DEVICE": "cpu",
                "GPULOCK_EXECUTOR_THREADS": "2",
                "GPULOCK_ACQUIRE_TIMEOUT": "300",
                "GPULOCK_INFERENCE_TIMEOUT": "300",
                "GPULOCK_STARTUP_TIMEOUT": "120",
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                **env,
            }
        )
        cmd = [sys.executable, "-m", "uvicorn", "gpulock_service.app:app"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, env=e, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("service not ready in time")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def cell(url: str, clients: int, n: int, text: str) -> dict[str, Any]:
    """``n`` requests (at least one per client) from ``clients`` concurrent clients."""
    lat: list[float] = []
    statuses: dict[int, int] = {}
    left = [max(n, clients)]

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            while left[0] > 0:
                left[0] -= 1
                t0 = time.perf_counter()
                r = await c.post("/v1/embeddings", json={"input": text})
                lat.append(time.perf_counter() - t0)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    return {
        "requests": len(lat),
        "sentences_per_s": len(lat) / wall,
        "p50_ms": percentile(lat, 50) * 1000,
        "p99_ms": percentile(lat, 99) * 1000,
        "statuses": statuses,
    }


async def overhead(on: str, off: str, n: int) -> dict[str, Any]:
    lat: dict[str, list[float]] = {"on": [], "off": []}
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(20):  # warm-up
            for u in (on, off):
                await c.post(u + "/v1/embeddings", json={"input": SHORT})
        for i in range(n):
            order = (("on", on), ("off", off)) if i % 2 == 0 else (("off", off), ("on", on))
            for k, u in order:
                t0 = time.perf_counter()
                r = await c.post(u + "/v1/embeddings", json={"input": SHORT})
                lat[k].append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text
    p50 = {k: median(v) * 1000 for k, v in lat.items()}
    paired = [(a - b) * 1000 for a, b in zip(lat["on"], lat["off"])]
    return {
        "n": n,
        "p50_on_ms": p50["on"],
        "p50_off_ms": p50["off"],
        "overhead_ms": median(paired),  # the median of the paired differences
    }


def table(R: dict[str, Any]) -> str:
    lines = [
        "| texts | clients | sentences/s unbatched | batched | speed-up | p50 / p99 ms unbatched "
        "| batched |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in R["cells"]:
        off, on = row["off"], row["on"]
        lines.append(
            f"| {row['texts']} | {row['clients']} | {off['sentences_per_s']:.1f} | "
            f"{on['sentences_per_s']:.1f} | {on['sentences_per_s'] / off['sentences_per_s']:.2f}x "
            f"| {off['p50_ms']:.0f} / {off['p99_ms']:.0f} | {on['p50_ms']:.0f} / {on['p99_ms']:.0f} |"
        )
    o = R["overhead"]
    lines.append("")
    lines.append(
        f"Batch of one, sleep model at 0 s, one client, {o['n']} paired requests: p50 "
        f"{o['p50_on_ms']:.2f} ms batched vs {o['p50_off_ms']:.2f} ms unbatched; median of the "
        f"paired differences **{o['overhead_ms']:+.2f} ms**."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests per cell")
    ap.add_argument("--clients", default="1,8,32,128")
    ap.add_argument("--overhead-n", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON results file")
    a = ap.parse_args(argv)
    base = 24 if a.quick else 200
    n_over = a.overhead_n or (600 if a.quick else 3000)
    clients = [int(x) for x in a.clients.split(",")]
    redis = RedisProcess().start()
    svcs: list[Svc] = []
    try:
        model = {"GPULOCK_MODEL": "minilm", "GPULOCK_TORCH_THREADS": "2"}
        sleep = {"GPULOCK_MODEL": "sleep", "GPULOCK_SLEEP_SECONDS": "0", "GPULOCK_RESIDENT": "0"}
        on = Svc(redis.url, "b-on", {**model, "GPULOCK_BATCH": "true"})
        off = Svc(redis.url, "b-off", {**model, "GPULOCK_BATCH": "false"})
        s_on = Svc(redis.url, "s-on", {**sleep, "GPULOCK_BATCH": "true"})
        s_off = Svc(redis.url, "s-off", {**sleep, "GPULOCK_BATCH": "false"})
        svcs = [on, off, s_on, s_off]
        for s in svcs:
            s.wait_ready()
        R: dict[str, Any] = {"machine": machine_info(), "quick": a.quick, "cells": []}
        print("overhead of a batch of one ...", file=sys.stderr)
        R["overhead"] = asyncio.run(overhead(s_on.url, s_off.url, n_over))
        for s in (s_on, s_off):
            s.stop()
        for texts, text in (("short", SHORT), ("long", LONG)):
            for c in clients:
                n = max(base, c if a.quick else 2 * c)
                row: dict[str, Any] = {"texts": texts, "clients": c}
                for k, s in (("off", off), ("on", on)):
                    asyncio.run(cell(s.url, 1, 1, text))  # warm-up
                    row[k] = asyncio.run(cell(s.url, c, n, text))
                print(f"{texts} x{c}: {row}", file=sys.stderr)
                R["cells"].append(row)
        text = table(R)
        R["table"] = text
        print(text)
        if a.out:
            Path(a.out).write_text(json.dumps(R, indent=1))
    finally:
        for s in svcs:
            s.stop()
        redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
