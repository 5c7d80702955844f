#!/usr/bin/env python
"""What kill -9 of a server with an append-only file loses, by ``appendfsync`` policy, and what
each policy costs a lease.

    python benchmarks/aof_kill.py --rounds 1000 --server embedded

For each policy (``no``, the one ``gpulock serve``'s embedded server uses; ``everysec``;
``always``): ``--rounds`` times, 300 ``INCR`` on one connection, each answered before the next
is sent, then kill -9 of the server right after the last answer, a restart on the same data
directory, and a comparison with the last answered value. Prints the rounds that lost answered
writes and how many, then the median and p99 of an ``acquire`` + ``release`` pair of the core on
each policy (and without persistence). Measurement tool only;
``tests/faults/server/test_restart_with_data.py`` pins the shipped policy's behaviour.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import redis

from gpulock import Pool
from gpulock.embedded import RedisProcess, find_server_binary

POLICIES = ("no", "everysec", "always")


def kills(binary: str, policy: str, rounds: int) -> tuple[int, int]:
    """``(rounds that lost answered writes, answered writes lost)``."""
    lost_rounds = lost = 0
    args = ["--appendfsync", policy]
    with RedisProcess(binary, data_dir=tempfile.mkdtemp(), extra_args=args) as rp:
        for _ in range(rounds):
            c = redis.Redis.from_url(rp.url)
            n = 0
            for _ in range(300):
                n = int(c.incr("n"))
            c.close()
            rp.restart()  # kill -9 right after the last answer
            c = redis.Redis.from_url(rp.url)
            got = int(c.get("n") or 0)
            if got != n:
                lost_rounds, lost = lost_rounds + 1, lost + n - got
                c.set("n", n)
            c.close()
    return lost_rounds, lost


def latency(binary: str, policy: str | None, n: int = 1500) -> tuple[float, float]:
    """Median and p99 (ms) of an acquire + release pair (the first 100 left out)."""
    kw: dict = {} if policy is None else {"data_dir": tempfile.mkdtemp()}
    args = [] if policy is None else ["--appendfsync", policy]
    with RedisProcess(binary, extra_args=args, **kw) as rp:
        p = Pool.from_url(rp.url, "aof")
        p.configure(100)
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            p.acquire(10).release()
            ts.append(time.perf_counter() - t)
        p.close()
    ts = sorted(ts[100:])
    return ts[len(ts) // 2] * 1000, ts[int(len(ts) * 0.99)] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1000)
    ap.add_argument("--server", choices=("embedded", "redis", "any"), default="embedded")
    a = ap.parse_args()
    binary = find_server_binary(a.server)
    print(binary)
    for policy in POLICIES:
        lr, lost = kills(binary, policy, a.rounds)
        print(
            f"appendfsync {policy:8}: {lr} of {a.rounds} kill -9s lost answered writes ({lost} writes)"
        )
    for policy in (None, *POLICIES):
        p50, p99 = latency(binary, policy)
        name = "no persistence" if policy is None else f"appendfsync {policy}"
        print(f"{name:20}: acquire+release median {p50:.3f} ms, p99 {p99:.3f} ms")


if __name__ == "__main__":
    main()
