"""Kept bytes against a real server, blocking shell (docs/SEMANTICS.md, "Kept bytes"): a Pool
made with ``keep=`` keeps a released lease while nobody waits and grants its own next request
of the same kind from it without a script call; the server's 'k' message reaches it both while
one of its threads waits (the threads' own subscription reads it) and while none does (the
runtime's listener); a waiter in another Pool, or in a subprocess, is granted while the holder
does nothing; a lease in use goes back at its release; ``close()`` gives back the idle ones.

Every wait is on observed state with a generous deadline; "no round trip" is the server's own
count of script calls (``INFO commandstats``). Run on every server kind."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import redis

from gpulock import AcquireTimeout, InvalidArgument, Pool, Preemption
from gpulock.protocol.keys import pool_keys
from support.background import acquire_in_thread
from support.keep import (
    cfg_int,
    check_kept_list,
    kept_ids,
    script_calls,
    settings_known,
    status_kept,
)
from support.pools import check_consistent
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

CAP = 100
TTL = 60.0  # renewed every 20 s: no heartbeat call falls in the windows counted here
WAIT_S = 10.0  # a generous deadline for what must happen; never a bound on its speed


def _kept_idle(pool: Pool, amount: int, **kw) -> tuple[str, int]:
    """Acquire ``amount`` and release it with nobody waiting: kept. Returns its id, token."""
    lease = pool.acquire(amount, ttl=kw.pop("ttl", TTL), **kw)
    lid, token = lease.id, lease.token
    lease.release()
    assert pool._bg is not None and pool._bg.rt.kept.counts()["idle"] >= 1
    return lid, token


def _counts(pool: Pool) -> dict:
    assert pool._bg is not None
    return pool._bg.rt.kept.counts()


def test_a_release_with_nobody_waiting_keeps_the_lease(make_pool, rclient, pool_name):
    pool = make_pool(keep=30)
    pool.configure(CAP)
    pool.status()  # the pool's settings read now, not in the background later
    lid, token = _kept_idle(pool, 10)
    assert pool._bg is not None and settings_known(pool._bg.rt)
    assert cfg_int(rclient, pool_name, "used") == 10
    assert kept_ids(rclient, pool_name) == [lid]
    assert status_kept(rclient, pool_name) == (10, 1, 1, 0)
    before = script_calls(rclient)
    again = pool.acquire(10, ttl=TTL)
    assert script_calls(rclient) == before
    assert (again.id, again.token) == (lid, token)
    again.ensure_valid()
    again.release()
    with pool.lease(10, ttl=TTL) as third:
        assert (third.id, third.token) == (lid, token)
        third.ensure_valid()
    assert script_calls(rclient) == before
    c = _counts(pool)
    assert (c["idle"], c["grants"], c["kept"]) == (1, 2, 1)
    assert pool.status().used == 10
    check_consistent(rclient, pool_name)
    check_kept_list(rclient, pool_name)


def test_the_k_message_reaches_it_while_no_thread_waits(make_pool, rclient, pool_name):
    """The runtime's listener reads it: another Pool's acquire is granted while the holder
    does nothing (its next renewal is 20 s away, its keep time an hour)."""
    holder = make_pool(capacity=CAP, keep=3600)
    other = make_pool()
    lid, token = _kept_idle(holder, 60)
    got = other.acquire(50, ttl=TTL, timeout=WAIT_S)
    assert got.token > token
    c = _counts(holder)
    assert (c["idle"], c["given_back"], c["draining"]) == (0, 1, True)
    assert cfg_int(rclient, pool_name, "k_told") >= 1
    assert cfg_int(rclient, pool_name, "used") == 50
    got.release()
    lid2, _ = _kept_idle(holder, 60)  # keeping resumes
    assert kept_ids(rclient, pool_name) == [lid2] and not _counts(holder)["draining"]
    check_consistent(rclient, pool_name)


def test_the_k_message_reaches_it_while_a_thread_waits(make_pool, rclient, pool_name):
    """A thread of the holder waits (it reads the threads' subscription) while a lease
    granted from kept bytes is in use: the pool object is told, the lease stays held until
    its release, which goes to Redis and hands the bytes to the waiting thread."""
    pool = make_pool(capacity=CAP, keep=30)
    lid, token = _kept_idle(pool, 60)
    in_use = pool.acquire(60, ttl=TTL)
    assert (in_use.id, in_use.token) == (lid, token)
    told_on: list[str] = []
    assert pool._bg is not None
    kept = pool._bg.rt.kept
    give_back = kept.give_back

    def recording(drain: bool = True) -> list:
        told_on.append(threading.current_thread().name)
        return give_back(drain)

    kept.give_back = recording  # type: ignore[method-assign]
    # the runtime's listener reads the channel too: it is deaf to 'k' messages here, so
    # only the waiting thread's subscription can tell the pool object (the next renewal,
    # which would also see the queue, is 20 s away)
    pool._bg.rt.listener._wanted_back = None
    t, out = acquire_in_thread(pool, 50, ttl=TTL, timeout=60)
    wait_until(lambda: _counts(pool)["draining"], WAIT_S, "the holder told")
    assert told_on == [t.name]  # read by the waiting thread itself
    assert pool.status().waiter_count == 1 and t.is_alive()
    in_use.ensure_valid()
    before = script_calls(rclient)
    in_use.release()
    assert script_calls(rclient) > before
    t.join(WAIT_S)
    got = out["lease"]
    assert got.token > token and cfg_int(rclient, pool_name, "used") == 50
    assert kept_ids(rclient, pool_name) == []
    got.release()  # nobody waits: kept again
    assert kept_ids(rclient, pool_name) == [got.id]
    c = _counts(pool)
    assert (c["idle"], c["kept"], c["draining"]) == (1, 2, False)
    check_consistent(rclient, pool_name)


def test_a_waiter_in_a_subprocess_is_granted_while_the_holder_does_nothing(
    make_pool, redis_proc, rclient, pool_name
):
    holder = make_pool(capacity=CAP, keep=3600)
    _kept_idle(holder, 60)
    code = (
        "import sys\n"
        "from gpulock import Pool\n"
        "with Pool.from_url(sys.argv[1], sys.argv[2]) as p:\n"
        "    lease = p.acquire(50, ttl=60, timeout=float(sys.argv[3]))\n"
        "    print('granted', lease.token, flush=True)\n"
        "    lease.release()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, redis_proc.url, pool_name, str(WAIT_S)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("granted")
    c = _counts(holder)
    assert (c["idle"], c["given_back"]) == (0, 1)
    assert cfg_int(rclient, pool_name, "k_told") >= 1
    assert cfg_int(rclient, pool_name, "used") == 0
    check_consistent(rclient, pool_name)


def test_a_refused_try_tells_the_holder_and_a_retry_succeeds(make_pool, rclient, pool_name):
    holder = make_pool(capacity=CAP, keep=3600)
    other = make_pool()
    _kept_idle(holder, 60)
    with pytest.raises(AcquireTimeout):
        other.acquire(50, ttl=TTL, timeout=0)
    assert cfg_int(rclient, pool_name, "k_told") == 1

    def tried():
        try:
            return other.acquire(50, ttl=TTL, timeout=0)
        except AcquireTimeout:
            return None

    got = wait_until(tried, WAIT_S, "a try granted", interval=0.01)
    assert _counts(holder)["given_back"] == 1
    got.release()
    check_consistent(rclient, pool_name)


def test_a_growth_that_queues_behind_kept_bytes_gets_them(make_pool, rclient, pool_name):
    holder = make_pool(capacity=CAP, keep=3600)
    other = make_pool(capacity=CAP)
    lease = other.acquire(30, ttl=TTL)
    _kept_idle(holder, 60)
    lease.resize(70, timeout=WAIT_S)
    assert lease.amount == 70 and cfg_int(rclient, pool_name, "used") == 70
    assert _counts(holder)["given_back"] == 1
    lease.release()
    check_consistent(rclient, pool_name)


def test_a_try_growth_gets_the_own_idle_kept_bytes_back_first(make_pool, rclient, pool_name):
    pool = make_pool(capacity=CAP, keep=3600)
    lease = pool.acquire(30, ttl=TTL)
    _kept_idle(pool, 60)
    lease.resize(70, timeout=0)  # 30 + 60 + 40 > 100 while it is kept
    assert lease.amount == 70 and cfg_int(rclient, pool_name, "used") == 70
    assert kept_ids(rclient, pool_name) == [] and _counts(pool)["given_back"] == 1
    lease.release()
    check_consistent(rclient, pool_name)


def test_idle_kept_leases_go_back_after_keep_seconds(make_pool, rclient, pool_name):
    pool = make_pool(capacity=CAP, keep=0.5)
    _kept_idle(pool, 10, ttl=1.5)
    wait_until(
        lambda: cfg_int(rclient, pool_name, "used") == 0, WAIT_S, "the kept lease given back"
    )
    assert kept_ids(rclient, pool_name) == []
    assert _counts(pool)["given_back"] == 1


def test_close_gives_back_idle_kept_leases(redis_proc, rclient, pool_name):
    client = redis.Redis.from_url(redis_proc.url)
    pool = Pool(client, pool_name, capacity=CAP, keep=3600)
    try:
        _kept_idle(pool, 10)
        assert cfg_int(rclient, pool_name, "used") == 10
    finally:
        pool.close()
        client.close()
    assert cfg_int(rclient, pool_name, "used") == 0
    assert kept_ids(rclient, pool_name) == []
    with Pool.from_url(redis_proc.url, pool_name, keep=30) as p:
        _kept_idle(p, 10)
    assert cfg_int(rclient, pool_name, "used") == 0


def test_request_ids_resident_and_other_settings(make_pool, rclient, pool_name):
    pool = make_pool(capacity=CAP, keep=30)
    for kw in ({"request_id": "job-1"}, {"resident": True}):
        pool.acquire(10, ttl=TTL, **kw).release()
        assert cfg_int(rclient, pool_name, "used") == 0 and kept_ids(rclient, pool_name) == []
    for kw in ({"priority": 2}, {"tenant": "t1"}, {"ttl": 30.0}, {"preemptible": False}):
        lid, _ = _kept_idle(pool, 10)
        got = pool.acquire(10, **{"ttl": TTL, **kw})
        assert got.id != lid and cfg_int(rclient, pool_name, "used") == 10, kw
        got.release()
        assert kept_ids(rclient, pool_name) == [got.id]
        pool.acquire(10, **{"ttl": TTL, **kw}).release()  # from its own kept lease
        assert kept_ids(rclient, pool_name) == [got.id]
        check_consistent(rclient, pool_name)
        pool.acquire(5, ttl=TTL).release()  # gives it back, keeps a lease of 5
    check_kept_list(rclient, pool_name)


def test_a_request_id_or_resident_try_gets_the_kept_bytes_back_first(make_pool, rclient, pool_name):
    """Neither is granted from a kept lease; the idle ones go back before it asks Redis, so
    a try that fits only without them is granted (as without keep)."""
    pool = make_pool(capacity=CAP, keep=30)
    for kw in ({"request_id": "job-1"}, {"resident": True}):
        lid, _ = _kept_idle(pool, 60)
        got = pool.acquire(50, ttl=TTL, timeout=0, **kw)
        assert got.id != lid and kept_ids(rclient, pool_name) == [], kw
        assert cfg_int(rclient, pool_name, "used") == 50
        got.release()
        assert cfg_int(rclient, pool_name, "used") == 0
    check_consistent(rclient, pool_name)


def test_device_pins(make_pool, rclient, pool_name):
    pool = make_pool(keep=30)
    pool.configure(10, devices=2)
    pool.status()  # the pool's settings read now, not in the background later
    lid, _ = _kept_idle(pool, 6, device=1)
    assert pool._bg is not None and settings_known(pool._bg.rt)
    before = script_calls(rclient)
    with pool.lease(6, ttl=TTL, device=1) as same:
        assert (same.id, same.device) == (lid, 1)
    assert script_calls(rclient) == before
    other = pool.acquire(6, ttl=TTL, device=0)
    assert other.id != lid and other.device == 0
    assert [d.used for d in pool.status().devices] == [6, 0]
    other.release()
    check_consistent(rclient, pool_name)


@pytest.mark.parametrize("bad", [-1, "x", 10**9])
def test_bad_keep_is_refused_naming_it(redis_proc, bad):
    client = redis.Redis.from_url(redis_proc.url)
    try:
        with pytest.raises(InvalidArgument, match="keep"):
            Pool(client, "bk", keep=bad)
        with pytest.raises(InvalidArgument, match="keep"):
            Pool.from_url(redis_proc.url, "bk", keep=bad)
    finally:
        client.close()


def test_a_lease_asked_to_yield_is_not_kept(make_pool, rclient, pool_name):
    holder = make_pool(capacity=CAP, keep=30)
    asker = make_pool()
    holder.configure(CAP, preemption=Preemption(1, 30.0))
    lease = holder.acquire(80, ttl=TTL)
    with pytest.raises(AcquireTimeout):
        # queued long enough to ask, then gone (its ask stands)
        asker.acquire(50, ttl=TTL, priority=5, timeout=1.0)
    wait_until(lambda: lease.yield_requested, WAIT_S, "the holder asked")
    wait_until(lambda: rclient.zcard(pool_keys(pool_name)[3]) == 0, WAIT_S, "nobody queued")
    lease.release()
    assert cfg_int(rclient, pool_name, "used") == 0
    assert kept_ids(rclient, pool_name) == [] and cfg_int(rclient, pool_name, "k_kept") == 0
    check_consistent(rclient, pool_name)
