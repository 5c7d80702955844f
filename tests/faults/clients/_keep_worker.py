"""One OS process of the kept-bytes history test (run as a script, not collected by pytest).

Usage: python _keep_worker.py URL POOL OUT SEED START_AT DURATION

A pool object that keeps (``keep=5``) loops acquire -> hold (random) -> release until DURATION
seconds after START_AT, with amounts from a small set (a repeated amount is granted from kept
bytes; another one gives them back first) and now and then a ``try`` of a size that does not
fit (the holders of kept bytes are told). One JSON line per grant to OUT:
  {"lid", "token", "amount", "t_req", "t_grant", "t_rel", "kept", "acq_ms", "pid"}
times in server µs (Redis ``TIME`` on a connection of its own): t_req before the acquire,
t_grant after it returned, t_rel before the release; ``kept``: granted from kept bytes (the
pool object's grant counter moved); ``acq_ms``: the lease's grant ms in its holder record,
read right after the grant (the same lease in Redis since its first grant if it is unchanged).
"""

import json
import random
import sys
import time

import redis

from gpulock import AcquireTimeout, Pool
from gpulock.protocol.keys import pool_keys

AMOUNTS = (10, 10, 10, 20, 20, 30)


def server_us(c: redis.Redis) -> int:
    s, us = c.time()
    return int(s) * 1_000_000 + int(us)


def main() -> None:
    url, name, out, seed, start_at, duration = sys.argv[1:7]
    rng = random.Random(int(seed))
    clock = redis.Redis.from_url(url)
    holders = pool_keys(name).holders
    pool = Pool.from_url(url, name, keep=5, default_ttl=10)
    mine = rng.choice(AMOUNTS)
    f = open(out, "a", buffering=1)
    time.sleep(max(0.0, float(start_at) - time.time()))
    end = time.time() + float(duration)
    while time.time() < end:
        if rng.random() < 0.05:
            try:
                pool.acquire(95, timeout=0).release()  # does not fit: kept bytes are told
            except AcquireTimeout:
                pass
            continue
        amount = mine if rng.random() < 0.8 else rng.choice(AMOUNTS)
        before = pool._bg.rt.kept.grants if pool._bg is not None else 0
        t_req = server_us(clock)
        lease = pool.acquire(amount, timeout=60)
        t_grant = server_us(clock)
        kept = pool._bg is not None and pool._bg.rt.kept.grants > before
        rec = clock.hget(holders, lease.id)
        acq_ms = int(rec.decode().split("|")[2]) if rec is not None else -1
        tok = int(rec.decode().split("|")[1]) if rec is not None else -1
        time.sleep(rng.choice((0, 0, rng.uniform(0, 0.002), rng.uniform(0, 0.02))))
        t_rel = server_us(clock)
        lease.release()
        row = {
            "lid": lease.id,
            "token": lease.token,
            "server_token": tok,
            "amount": amount,
            "t_req": t_req,
            "t_grant": t_grant,
            "t_rel": t_rel,
            "kept": kept,
            "acq_ms": acq_ms,
            "pid": int(seed),
        }
        f.write(json.dumps(row) + "\n")
    f.close()
    pool.close()
    clock.close()


if __name__ == "__main__":
    main()
