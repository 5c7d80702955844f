"""kill -9 of a holder whose growth is queued (docs/SEMANTICS.md, "Resizing a lease";
invariant 2): its bytes come back at its lease's server expiry (with the growth, which the
release of the other holder grants to the dead lease before it expires), the queue empties,
and the waiter queued behind it is granted. Read on the raw keys."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import redis

from gpulock import Pool
from support.pools import check_consistent
from support.waiting import wait_until

# The killed holder's lease ttl. Its expiry is what frees the bytes, whatever its length; a
# 1 s lease expired before the growth queued when the holder process (or its heartbeat) was
# descheduled for a second on a loaded machine.
TTL_S = 3.0

_HOLDER = textwrap.dedent(
    """
    import sys, threading
    from gpulock import Pool
    url, name = sys.argv[1], sys.argv[2]
    pool = Pool.from_url(url, name)
    lease = pool.acquire(40, ttl=%s)
    print("held", flush=True)
    lease.resize(90)  # needs 50 more while another holds 60: queues, and is killed waiting
    """
    % TTL_S
)


@pytest.mark.timeout(60)
def test_holder_killed_while_its_growth_is_queued(redis_proc1):
    url, name = redis_proc1.url, "rkill"
    r = redis.Redis.from_url(url)
    queue = f"gpulock:{{{name}}}:queue"
    with Pool.from_url(url, name) as pool:
        pool.configure(100)
        other = pool.acquire(60)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        holder = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, url, name], env=env, stdout=subprocess.PIPE
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == b"held"
            wait_until(lambda: r.zcard(queue) == 1, 10, "the growth queued")
            got = []

            def take():
                got.append(pool.acquire(80, timeout=30))

            th = threading.Thread(target=take)
            th.start()
            wait_until(lambda: r.zcard(queue) == 2, 10, "the waiter queued behind the growth")
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(10)
            other.release()  # 60 free; the dead lease's 40 come back at its expiry
            th.join(TTL_S + 15)
            assert got and got[0].amount == 80
            assert r.zcard(queue) == 0
            check_consistent(r, name)
            got[0].release()
        finally:
            if holder.poll() is None:
                holder.kill()
    r.close()
