"""Client disconnects while many acquires wait (issue 9 item 8, found by the churn soak): the
server drops a process's hand-off subscription (``CLIENT KILL``, as a proxy, a failover or a
``timeout`` setting would); Redis itself stays up and answers, so no waiting acquire may fail
with BackendUnavailable, and the pool drains at the end.

The process is the churn soak's crowd (``_soak_worker.py crowd``: one AsyncPool, 300 acquires
waiting at once); the test kills its subscription connection several times, each once the
process has subscribed again (read on the server's CLIENT LIST), never after a fixed sleep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from gpulock import Pool
from support.pools import check_consistent, raw
from support.waiting import wait_until

from ._soak import WORKER, _redis_conns

pytestmark = pytest.mark.timeout(120)


def test_waiters_survive_a_killed_subscription(redis_proc1, tmp_path):
    url, name, out = redis_proc1.url, "soak", tmp_path / "crowd.log"
    with Pool.from_url(url, name) as p:
        p.configure(100)
    c = redis.Redis.from_url(url)
    end_at = time.time() + 30.0
    env = {**os.environ, "GPULOCK_SOAK_CROWD": "300", "GPULOCK_SOAK_MAX_CONNECTIONS": "8"}
    pr = subprocess.Popen(
        [sys.executable, str(WORKER), url, name, str(out), "1", repr(end_at), "60", "0", "crowd"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )

    def subscription():
        mine = _redis_conns(pr.pid, redis_proc1.port)
        subs = [  # classic (Redis 6.2) or sharded (Redis >= 7, Valkey) subscriptions
            x
            for x in c.client_list()
            if x["addr"] in mine and int(x.get("sub", 0)) + int(x.get("ssub", 0))
        ]
        return subs[0] if subs else None

    def grants() -> int:
        return out.read_text().count("\nG ")

    try:
        # Each kill, then more than waiter_ttl + backend_timeout (1 + 5 s) of waiting: a waiter
        # left behind by the lost subscription would fail within that time.
        for _ in range(2):
            sub = wait_until(subscription, timeout=10)
            seen = grants()
            wait_until(lambda: grants() > seen + 200, timeout=10)  # grants flow before the kill
            c.client_kill_filter(_id=sub["id"])
            t_kill = time.monotonic()
            wait_until(
                lambda: (s := subscription()) is not None and s["id"] != sub["id"], timeout=10
            )
            wait_until(
                lambda: time.monotonic() > t_kill + 7.5 or "\nE " in out.read_text(), timeout=10
            )
            assert "\nE " not in out.read_text(), [
                ln for ln in out.read_text().splitlines() if ln[0] == "E"
            ][:2]
        kills = 2
        os.kill(pr.pid, signal.SIGTERM)
        pr.wait(30)
    finally:
        if pr.poll() is None:
            pr.kill()
            pr.wait()
    lines = out.read_text().splitlines()
    errors = [ln for ln in lines if ln.startswith("E ")]
    grants = sum(ln.startswith("G ") for ln in lines)
    print(f"\n{kills} subscription kills, {grants} grants, {len(errors)} errors")
    assert kills == 2
    assert not errors, f"{len(errors)} waiting acquires failed although Redis was up: {errors[:2]}"
    t0 = time.monotonic()
    while check_consistent(c, name) != {"used": 0, "leases": 0, "queued": 0}:
        raw(c, name, "reap")
        assert time.monotonic() - t0 < 5, check_consistent(c, name)
        time.sleep(0.05)
    c.close()
