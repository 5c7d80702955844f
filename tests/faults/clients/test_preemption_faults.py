"""Preemption under faults (issue 33): a holder asked to yield that is killed (-9) or frozen
(SIGSTOP) during its grace, Redis restarted empty during a grace, and a waiter that times out
after asking.

The holder is a real process (_preempt_holder.py: priority 0, preemptible, heartbeating); the
urgent waiter (priority 10) is a pool object in this process. The promises checked, on the
server's own data (docs/SEMANTICS.md, "Preemption"):
* an asked lease's expiry never passes its deadline; nobody is granted its bytes before that
  expiry; once its holder is gone (killed or frozen) the waiter is granted, with a larger
  fencing token, and the pool stays consistent;
* a frozen holder resumed after its deadline finds its lease lost and its late release frees
  nothing of the next holder's;
* after Redis lost its data the holder re-asserts its lease, a cooperative holder still
  releases and the waiter is granted after the post-loss grace period; a re-asserted lease is
  a lease not yet asked: the head asks it again once that period is over;
* a waiter that goes away after asking leaves the ask standing; the bytes go to the next head.

Every wait is on observed state with a generous deadline (WAIT_S), never a bound on speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from gpulock import AcquireTimeout, LeaseLost, Pool
from gpulock.protocol.keys import pool_keys

from support.pools import check_consistent, config, holder_tokens
from support.preempt import enable_preemption
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

HOLDER = Path(__file__).with_name("_preempt_holder.py")
CAP = 100
TTL_S = 1.0  # the holder's ttl: at most the yield grace, so the deadline is the grace's end
GRACE_S = 1.5  # the yield grace
WAIT_S = 30.0  # a generous deadline for what must happen; never a bound on its speed


def _settle(r: redis.Redis) -> None:
    """Redis has run every command a stopped or killed client had already written: two round
    trips on our own connection (see test_fault_pause.settle)."""
    r.ping()
    r.ping()


class Holder:
    """The holder subprocess and its state file."""

    def __init__(self, url: str, name: str, tmp: Path, ttl: float = TTL_S):
        self.state, self.proceed = tmp / "state.json", tmp / "proceed"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(HOLDER),
                url,
                name,
                str(CAP),
                str(ttl),
                str(self.state),
                str(self.proceed),
            ],
            stderr=subprocess.PIPE,
            text=True,
        )

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.state.read_text())
        except (OSError, ValueError):
            return {}

    def wait_for(self, key: str) -> Any:
        return wait_until(lambda: self.read().get(key), timeout=WAIT_S, what=f"holder's {key}")

    def finish(self) -> dict[str, Any]:
        """Let it call ensure_valid and release, wait for its exit 0; its final state."""
        self.proceed.touch()
        _, err = self.proc.communicate(timeout=WAIT_S)
        assert self.proc.returncode == 0, err[-3000:]
        return self.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()


def _yield_mark(r: redis.Redis, name: str, lid: str) -> tuple[int, int] | None:
    """The server's yield mark of lease ``lid``: (asked_ms, deadline_ms), None when not asked."""
    v = r.hget(pool_keys(name)[6], "y:" + lid)
    if v is None:
        return None
    a, d = v.decode().split("|")
    return int(a), int(d)


def _expiry_ms(r: redis.Redis, name: str, lid: str) -> float | None:
    v = r.zscore(pool_keys(name)[1], lid)
    return None if v is None else float(v)


def _grant_ms(lease) -> float:
    return lease.expires_at * 1000 - lease.ttl * 1000  # the grant set exp = now + ttl


def _urgent(ex: ThreadPoolExecutor, pool: Pool, ttl: float = 30.0) -> Future:
    """The urgent request (priority 10) for the whole pool, in ``ex``."""
    return ex.submit(pool.acquire, CAP, ttl=ttl, priority=10, timeout=WAIT_S)


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_holder_killed_or_frozen_during_its_grace(redis_proc1, tmp_path, fault):
    """(a) kill -9 / (b) SIGSTOP of an asked holder during its grace: the waiter is granted
    once the lease expires, which is at its deadline at the latest; a frozen holder resumed
    afterwards finds its lease lost and its release frees nothing of the waiter's."""
    url, name = redis_proc1.url, f"pf-{fault}"
    r = redis.Redis.from_url(url)
    ex = ThreadPoolExecutor(1)
    with Pool.from_url(url, name, poll_interval=0.2) as pool:
        pool.configure(CAP)
        enable_preemption(r, name, 1, GRACE_S)
        h = Holder(url, name, tmp_path)
        try:
            lid = h.wait_for("granted")["id"]
            fut = _urgent(ex, pool)
            asked = h.wait_for("asked")  # the holder learnt it: now within its grace
            assert asked["yield_requested"] and asked["deadline_in_s"] is not None
            mark = _yield_mark(r, name, lid)
            assert mark is not None
            _, deadline_ms = mark
            os.kill(h.proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            if fault == "kill":
                h.proc.wait(WAIT_S)
            _settle(r)  # a renewal already sent has run: the expiry is final now
            final = _expiry_ms(r, name, lid)
            assert final is not None and final <= deadline_ms, (final, deadline_ms)

            got = fut.result(timeout=WAIT_S + 5)
            lag = _grant_ms(got) - final
            print(
                f"\n{fault}: granted {lag:+.1f} ms after the asked lease's last expiry "
                f"({final - deadline_ms:+.0f} ms from its deadline)"
            )
            assert lag >= 0, "granted before the asked lease expired"
            assert got.token > h.read()["granted"]["token"]
            assert [li.lease_id for li in pool.status().leases] == [got.id]
            assert config(r, name).get("y_taken") == 1 and config(r, name).get("y_asked") == 1

            if fault == "stop":
                os.kill(h.proc.pid, signal.SIGCONT)
                out = h.finish()
                print(
                    f"resumed holder: ensure_valid {out['ensure_valid']!r}; release "
                    f"{out['release']!r}; on_lost {out['lost']}"
                )
                assert out["ensure_valid"].startswith("LeaseLost")
                assert out["release"].startswith("LeaseLost")
                assert len(out["lost"]) == 1 and out["yield_requested_at_end"]
                st = pool.status()  # the late release freed nothing of the waiter's
                assert [li.lease_id for li in st.leases] == [got.id] and st.used == CAP
            got.ensure_valid()
            got.release()
            assert check_consistent(r, name) == {"used": 0, "leases": 0, "queued": 0}
        finally:
            ex.shutdown(wait=False, cancel_futures=True)
            h.kill()
    r.close()


def _restart_during_grace(redis_proc1, r: redis.Redis, name: str, h: Holder, lid: str, tok: int):
    """Restart Redis empty and wait until the holder re-asserted its lease (same id and token)
    in the pool made again, with the post-loss grace period open."""
    old_epoch = config(r, name)["epoch"]
    redis_proc1.restart()

    def back() -> bool:
        try:
            cfg = config(r, name)
            return cfg.get("epoch", old_epoch) != old_epoch and holder_tokens(r, name) == {lid: tok}
        except redis.ConnectionError:
            return False

    wait_until(back, timeout=WAIT_S, what="the lease re-asserted in the pool made again")
    assert config(r, name)["grace_until"] > 0
    assert _yield_mark(r, name, lid) is None  # a re-asserted lease is a lease not yet asked


MAX_TTL_S = 2.0  # the post-loss grace period is one max_ttl


def test_redis_restarted_during_a_grace_cooperative_holder(redis_proc1, tmp_path):
    """(c) Redis restarted empty while the asked holder is in its grace: the holder re-asserts
    its lease, the waiter queues again, the holder (told before the loss) still releases, and
    the waiter is granted after the post-loss grace period."""
    url, name = redis_proc1.url, "pf-restart-coop"
    r = redis.Redis.from_url(url)
    ex = ThreadPoolExecutor(1)
    with Pool.from_url(url, name, poll_interval=0.2) as pool:
        pool.configure(CAP, max_ttl=MAX_TTL_S)
        enable_preemption(r, name, 1, 30.0)  # a long grace: the restart lands inside it
        h = Holder(url, name, tmp_path)
        try:
            g = h.wait_for("granted")
            fut = _urgent(ex, pool, ttl=MAX_TTL_S)
            h.wait_for("asked")
            _restart_during_grace(redis_proc1, r, name, h, g["id"], g["token"])
            wait_until(
                lambda: pool.status().waiter_count == 1,
                timeout=WAIT_S,
                what="the waiter queued again",
            )
            out = h.finish()  # the cooperative holder releases now
            assert out["ensure_valid"] == "ok" and out["release"] == "ok", out
            assert out["yield_requested_at_end"] and not out["lost"]
            got = fut.result(timeout=WAIT_S)
            assert _grant_ms(got) >= config(r, name)["grace_until"]
            assert got.token > g["token"]
            got.release()
            assert check_consistent(r, name) == {"used": 0, "leases": 0, "queued": 0}
        finally:
            ex.shutdown(wait=False, cancel_futures=True)
            h.kill()
    r.close()


def _uncooperative_after_restart(redis_proc1, tmp_path, name: str) -> None:
    url = redis_proc1.url
    r = redis.Redis.from_url(url)
    ex = ThreadPoolExecutor(1)
    with Pool.from_url(url, name, poll_interval=0.2) as pool:
        pool.configure(CAP, max_ttl=MAX_TTL_S)
        enable_preemption(r, name, 1, 30.0)
        h = Holder(url, name, tmp_path)
        try:
            g = h.wait_for("granted")
            fut = _urgent(ex, pool, ttl=MAX_TTL_S)
            h.wait_for("asked")
            _restart_during_grace(redis_proc1, r, name, h, g["id"], g["token"])
            # the operator's `pool set --preempt-gap` again, on the pool made again (which
            # process makes it again, and with the settings it last saw, is a race: a short
            # grace here, whoever made it)
            enable_preemption(r, name, 1, GRACE_S)
            # Once the post-loss grace period is over the head asks the re-asserted lease again.
            mark = wait_until(
                lambda: _yield_mark(r, name, g["id"]),
                timeout=WAIT_S,
                what="the re-asserted lease asked again",
            )
            asked_ms, deadline_ms = mark
            assert asked_ms >= config(r, name)["grace_until"]
            got = fut.result(timeout=WAIT_S)
            assert _grant_ms(got) >= deadline_ms - GRACE_S * 1000
            assert got.token > g["token"]
            out = h.finish()
            assert out["ensure_valid"].startswith("LeaseLost"), out
            assert out["release"].startswith("LeaseLost"), out
            st = pool.status()
            assert [li.lease_id for li in st.leases] == [got.id] and st.used == CAP
            got.release()
            assert check_consistent(r, name) == {"used": 0, "leases": 0, "queued": 0}
        finally:
            ex.shutdown(wait=False, cancel_futures=True)
            h.kill()
    r.close()


def test_redis_restarted_uncooperative_holder_asked_again(redis_proc1, tmp_path):
    """(c) The uncooperative holder after Redis lost its data, on a pool whose preemption
    setting is set again after the loss: its re-asserted lease is asked again by the head
    once the post-loss grace period is over, and is taken back at that ask's deadline."""
    _uncooperative_after_restart(redis_proc1, tmp_path, "pf-restart-unco")


def test_waiter_that_times_out_after_asking(redis_proc1):
    """(d) An urgent waiter asks the holder, then times out: the ask stands (same deadline),
    nobody asks again, and the bytes go to the next head (a waiter that could not have asked)
    when the lease is taken back at its deadline."""
    url, name = redis_proc1.url, "pf-timeout"
    r = redis.Redis.from_url(url)
    ex = ThreadPoolExecutor(2)
    with Pool.from_url(url, name, poll_interval=0.2) as pool:
        pool.configure(CAP)
        enable_preemption(r, name, 1, 3.0)
        holder = pool.acquire(CAP, ttl=TTL_S, priority=0)  # uncooperative: it only renews
        nxt = ex.submit(pool.acquire, CAP, ttl=30, priority=0, timeout=WAIT_S)  # cannot ask
        wait_until(lambda: pool.status().waiter_count == 1, timeout=WAIT_S, what="next queued")
        assert _yield_mark(r, name, holder.id) is None
        with pytest.raises(AcquireTimeout):
            pool.acquire(CAP, ttl=30, priority=10, timeout=0.5)  # asks when it queues
        mark = _yield_mark(r, name, holder.id)
        assert mark is not None, "the urgent waiter did not ask"
        wait_until(lambda: holder.yield_requested, timeout=WAIT_S, what="the holder told")
        assert [w.priority for w in pool.status().waiters] == [0]  # the next head
        assert _yield_mark(r, name, holder.id) == mark  # the ask stands, its deadline too
        got = nxt.result(timeout=WAIT_S)
        assert _grant_ms(got) >= mark[1]
        assert _yield_mark(r, name, holder.id) is None and got.token > holder.token
        cfg = config(r, name)
        assert cfg.get("y_asked") == 1 and cfg.get("y_taken") == 1
        with pytest.raises(LeaseLost):
            holder.ensure_valid()
        got.release()
        assert check_consistent(r, name) == {"used": 0, "leases": 0, "queued": 0}
    ex.shutdown(wait=False, cancel_futures=True)
    r.close()
