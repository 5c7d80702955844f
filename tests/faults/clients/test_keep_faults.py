"""Faults of a process that holds kept bytes (docs/SEMANTICS.md, "Kept bytes"): a kept lease
is an ordinary lease in Redis, so kill -9 and a pause past its ttl end it as any.

* kill -9 of the holder of an idle kept lease and of a grant from kept bytes in use: both come
  back at their server expiry (a waiter of another process is granted then, not before), the
  kept list forgets them, and nothing leaks (``used`` 0 once the waiter is done).
* SIGSTOP of that holder past its ttl, then SIGCONT: its idle kept lease was lost on its own
  clock before the server could expire it (its local validity deadline lies before the
  server's expiry, which lies before the waiter's grant), and the resumed holder does not
  grant from it: its next request of that size is a new lease from Redis (a new id, a token
  above the waiter's), with no grant from kept bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from gpulock import Pool
from gpulock.protocol.keys import pool_keys
from support.pools import _s, check_consistent, lease_expiries_ms, settle
from support.procs import kill_quietly
from support.waiting import wait_until

TTL_S = 1.5
HOLDER = Path(__file__).with_name("_keep_holder.py")

pytestmark = pytest.mark.timeout(90)


def _start(url: str, name: str, tmp_path: Path) -> tuple[subprocess.Popen, Path, Path, dict]:
    state, proceed = tmp_path / "state.json", tmp_path / "proceed"
    holder = subprocess.Popen(
        [sys.executable, str(HOLDER), url, name, str(TTL_S), str(state), str(proceed)],
        stderr=subprocess.PIPE,
        text=True,
    )
    got = wait_until(lambda: state.exists() and json.loads(state.read_text()), 30, "the holder")
    return holder, state, proceed, got


def _kept(r: redis.Redis, name: str) -> list[str]:
    v = r.hget(pool_keys(name).cfg, "kept")
    return [] if v is None else [x.split("|")[0] for x in _s(v).split()]


def _renewed(r: redis.Redis, name: str, lid: str) -> None:
    """Wait for one renewal of ``lease`` seen on the server: the expiry in force is a renewed one."""
    key = pool_keys(name).leases
    first = float(r.zscore(key, lid))
    wait_until(lambda: float(r.zscore(key, lid) or 0) > first, 10, "a renewal")


def test_kill_9_of_a_holder_of_kept_bytes(redis_proc1, tmp_path):
    url, name = redis_proc1.url, "keepkill"
    r = redis.Redis.from_url(url)
    with Pool.from_url(url, name) as pool:
        pool.configure(100)
        holder, _, _, got = _start(url, name, tmp_path)
        try:
            idle, used = got["idle"]["id"], got["used"]["id"]
            assert got["counts"]["idle"] == 1 and got["counts"]["grants"] == 1, got
            # both listed as kept on the server: the grant in use is the same lease
            assert sorted(_kept(r, name)) == sorted([idle, used])
            _renewed(r, name, idle)
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(10)
            settle(r)  # a renewal the holder had already sent has run now
            expiries = lease_expiries_ms(r, name, [idle, used])
            assert set(expiries) == {idle, used}, expiries

            lease = pool.acquire(100, timeout=TTL_S + 30)  # granted once both expired
            grant_ms = round(lease.expires_at * 1000) - round(lease.ttl * 1000)
            assert grant_ms >= max(expiries.values()), (grant_ms, expiries)
            assert _kept(r, name) == [] and r.hget(pool_keys(name).cfg, "kept") is None
            st = pool.status()
            assert [x.lease_id for x in st.leases] == [lease.id] and st.reaped_leases == 2
            lease.release()
            assert check_consistent(r, name) == {"used": 0, "leases": 0, "queued": 0}
        finally:
            kill_quietly(holder.pid)
            holder.wait()
    r.close()


def test_sigstop_of_a_holder_of_kept_bytes_past_its_ttl(redis_proc1, tmp_path):
    url, name = redis_proc1.url, "keeppause"
    r = redis.Redis.from_url(url)
    with Pool.from_url(url, name) as pool:
        pool.configure(100)
        holder, state, proceed, got = _start(url, name, tmp_path)
        try:
            idle, used = got["idle"]["id"], got["used"]["id"]
            _renewed(r, name, idle)
            os.kill(holder.pid, signal.SIGSTOP)
            settle(r)
            expiries = lease_expiries_ms(r, name, [idle, used])
            assert set(expiries) == {idle, used}, expiries
            # queued: the server tells the stopped holder (a message it reads when resumed)
            nxt = pool.acquire(100, timeout=TTL_S + 30)
            grant_ms = round(nxt.expires_at * 1000) - round(nxt.ttl * 1000)
            assert grant_ms >= max(expiries.values()), (grant_ms, expiries)
            cont_wall_ms = time.time() * 1000
            os.kill(holder.pid, signal.SIGCONT)
            nxt.release()  # room for the resumed holder's next request
            proceed.touch()
            _, err = holder.communicate(timeout=40)
            assert holder.returncode == 0, err
        finally:
            kill_quietly(holder.pid, signal.SIGCONT)
            kill_quietly(holder.pid)
            holder.wait()
        out = json.loads(state.read_text())
        # lost on its own clock first: its deadline came before the expiry it knew, which is
        # the server's own or an earlier one, before the waiter's grant, before the SIGCONT
        known_ms = round(out["server_expiry_wall"] * 1000)
        assert out["valid_until_wall"] * 1000 < known_ms <= expiries[idle] <= grant_ms
        assert grant_ms < cont_wall_ms
        # the resumed holder asked Redis: a new lease, after the waiter's; no grant from kept
        # bytes since the pause (1 before it: the grant in use)
        assert out["again"]["id"] not in (idle, used), out
        assert out["again"]["token"] > nxt.token > got["idle"]["token"], (out, nxt.token)
        assert out["counts_after"]["grants"] == 1, out
        st = pool.status()
        assert st.used == 0 and st.lease_count == 0, st
        assert _kept(r, name) == [] and check_consistent(r, name)["used"] == 0
    r.close()
