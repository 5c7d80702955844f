"""What the lease adds to a request: ``python -m gpulock_service.overhead``.

Starts one Redis and two identical one-worker services in the same run — one leasing as usual,
one with ``GPULOCK_DISABLED=1`` (same executor hop, no lease) — and sends them requests one at a
time, alternating (A B B A ...) so that drift on a shared machine hits both alike. Reports the
client-side latency p50/p99 of each and their difference, and the server-side time from
arrival to grant (``Server-Timing: gpulock-wait``) of the leasing one. Uncontended: the pool is
large, so this is the lease's fixed cost (two Redis round trips: acquire, release), not waiting.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests per service")
    ap.add_argument(
        "--model", default="sleep", help="'sleep' (0 s of work: the overhead alone) or 'minilm'"
    )
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args(argv)

    import httpx

    from gpulock.embedded import RedisProcess, find_server_binary, free_port

    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="gpulock-overhead-")
    with RedisProcess(find_server_binary("any")) as redis:
        try:
            urls = {}
            for name, disabled in (("leased", "0"), ("disabled", "1")):
                port = free_port()
                env = dict(
                    os.environ,
                    GPULOCK_REDIS_URL=redis.url,
                    GPULOCK_POOL=f"overhead-{name}",
                    GPULOCK_CAPACITY="64GiB",
                    GPULOCK_MODEL=a.model,
                    GPULOCK_SLEEP_SECONDS="0",
                    GPULOCK_SLEEP_BYTES="1MiB",
                    GPULOCK_DISABLED=disabled,
                    GPULOCK_TORCH_THREADS="1",
                    PROMETHEUS_MULTIPROC_DIR=os.path.join(tmp, name),
                    HF_HUB_OFFLINE="1",
                )
                os.makedirs(env["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "uvicorn",
                            "gpulock_service.app:app",
                            "--port",
                            str(port),
                            "--log-level",
                            "warning",
                        ],
                        env=env,
                        start_new_session=True,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                urls[name] = f"http://127.0.0.1:{port}"
            clients = {n: httpx.Client(base_url=u, timeout=60) for n, u in urls.items()}
            deadline = time.monotonic() + 180
            for n, c in clients.items():
                while True:
                    try:
                        if c.get("/ready").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{n} service did not become ready")
                    time.sleep(0.2)
            body = {"input": ["The quick brown fox jumps over the lazy dog."] * a.batch}
            for c in clients.values():  # warm up
                for _ in range(50):
                    c.post("/v1/embeddings", json=body)
            lat: dict[str, list[float]] = {"leased": [], "disabled": []}
            waits: list[float] = []
            order = ["leased", "disabled"]
            for i in range(a.requests):
                for n in order if i % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    r = clients[n].post("/v1/embeddings", json=body)
                    lat[n].append(time.perf_counter() - t0)
                    assert r.status_code == 200, r.text
                    if n == "leased":
                        m = re.search(
                            r"gpulock-wait;dur=([0-9.]+)", r.headers.get("server-timing", "")
                        )
                        if m:
                            waits.append(float(m.group(1)) / 1000)

            def ms(x: float) -> str:
                return f"{x * 1000:.3f} ms"

            print(
                f"model={a.model} batch={a.batch} requests={a.requests} per service, sequential, alternating"
            )
            for n in ("leased", "disabled"):
                print(f"  {n:9s} p50 {ms(_pct(lat[n], 0.5))}  p99 {ms(_pct(lat[n], 0.99))}")
            print(
                f"  added by the lease: p50 {ms(_pct(lat['leased'], 0.5) - _pct(lat['disabled'], 0.5))}  "
                f"p99 {ms(_pct(lat['leased'], 0.99) - _pct(lat['disabled'], 0.99))}"
            )
            if waits:
                print(
                    f"  server-side arrival->grant (Server-Timing gpulock-wait): p50 {ms(_pct(waits, 0.5))}  "
                    f"p99 {ms(_pct(waits, 0.99))}"
                )
        finally:
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(20)
                except Exception:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
