"""Ownership (SEMANTICS.md invariant 4): only the holder renews or releases; an expired, unknown or
forged lease is reported lost and changes nothing of others."""

from __future__ import annotations

import asyncio
import time

import pytest

from gpulock import LeaseLost
from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys
from support.pools import GiB, assert_empty, raw, raw_acquire, raw_configure, snapshot, used


def test_raw_release_with_wrong_token_or_unknown_id_changes_nothing(rclient, pool_name):
    raw_configure(rclient, pool_name, 4 * GiB)
    g = raw_acquire(rclient, pool_name, GiB, ticket="a")
    lid, token = g[1].decode(), int(g[2])
    raw_acquire(rclient, pool_name, 3 * GiB, ticket="b")
    raw_acquire(rclient, pool_name, GiB, ticket="c")  # queued behind them
    before = snapshot(rclient)
    for forged_id, forged_token in [
        (lid, token + 1),
        (lid, token - 1),
        (lid, 0),
        (new_id(), token),
        ("0" * 32, 1),
    ]:
        r = raw(rclient, pool_name, "release", forged_id, forged_token)
        assert int(r[0]) == 0 and int(r[3]) == 0
        assert snapshot(rclient) == before
    # Renew of a forged lease reports it lost (0) and re-creates nothing.
    r = raw(rclient, pool_name, "renew", 2, lid, token + 1, 5000, new_id(), 1, 5000, 0)
    assert [int(x) for x in r[2]] == [0, 0]
    assert snapshot(rclient) == before
    # The real holder can release; the waiter gets the bytes.
    r = raw(rclient, pool_name, "release", lid, token)
    assert int(r[0]) == 1 and int(r[3]) == 1
    # Releasing it again: lost, nothing freed (the bytes are the waiter's now).
    after = snapshot(rclient)
    r = raw(rclient, pool_name, "release", lid, token)
    assert int(r[0]) == 0
    assert snapshot(rclient) == after
    assert used(rclient, pool_name) == 4 * GiB


def test_release_of_lease_on_unknown_pool(rclient):
    r = raw(rclient, "nopool", "release", new_id(), 1)
    assert int(r[0]) == 0
    assert snapshot(rclient) == {}


async def test_double_release_is_a_noop(make_apool, rclient, pool_name):
    pool = make_apool(capacity="2GiB")
    a = await pool.acquire("1GiB")
    b = await pool.acquire("1GiB")
    await a.release()
    await a.release()
    assert used(rclient, pool_name) == GiB
    async with a:  # exiting a released lease's context is a no-op too
        pass
    assert used(rclient, pool_name) == GiB
    await b.release()
    assert_empty(rclient, pool_name)


async def test_release_after_server_expiry_reports_lost_and_frees_nothing(
    make_apool, rclient, pool_name
):
    pool = make_apool(capacity=1)
    other = make_apool(capacity=1)
    lease = await pool.acquire(1, ttl=0.3)
    lost = []
    lease.on_lost(lost.append)
    # Stop its heartbeat: the runtime no longer renews it (a paused holder).
    pool._runtime.untrack(lease.id)
    t0 = time.monotonic()
    nxt = await other.acquire(1, timeout=5)  # granted when the server expires the lease
    assert 0.2 < time.monotonic() - t0 < 1.5
    with pytest.raises(LeaseLost):
        lease.ensure_valid()  # the local deadline passed before the server expired it
    before = snapshot(rclient)
    with pytest.raises(LeaseLost):
        await lease.release()
    assert snapshot(rclient) == before  # nxt's bytes were not freed
    assert used(rclient, pool_name) == 1
    assert lost == [lease]  # on_lost fired once
    await lease.release()  # still a no-op afterwards
    nxt.ensure_valid()
    await nxt.release()
    assert_empty(rclient, pool_name)


def test_sync_release_after_expiry_reports_lost(make_pool, rclient, pool_name):
    pool = make_pool(capacity=1)
    other = make_pool(capacity=1)
    lease = pool.acquire(1, ttl=0.3)
    pool._portal.call(_untrack(pool._runtime, lease.id))
    nxt = other.acquire(1, timeout=5)
    before = snapshot(rclient)
    with pytest.raises(LeaseLost):
        lease.release()
    assert snapshot(rclient) == before
    lease.release()
    nxt.release()
    assert_empty(rclient, pool_name)


async def _untrack(rt, lid):
    rt.untrack(lid)


async def test_renew_after_expiry_reports_lost_never_reacquires(make_apool, rclient, pool_name):
    pool = make_apool(capacity=1)
    lease = await pool.acquire(1, ttl=0.2)
    rt = pool._runtime
    rt.untrack(lease.id)
    await asyncio.sleep(0.35)  # expired on the server (the next script reaps it)
    keys = pool_keys(pool_name)
    assert rclient.zscore(keys[1], lease.id) is not None  # not reaped yet: expiry is lazy
    # Renew by the raw script: reported lost (0), the lease is reaped, not re-created.
    r = raw(rclient, pool_name, "renew", 1, lease.id, lease.token, 5000, 0)
    assert [int(x) for x in r[2]] == [0]
    assert rclient.zcard(keys[1]) == 0 and used(rclient, pool_name) == 0
    # Through the heartbeat, even with a local deadline that (wrongly) has not passed: the
    # server's answer marks it lost.
    st = lease._state
    st.valid_until = time.monotonic() + 100
    st.next_renew = 0
    rt.leases.add(st)
    rt.heartbeat.poke()
    for _ in range(200):
        if st.lost_reason:
            break
        await asyncio.sleep(0.01)
    assert "no longer has it" in st.lost_reason
    assert rclient.zcard(keys[1]) == 0 and used(rclient, pool_name) == 0  # not re-acquired
    with pytest.raises(LeaseLost):
        lease.ensure_valid()
    with pytest.raises(LeaseLost):
        await lease.release()
    assert_empty(rclient, pool_name)
