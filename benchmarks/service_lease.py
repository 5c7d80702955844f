#!/usr/bin/env python
"""The service's lease overhead per request, kept bytes off and on: the time the FastAPI
integration spends on a request's lease (its acquire and its release), p50 and p99.

    python benchmarks/service_lease.py            # 3 cases x 3 modes, 2,000 requests each; ~1 min
    python benchmarks/service_lease.py --quick    # 200 requests each (the smoke test); ~10 s

It starts its own ``redis-server`` on a free loopback port and, in this process, three
FastAPI apps with a :class:`gpulock.fastapi.GpuLimiter` each (pools of 64 GiB, 4 executor
threads, a route whose model takes 0 s): ``off`` (keep=0, the default), ``keep``
(``keep=--keep``, default 30 s) and ``disabled`` (``enabled=False``: the same executor hop, no
lease). Requests go through httpx's ASGI transport, in slices that alternate between the modes
(so drift on a shared machine hits each alike). Cases:

* **1 client, one size**: sequential requests of 1 MiB (the steady state kept bytes are for);
* **4 clients, one size**: 4 clients at once, each sending sequential requests of 1 MiB;
* **1 client, two sizes**: sequential requests alternating 1 and 2 MiB, each sent once the
  previous one's release is done: the idle kept lease never fits the next request, so it is
  given back first (an extra round trip before the acquire: the worst case of keeping).

What is timed, on this process's ``time.perf_counter``: the integration's acquire
(``GpuLimiter.admission.lease``: the pool's acquire with the ttl bound) and the release of the
lease it returned (``AsyncLease.release``, which the job runner runs in a task of its own once
the work is done; the answer goes out meanwhile), per request, summed ("lease"); and each
request's client-side latency. A wait for Redis is in these times, and so is what the event
loop ran meanwhile (the answer of the same request, other clients' requests): a grant or a
release from kept bytes does not wait, so its time is its own. "Redis acquires per request" is
the pool's grant counter (read from Redis) over the requests; "from kept bytes" the pool
object's own count. Numbers, the
machine and the command go to ``--json`` (default ``benchmarks/results/service_lease.json``)
and a table to stdout; the target (p50 of acquire + release under 0.05 ms with keep on, 1
client, one size) is printed with its verdict, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _util import machine_info, percentile  # noqa: E402

import gpulock  # noqa: E402
from gpulock.embedded import RedisProcess, find_server_binary  # noqa: E402

MiB = 2**20
GiB = 2**30
MODES = ("off", "keep", "disabled")
CASES = (  # label, clients, sizes in turn, each release done before the next request
    ("1 client, one size", 1, (MiB,), False),
    ("4 clients, one size", 4, (MiB,), False),
    ("1 client, two sizes", 1, (MiB, 2 * MiB), True),
)
TARGET_S = 0.05e-3  # p50 of acquire + release, keep on, 1 client, one size


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


class Timed:
    """One mode's app, its limiter, and the lease times it recorded (seconds)."""

    def __init__(self, url: str, mode: str, keep_s: float):
        from fastapi import FastAPI

        from gpulock.fastapi import GpuLimiter

        self.mode = mode
        self.gpu = GpuLimiter(
            url,
            f"lease-{mode}",
            capacity=64 * GiB,
            executor_threads=4,
            keep=keep_s if mode == "keep" else 0.0,
            enabled=mode != "disabled",
            exit_on_fatal=False,
        )
        self.app = FastAPI(lifespan=self.gpu.lifespan)
        self.acquire: list[float] = []
        self.release: list[float] = []
        self.lease: list[float] = []  # acquire + release of one request
        self.recording = False
        self.sent = 0  # requests sent to it (the next size goes on from there)

        @self.app.post("/r")
        @self.gpu.endpoint("r", estimate=lambda mib: mib * MiB)
        def route(mib: int) -> dict:  # the 0 s model
            return {}

        self._hook()

    def _hook(self) -> None:
        """Time the integration's acquire (``admission.lease``); the lease it returns is paired
        with its release (:func:`hook_release`)."""
        adm = self.gpu.admission
        lease0 = adm.lease
        clock = time.perf_counter

        async def lease(*a: Any, **kw: Any) -> Any:
            t0 = clock()
            got = await lease0(*a, **kw)
            dt = clock() - t0
            if self.recording:
                self.acquire.append(dt)
                _ACQUIRED[id(got)] = (self, dt)
            return got

        adm.lease = lease  # type: ignore[method-assign]

    def reset(self) -> None:
        self.acquire, self.release, self.lease = [], [], []


#: The leases acquired while recording, by ``id()``: their mode and acquire time (s).
_ACQUIRED: dict[int, tuple[Timed, float]] = {}


def hook_release() -> None:
    """Time every ``AsyncLease.release`` of this process (the job runner's release of a
    request's lease runs it in a task of its own) and pair it with the lease's acquire."""
    from gpulock._async import AsyncLease

    release0 = AsyncLease.release
    clock = time.perf_counter

    async def release(self: Any) -> None:
        t0 = clock()
        await release0(self)
        dt = clock() - t0
        got = _ACQUIRED.pop(id(self), None)
        if got is not None and got[0].recording:
            got[0].release.append(dt)
            got[0].lease.append(got[1] + dt)

    AsyncLease.release = release  # type: ignore[method-assign]


async def drive(t: Timed, client: Any, case: tuple, n: int, out: list[float]) -> None:
    """``n`` requests of ``case`` from its clients at once (each sequential), its sizes in
    turn; each request's latency (s) appended to ``out``. A case that settles waits for each
    request's release before the next request."""
    _, clients, sizes, settles = case
    per = [n // clients + (1 if i < n % clients else 0) for i in range(clients)]

    async def one_client(k: int) -> None:
        for _ in range(k):
            mib = sizes[t.sent % len(sizes)] // MiB
            t.sent += 1
            t0 = time.perf_counter()
            r = await client.post("/r", params={"mib": mib})
            out.append(time.perf_counter() - t0)
            if settles:
                await settle(t)
            if r.status_code != 200:
                raise RuntimeError(f"request answered {r.status_code}: {r.text[:300]}")

    await asyncio.gather(*(one_client(k) for k in per))


async def settle(t: Timed) -> None:
    """Let the releases that went out after their answers finish (each job ends after its
    release)."""
    deadline = time.monotonic() + 10.0
    while t.gpu.jobs.all:
        if time.monotonic() > deadline:
            raise RuntimeError(f"a request's job did not end: {t.gpu.jobs.all}")
        await asyncio.sleep(0)


async def run_case(
    timed: dict[str, Timed], clients_of: dict[str, Any], case: tuple, a: argparse.Namespace
) -> dict[str, Any]:
    from gpulock.fastapi._kept import kept_counts

    label, clients, sizes, _ = case
    out: dict[str, Any] = {"case": label, "clients": clients, "sizes": list(sizes), "modes": {}}
    latency: dict[str, list[float]] = {m: [] for m in MODES}
    grants0: dict[str, int] = {}
    kept0: dict[str, int] = {}
    for m, t in timed.items():  # warm-up, unrecorded; then the counters' start
        await drive(t, clients_of[m], case, a.warmup, [])
        await settle(t)
        t.reset()
        grants0[m] = (await t.gpu.backend.pool.status(limit=0)).grants
        kept0[m] = kept_counts(t.gpu.backend.pool)["grants"]
    per_slice = max(1, a.requests // a.slices)
    for s in range(a.slices):
        order = MODES if s % 2 == 0 else tuple(reversed(MODES))
        for m in order:
            timed[m].recording = True
            await drive(timed[m], clients_of[m], case, per_slice, latency[m])
            await settle(timed[m])
            timed[m].recording = False
    for m, t in timed.items():
        n = len(latency[m])
        row: dict[str, Any] = {"requests": n, "latency_s": latency[m]}
        if m != "disabled":
            st = await t.gpu.backend.pool.status(limit=0)
            row.update(
                acquire_s=t.acquire,
                release_s=t.release,
                lease_s=t.lease,
                redis_grants=st.grants - grants0[m],
                kept_grants=kept_counts(t.gpu.backend.pool)["grants"] - kept0[m],
            )
        out["modes"][m] = row
    return out


def ms(xs: list[float], q: float) -> str:
    return f"{percentile(xs, q) * 1000:.3f}" if xs else "-"


def table(R: dict[str, Any]) -> list[str]:
    cols = [
        "case",
        "mode",
        "requests",
        "acquire p50/p99 (ms)",
        "release p50/p99 (ms)",
        "lease p50/p99 (ms)",
        "request p50/p99 (ms)",
        "Redis acquires/request",
        "from kept bytes",
    ]
    rows = []
    for c in R["cases"]:
        for m in MODES:
            r = c["modes"][m]
            n = r["requests"]
            lat = f"{ms(r['latency_s'], 50)} / {ms(r['latency_s'], 99)}"
            if m == "disabled":
                rows.append([c["case"], m, str(n), "-", "-", "-", lat, "-", "-"])
                continue
            rows.append(
                [
                    c["case"],
                    m,
                    str(n),
                    f"{ms(r['acquire_s'], 50)} / {ms(r['acquire_s'], 99)}",
                    f"{ms(r['release_s'], 50)} / {ms(r['release_s'], 99)}",
                    f"{ms(r['lease_s'], 50)} / {ms(r['lease_s'], 99)}",
                    lat,
                    f"{r['redis_grants'] / max(1, n):.3f}",
                    f"{r['kept_grants'] / max(1, n):.1%}",
                ]
            )
    w = [max(len(x[i]) for x in [cols, *rows]) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w[i]) for i, c in enumerate(cols)).rstrip()]
    lines.append("  ".join("-" * w[i] for i in range(len(cols))))
    lines += ["  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() for r in rows]
    return lines


async def main_async(a: argparse.Namespace, url: str) -> dict[str, Any]:
    import httpx

    hook_release()
    timed = {m: Timed(url, m, a.keep) for m in MODES}
    clients_of: dict[str, Any] = {}
    for m, t in timed.items():
        await t.gpu.start()
        clients_of[m] = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=t.app), base_url="http://bench", timeout=30
        )
    try:
        cases = []
        for case in CASES:
            log(case[0])
            cases.append(await run_case(timed, clients_of, case, a))
        return {"cases": cases}
    finally:
        for m, t in timed.items():
            await clients_of[m].aclose()
            await t.gpu.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="200 requests a case and mode")
    ap.add_argument("--requests", type=int, default=None, help="requests a case and mode")
    ap.add_argument("--slices", type=int, default=10, help="alternating slices a case")
    ap.add_argument("--warmup", type=int, default=None, help="unrecorded requests first")
    ap.add_argument("--keep", type=float, default=30.0, help="the keep mode's keep= (seconds)")
    ap.add_argument("--json", default=str(HERE / "results" / "service_lease.json"))
    ap.add_argument("--redis-server", default=None, help="server binary (default: redis-server)")
    a = ap.parse_args(argv)
    a.requests = a.requests or (200 if a.quick else 2000)
    a.warmup = a.warmup if a.warmup is not None else (20 if a.quick else 100)
    logging.getLogger("gpulock").setLevel(logging.WARNING)
    binary = a.redis_server or find_server_binary("redis")
    R: dict[str, Any] = {
        "gpulock": gpulock.__version__,
        "machine": machine_info(),
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "keep_s": a.keep,
        "requests": a.requests,
        "slices": a.slices,
    }
    t_start = time.monotonic()
    with RedisProcess(binary) as rp:
        R["server"] = rp.url
        R.update(asyncio.run(main_async(a, rp.url)))
    R["runtime_s"] = time.monotonic() - t_start
    import os

    R["machine"]["loadavg_end"] = list(os.getloadavg())
    m = R["machine"]
    print(
        f"gpulock {R['gpulock']} service lease overhead ({R['runtime_s']:.0f} s); {m['cpu']}, "
        f"{m['cores']} cores; load {m['loadavg_start'][0]:.2f} -> {m['loadavg_end'][0]:.2f}; "
        f"keep {a.keep:g} s; 0 s model, in-process ASGI\n"
    )
    lines = table(R)
    R["table"] = lines
    print("\n".join(lines))
    keep = R["cases"][0]["modes"]["keep"]["lease_s"]
    p50 = percentile(keep, 50)
    verdict = "met" if p50 < TARGET_S else "MISS"
    print(
        f"\ntarget: lease (acquire + release) p50 under {TARGET_S * 1000:.2f} ms with keep on, "
        f"1 client, one size: {p50 * 1000:.4f} ms ({verdict})"
    )
    R["target"] = {"p50_s": p50, "target_s": TARGET_S, "met": p50 < TARGET_S}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(R))
    print(f"\nraw numbers: {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
