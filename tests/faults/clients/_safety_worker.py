"""One OS process of the safety-invariant test (run as a script, not collected by pytest).

Usage: python _safety_worker.py URL POOL OUT SEED START_AT DURATION MAX_AMOUNT

Loops acquire -> hold (random) -> release with random amounts until DURATION seconds after
START_AT (a time.time() instant shared by all workers). For each cycle it appends one line to
OUT:  t_req_us t_grant_us t_release_us amount token lost
where the times come from Redis ``TIME`` on a separate connection:
  t_req     right before the acquire is sent   (a lower bound of the server's grant time)
  t_grant   right after the acquire returned   (an upper bound of the server's grant time)
  t_release right before the release is sent   (a lower bound of the server's release time)
so [t_grant, t_release] lies inside the lease's true interval on the server clock.
"""

import random
import sys
import time

import redis

from gpulock import LeaseLost, Pool


def server_us(c: redis.Redis) -> int:
    s, us = c.time()
    return int(s) * 1_000_000 + int(us)


def main() -> None:
    url, pool_name, out, seed, start_at, duration, max_amount = sys.argv[1:8]
    rng = random.Random(int(seed))
    start_at, duration, max_amount = float(start_at), float(duration), int(max_amount)
    clock = redis.Redis.from_url(url)
    pool = Pool.from_url(url, pool_name)
    f = open(out, "a", buffering=1)  # line-buffered: one append per cycle
    time.sleep(max(0.0, start_at - time.time()))
    end = time.time() + duration
    while time.time() < end:
        amount = rng.randint(1, max_amount)
        t_req = server_us(clock)
        lease = pool.acquire(amount, ttl=10, timeout=60)
        t_grant = server_us(clock)
        time.sleep(rng.choice((0, 0, rng.uniform(0, 0.002), rng.uniform(0, 0.03))))
        t_rel = server_us(clock)
        lost = 0
        try:
            lease.release()
        except LeaseLost:
            lost = 1
        f.write(f"{t_req} {t_grant} {t_rel} {amount} {lease.token} {lost}\n")
    f.close()
    pool.close()
    clock.close()


if __name__ == "__main__":
    main()
