"""kill -9 of a ``gpulock run`` holder (holder crash, docs/RELIABILITY.md, invariant 2).

The waiter queued behind the dead holder must be granted right after the dead lease's server
expiry — by a timer set to that expiry, not by a poll — and within ttl + 1 s of the kill.
The CMD child of the killed ``gpulock run`` must not keep running (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time

import pytest
import redis

from gpulock import Pool
from support.pools import server_ms
from support.procs import alive, gpulock_argv
from support.waiting import wait_until

TTL_S = 2.0
ROUNDS = 3


@pytest.mark.timeout(90)
def test_kill_9_of_gpulock_run_holder(redis_proc1, tmp_path):
    url, name = redis_proc1.url, "kill"
    r = redis.Redis.from_url(url)
    leases_key = f"gpulock:{{{name}}}:leases"
    lags, kill_to_grant, kill_to_grant_server = [], [], []
    with Pool.from_url(url, name) as pool:
        pool.configure(100)
        for rnd in range(ROUNDS):
            pidfile = tmp_path / f"cmd{rnd}.pid"
            holder = subprocess.Popen(
                [
                    *gpulock_argv(),
                    "run",
                    "--pool",
                    name,
                    "--amount",
                    "100",
                    "--ttl",
                    str(TTL_S),
                    "--",
                    "sh",
                    "-c",
                    f"echo $$ > {pidfile}; exec sleep 60",
                ],
                env={**os.environ, "GPULOCK_REDIS_URL": url},
                stderr=subprocess.PIPE,
            )
            try:
                wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=10)
                cmd_pid = int(pidfile.read_text())
                st = pool.status()
                assert st.used == 100 and st.leases[0].holder["pid"] == holder.pid
                dead_id = st.leases[0].lease_id
                # The expiry in force is a renewed one: wait for 1 + rnd renewals, seen on the
                # server (not slept for).
                for _ in range(1 + rnd):
                    before = float(r.zscore(leases_key, dead_id))
                    wait_until(
                        lambda b=before: float(r.zscore(leases_key, dead_id)) > b, timeout=10
                    )

                # The waiter: queued behind the holder before the kill.
                from concurrent.futures import ThreadPoolExecutor

                ex = ThreadPoolExecutor(1)
                fut = ex.submit(pool.acquire, 60, ttl=30, timeout=TTL_S + 5)
                wait_until(lambda: pool.status().waiter_count == 1, timeout=10)

                kill_server = server_ms(r)
                t_kill = time.monotonic()
                os.kill(holder.pid, signal.SIGKILL)
                holder.wait(5)
                # A renewal the holder had already sent has run on the server now (Redis
                # handles every readable connection of a loop turn before answering a later
                # command): two round trips, not a sleep.
                r.ping()
                r.ping()
                dead_expiry = float(r.zscore(leases_key, dead_id))  # server ms, final

                lease = fut.result(timeout=TTL_S + 6)
                t_granted = time.monotonic()
                ex.shutdown()
                grant_ms = lease.expires_at * 1000 - lease.ttl * 1000  # exp = now + ttl at grant
                lags.append(grant_ms - dead_expiry)
                kill_to_grant.append(t_granted - t_kill)
                kill_to_grant_server.append((grant_ms - kill_server) / 1000)

                # The CMD child did not outlive its gpulock run (PR_SET_PDEATHSIG = SIGKILL).
                wait_until(lambda: not alive(cmd_pid), timeout=2.0)
                st = pool.status()
                assert [li.lease_id for li in st.leases] == [lease.id] and st.used == 60
                assert st.reaped_leases == rnd + 1
                lease.release()
                assert pool.status().used == 0
            finally:
                if holder.poll() is None:
                    holder.kill()
                    holder.wait()
                if pidfile.exists() and pidfile.read_text().strip():
                    try:
                        os.kill(int(pidfile.read_text()), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    r.close()
    print(
        f"\nkill -9 of gpulock run (ttl {TTL_S}s), {ROUNDS} rounds:"
        f"\n  reclaim lag (grant - dead lease's server expiry) ms: "
        f"{[round(x, 1) for x in lags]} (median {statistics.median(lags):.1f})"
        f"\n  kill -> grant (waiter's monotonic clock) s: {[round(x, 3) for x in kill_to_grant]}"
        f"\n  kill -> grant (server clock) s: {[round(x, 3) for x in kill_to_grant_server]}"
    )
    for lag, k2g, k2g_s in zip(lags, kill_to_grant, kill_to_grant_server):
        assert lag >= 0, "granted before the dead lease expired: the dead lease was not honoured"
        # Never as late as the backstop poll (every 1 s) plus a loaded machine's scheduling.
        assert lag <= 1500, f"reclaim lag {lag:.1f} ms"
        assert k2g <= TTL_S + 2.0 and k2g_s <= TTL_S + 2.0
    # A timer at the expiry, not a poll: the median of the rounds, so that one round whose
    # waiter was descheduled on a loaded 2-core CI box does not decide (a 1 s poll would put
    # two of three rounds past 250 ms most of the time); the project aims at p50 <= 5 ms.
    assert statistics.median(lags) <= 250, f"reclaim lag median {statistics.median(lags):.1f} ms"
