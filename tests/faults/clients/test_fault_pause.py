"""SIGSTOP a holder past its ttl, then SIGCONT it (holder pause, docs/RELIABILITY.md, invariants 4 and 5).

After resuming, the holder's ``ensure_valid()`` raises LeaseLost, its ``release()`` reports
LeaseLost, it frees none of the bytes the next holder now has, and its local validity deadline
lay before the server's expiry of its lease.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis

from gpulock import Pool
from support.pools import settle
from support.waiting import wait_until

TTL_S = 1.5
HOLDER = Path(__file__).with_name("_pause_holder.py")


@pytest.mark.timeout(60)
def test_sigstop_holder_past_ttl(redis_proc1, tmp_path):
    url, name = redis_proc1.url, "pause"
    state, proceed = tmp_path / "state.json", tmp_path / "proceed"
    r = redis.Redis.from_url(url)
    with Pool.from_url(url, name) as pool:
        pool.configure(100)
        holder = subprocess.Popen(
            [sys.executable, str(HOLDER), url, name, "60", str(TTL_S), str(state), str(proceed)],
            stderr=subprocess.PIPE,
            text=True,
        )
        ex = ThreadPoolExecutor(1)
        try:
            granted = wait_until(
                lambda: state.exists() and json.loads(state.read_text())["granted"], timeout=10
            )
            fut = ex.submit(pool.acquire, 60, ttl=30, timeout=TTL_S + 8)
            wait_until(lambda: pool.status().waiter_count == 1, timeout=10)
            # Past one heartbeat (ttl/3): the expiry in force is a renewed one (seen on the server).
            leases_key = f"gpulock:{{{name}}}:leases"
            first = float(r.zscore(leases_key, granted["id"]))
            wait_until(lambda: float(r.zscore(leases_key, granted["id"])) > first, timeout=10)

            os.kill(holder.pid, signal.SIGSTOP)
            t_stop = time.monotonic()
            settle(r)  # a renewal the holder had already sent has run on the server now
            server_expiry_ms = float(r.zscore(leases_key, granted["id"]))

            nxt = fut.result(timeout=TTL_S + 5)  # granted once the paused holder's lease expired
            next_grant_ms = round(nxt.expires_at * 1000) - round(nxt.ttl * 1000)  # server ms
            time.sleep(0.3)
            cont_wall_ms = time.time() * 1000  # the clock Redis TIME reads on this host
            os.kill(holder.pid, signal.SIGCONT)
            stopped_for = time.monotonic() - t_stop
            proceed.touch()
            _, err = holder.communicate(timeout=15)
            assert holder.returncode == 0, err
        finally:
            ex.shutdown(wait=False, cancel_futures=True)
            if holder.poll() is None:
                os.kill(holder.pid, signal.SIGCONT)
                holder.kill()
                holder.wait()
        out = json.loads(state.read_text())

        print(
            f"\nholder stopped for {stopped_for:.2f}s (ttl {TTL_S}s); after SIGCONT:"
            f"\n  ensure_valid: {out['ensure_valid']}\n  release: {out['release']}"
            f"\n  local validity deadline {(out['valid_until_wall'] * 1000 - server_expiry_ms):+.1f} ms "
            f"from the server expiry; next grant {next_grant_ms - server_expiry_ms:+.1f} ms from it"
        )
        # Stopped past its lease's expiry: SIGCONT went after the next grant, which the server
        # made at its expiry or later. (Not stopped_for > TTL_S: the last renewal ran up to
        # ttl/3 before the SIGSTOP, so the expiry can come before t_stop + ttl.)
        assert cont_wall_ms > next_grant_ms >= server_expiry_ms
        assert out["ensure_valid"].startswith("LeaseLost")
        assert out["release"].startswith("LeaseLost")
        assert len(out["on_lost_wall"]) == 1  # on_lost fired, once (late: the process was stopped)
        # The holder's last known server expiry is the server's own or an earlier one: a
        # renewal sent just before the SIGSTOP may have run on the server (moving the expiry
        # on by ttl/3) while its reply was never read. Never a later one. Its local deadline
        # came before the expiry it knows (Chubby's rule), by the drift and safety margins
        # (50 ms), so before the server's.
        known_expiry_ms = round(out["server_expiry_wall"] * 1000)
        assert known_expiry_ms <= server_expiry_ms
        assert out["valid_until_wall"] * 1000 < known_expiry_ms - 20
        assert next_grant_ms >= server_expiry_ms  # nobody got the bytes before the expiry

        # The stale holder's release freed nothing: the next holder's 60 bytes still count.
        st = pool.status()
        assert [li.lease_id for li in st.leases] == [nxt.id]
        assert st.used == 60 and st.lease_count == 1
        assert granted["token"] < nxt.token
        nxt.ensure_valid()
        nxt.release()
        assert pool.status().used == 0
    r.close()
