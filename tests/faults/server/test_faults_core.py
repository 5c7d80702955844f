"""SCRIPT FLUSH mid-run, Redis restarted empty, and the heartbeat (renewal, and a Redis that
stops answering for longer than the ttl)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpulock import LeaseLost
from support.pools import GiB, assert_empty, monotonic_of_wall, used
from support.waiting import async_wait_until, wait_until


def _flush(c) -> None:
    c.script_flush()
    c.function_flush()


async def test_script_flush_mid_run(make_apool, make_pool, rclient, pool_name):
    """SCRIPT FLUSH and FUNCTION FLUSH (the code of both forms gone, as after a restart
    without data) during a run: every operation loads it again and succeeds."""
    pool = make_apool(capacity="4GiB", poll_interval=0.1)
    spool = make_pool(capacity="4GiB")
    # ttl 3 s (renewed every 1 s): what is tested is the reload after NOSCRIPT, not a short
    # lease; at 0.6 s a heartbeat descheduled for 0.4 s on a loaded machine lost the lease.
    holder = await pool.acquire("3GiB", ttl=3)
    sholder = spool.acquire("1GiB", ttl=3)
    waiters = [asyncio.create_task(pool.acquire("2GiB")) for _ in range(3)]
    await async_wait_until(lambda: rclient.zcard(f"gpulock:{{{pool_name}}}:queue") == 3)
    _flush(rclient)
    # Heartbeats (renew at ttl/3) and waiter refreshes keep working through NOSCRIPT: both
    # holders renewed after the flush (observed, not slept for).
    a0, s0 = holder.expires_at, sholder.expires_at
    await async_wait_until(lambda: holder.expires_at > a0 and sholder.expires_at > s0, timeout=5)
    holder.ensure_valid()
    sholder.ensure_valid()
    _flush(rclient)
    await holder.release()
    _flush(rclient)
    sholder.release()
    await async_wait_until(lambda: sum(w.done() for w in waiters) == 2, timeout=2)  # both fit
    first = [w.result() for w in waiters if w.done()]
    (rest,) = [w for w in waiters if not w.done()]
    _flush(rclient)
    assert (await pool.status()).used == 4 * GiB
    _flush(rclient)
    await first[0].release()
    _flush(rclient)
    last = await asyncio.wait_for(rest, 2)
    _flush(rclient)
    await first[1].release()
    await last.release()
    _flush(rclient)
    assert spool.status().used == 0
    _flush(rclient)
    with spool.lease("1GiB", timeout=0):
        pass
    assert_empty(rclient, pool_name)


async def test_restart_empty_lease_put_back_and_tokens_forward(
    make_apool, redis_proc, rclient, pool_name
):
    """Redis restarts without its data (docs/RELIABILITY.md): the holder's next heartbeat finds the pool
    gone, makes it again with a grace period of one max_ttl and puts its lease back (same id
    and token); nothing new is granted before the grace period ends; tokens keep increasing.
    Several holders, processes and the other cases: tests/faults/server/test_restart_grace.py."""
    # ttl 3 s, grace 4 s: the held lease must stay valid across the restart (a redis-server
    # start can take over a second on a loaded machine; with ttl 0.9 s it had ~0.6 s).
    pool = make_apool(capacity="4GiB", default_ttl=3.0, max_ttl=4.0)
    other = make_apool(capacity="4GiB", default_ttl=3.0, max_ttl=4.0)
    tokens = []
    for _ in range(5):
        lease = await pool.acquire("1GiB")
        tokens.append(lease.token)
        await lease.release()
    held = await pool.acquire("1GiB", ttl=3.0)
    tokens.append(held.token)
    fired = []
    held.on_lost(fired.append)
    epoch = (await other.status()).epoch
    redis_proc.restart()  # a new, empty server on the same port
    # The next heartbeat (ttl/3 = 1 s) finds the pool gone and puts the lease back.
    await async_wait_until(lambda: rclient.hlen(f"gpulock:{{{pool_name}}}:holders") == 1, timeout=9)
    st = await other.status()
    assert st.capacity == 4 * GiB and st.epoch != epoch and st.reasserted == 1 and st.grace_left > 0
    assert [(li.lease_id, li.token) for li in st.leases] == [(held.id, held.token)]
    held.ensure_valid()
    # Another pool object's acquire is granted only once the grace period is over.
    fresh = await other.acquire("1GiB", timeout=10)
    assert (await other.status()).grace_left == 0
    # Tokens never go backwards across the restart.
    assert fresh.token > max(tokens)
    await fresh.release()
    await held.release()
    assert_empty(rclient, pool_name)
    assert fired == []


def test_restart_sync(make_pool, redis_proc, rclient, pool_name):
    pool = make_pool(capacity="4GiB", default_ttl=3.0, max_ttl=4.0)
    held = pool.acquire("1GiB", ttl=3.0)  # valid across the restart (see above)
    fired = []
    held.on_lost(fired.append)
    redis_proc.restart()
    wait_until(lambda: rclient.hlen(f"gpulock:{{{pool_name}}}:holders") == 1, timeout=9)
    held.ensure_valid()
    fresh = pool.acquire("1GiB", timeout=10)  # after the grace period
    assert fresh.token > held.token
    fresh.release()
    held.release()
    assert_empty(rclient, pool_name)
    assert fired == []


async def test_heartbeat_keeps_short_lease_alive(make_apool, rclient, pool_name):
    pool = make_apool(capacity=1)
    # 1.5 s, renewed every 0.5 s: short, with room for a loaded machine's scheduling delays
    # (at 0.6 s one late heartbeat lost the lease by chance).
    lease = await pool.acquire(1, ttl=1.5)
    first_expiry = lease.expires_at
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.0:
        lease.ensure_valid()
        st = await pool.status()
        assert st.used == 1 and st.leases[0].lease_id == lease.id
        assert st.leases[0].expires_in > 0
        await asyncio.sleep(0.1)
    assert lease.expires_at > first_expiry + 2.0  # moved forward with each renewal
    assert lease.valid_until > time.monotonic()
    await lease.release()
    assert_empty(rclient, pool_name)


def test_sync_heartbeat_keeps_short_lease_alive(make_pool, rclient, pool_name):
    pool = make_pool(capacity=1)
    with pool.lease(1, ttl=1.5) as lease:  # renewed every 0.5 s (see above)
        first = lease.expires_at
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.0:
            lease.ensure_valid()
            time.sleep(0.1)
        assert lease.expires_at > first + 1.0
    assert_empty(rclient, pool_name)


async def test_unreachable_redis_lost_locally_before_server_expiry(
    make_apool, redis_proc, rclient, pool_name
):
    """Redis stops answering (SIGSTOP) for longer than the ttl. ensure_valid() raises by the
    local deadline, which falls before the server's expiry; on_lost fires once, while Redis
    is still paused; afterwards the release reports lost and frees nothing."""
    pool = make_apool(capacity=1)
    ttl = 0.6
    lease = await pool.acquire(1, ttl=ttl)
    first = lease.expires_at
    await async_wait_until(lambda: lease.expires_at > first)  # one renewal done
    fired: list[float] = []
    lease.on_lost(lambda l: fired.append(time.monotonic()))
    t_local = time.monotonic()
    redis_proc.pause()
    try:
        # on_lost fires by itself at the local deadline (nobody calls ensure_valid here), even
        # though the heartbeat sits in a renew call that Redis does not answer.
        while not fired and time.monotonic() - t_local < ttl + 3.0:  # waits on on_lost (seen)
            await asyncio.sleep(0.005)
        assert len(fired) == 1, "on_lost did not fire while Redis was unreachable"
        deadline = lease.valid_until
        # At the deadline (a timer), not at the end of the hung renew call (5 s socket
        # timeout); the slack is for a loaded machine's scheduling of the callback.
        assert deadline <= fired[0] <= deadline + 1.0, fired[0] - deadline
        with pytest.raises(LeaseLost):
            lease.ensure_valid()
        raised_at = deadline
        await asyncio.sleep(max(0.0, t_local + ttl + 0.2 - time.monotonic()))  # paused past the ttl
    finally:
        redis_proc.resume()
    # The server expiry of the last renewal, on the local (monotonic) clock: the local deadline
    # came first (by the margin, at least). Redis TIME reads this host's wall clock, so the
    # expiry maps through monotonic_of_wall(), exact to a millisecond and never late. (Not
    # through a TIME round trip: the server's instant lies anywhere in the round trip, which a
    # loaded machine stretches past the ~56 ms margin; taking its start put the expiry early.)
    server_expiry_ms = lease._state.expires_ms
    local_equiv_of_server_expiry = server_expiry_ms / 1000.0 + monotonic_of_wall()
    assert raised_at < local_equiv_of_server_expiry, (
        raised_at - t_local,
        local_equiv_of_server_expiry - t_local,
    )
    # (Not fired[0] against the expiry: the margin is ~56 ms, and the callback's time is the
    # scheduling of this process; invariant 5 is about the deadline, checked just above.)
    # After the resume: the release reports lost and changes nothing.
    await asyncio.sleep(0.1)
    with pytest.raises(LeaseLost):
        await lease.release()
    assert len(fired) == 1
    assert used(rclient, pool_name) == 0
    assert_empty(rclient, pool_name)


def test_sync_unreachable_redis_fires_on_lost(make_pool, redis_proc, rclient, pool_name):
    pool = make_pool(capacity=1)
    lease = pool.acquire(1, ttl=0.6)
    fired: list[float] = []
    lease.on_lost(lambda l: fired.append(time.monotonic()))
    first = lease.expires_at
    wait_until(lambda: lease.expires_at > first)  # one renewal done
    redis_proc.pause()
    try:
        wait_until(lambda: fired, timeout=0.6 + 3.0)
        # at the deadline, with slack for the heartbeat thread's scheduling (see above)
        assert lease.valid_until <= fired[0] <= lease.valid_until + 1.0
        with pytest.raises(LeaseLost):
            lease.ensure_valid()
        time.sleep(0.5)
    finally:
        redis_proc.resume()
    with pytest.raises(LeaseLost):
        lease.release()
    assert len(fired) == 1
    assert_empty(rclient, pool_name)
