"""Kept bytes in the scripts (lua/release.lua 'keep' mode, lua/lib.lua "Kept bytes"), called
directly with raw ARGV in both forms (a script by EVAL, a function of the library by FCALL)
and through a pool object's script layer: the lease is kept only when it is the caller's, the
queue is empty, there is no grace period, and it is neither resident nor asked to yield; every
drop of a kept lease (release, reap) takes it off the kept list; a bad mode or channel is
refused with GPULOCK_BADARG and nothing written. And the whole cycle through a pool object on
a server without functions (EVALSHA). Run on every server kind."""

from __future__ import annotations

import asyncio

import pytest
import redis

from gpulock import AsyncPool
from gpulock.protocol.keys import pool_keys
from support.keep import cfg_int, check_kept_list, kept_channels, kept_ids, script_calls
from support.pools import (
    RAW_FORMS,
    check_consistent,
    raw_acquire,
    raw_configure,
    server_ms,
    snapshot,
)
from support.preempt import enable_preemption
from support.servers import RedisProcess
from support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.timeout(120)

CAP = 100
CHAN = "holder1"


def _grant(c: redis.Redis, pool: str, amount: int, **kw) -> tuple[str, int]:
    """A granted lease's id and token (raw acquire)."""
    r = raw_acquire(c, pool, amount, **kw)
    assert r[0] == 1, r
    return r[1].decode(), int(r[2])


def _release(form: str, c: redis.Redis, pool: str, lid: str, token: int, *mode: str) -> list:
    return RAW_FORMS[form](c, pool, "release", lid, token, *mode)


@pytest.fixture(params=list(RAW_FORMS))
def form(request) -> str:
    return request.param


def test_keep_mode_keeps_when_nobody_waits(rclient, pool_name, form):
    raw_configure(rclient, pool_name, CAP)
    lid, token = _grant(rclient, pool_name, 30)
    r = _release(form, rclient, pool_name, lid, token, "keep", CHAN)
    assert (r[0], r[2], r[3]) == (2, 30, 0)
    assert kept_ids(rclient, pool_name) == [lid] and kept_channels(rclient, pool_name) == [CHAN]
    # kept again: listed once, counted twice
    r = _release(form, rclient, pool_name, lid, token, "keep", CHAN)
    assert r[0] == 2 and kept_ids(rclient, pool_name) == [lid]
    assert cfg_int(rclient, pool_name, "k_kept") == 2
    # another token: not the caller's, nothing kept or freed
    r = _release(form, rclient, pool_name, lid, token + 1, "keep", CHAN)
    assert r[0] == 0 and cfg_int(rclient, pool_name, "used") == 30
    assert kept_ids(rclient, pool_name) == [lid]
    # a plain release ends it and takes it off the list (the field goes with the last one)
    other, otok = _grant(rclient, pool_name, 10)
    assert _release(form, rclient, pool_name, other, otok, "keep", "h2")[0] == 2
    assert kept_ids(rclient, pool_name) == [lid, other]
    assert _release(form, rclient, pool_name, lid, token)[0] == 1
    assert kept_ids(rclient, pool_name) == [other]
    assert _release(form, rclient, pool_name, other, otok, "")[0] == 1
    assert rclient.hget(pool_keys(pool_name)[0], "kept") is None
    assert cfg_int(rclient, pool_name, "used") == 0
    check_consistent(rclient, pool_name)


def test_keep_mode_releases_when_someone_waits(rclient, pool_name, form):
    raw_configure(rclient, pool_name, CAP)
    lid, token = _grant(rclient, pool_name, 60)
    kept, ktok = _grant(rclient, pool_name, 20)
    assert _release(form, rclient, pool_name, kept, ktok, "keep", "h2")[0] == 2
    q = raw_acquire(rclient, pool_name, 50, ticket="w1", channel="w")  # 60 + 20 + 50 > 100
    assert q[0] == 0
    assert cfg_int(rclient, pool_name, "k_told") == 1  # the kept one's holder was told
    r = _release(form, rclient, pool_name, lid, token, "keep", CHAN)
    assert (r[0], r[3]) == (1, 1)  # released, and the waiter granted
    assert kept_ids(rclient, pool_name) == [kept]
    assert cfg_int(rclient, pool_name, "used") == 70
    check_consistent(rclient, pool_name)
    check_kept_list(rclient, pool_name)


def test_keep_mode_releases_a_resident_lease(rclient, pool_name, form):
    raw_configure(rclient, pool_name, CAP)
    r = RAW_FORMS[form](
        rclient,
        pool_name,
        "acquire",
        "t1",
        "ab" * 16,
        30,
        60000,
        60000,
        "wait",
        "{}",
        CHAN,
        0,
        "",
        "",
        "resident",
    )
    assert r[0] == 1, r
    r = _release(form, rclient, pool_name, "ab" * 16, int(r[2]), "keep", CHAN)
    assert r[0] == 1 and kept_ids(rclient, pool_name) == []
    assert cfg_int(rclient, pool_name, "used") == 0
    check_consistent(rclient, pool_name)


def test_keep_mode_releases_in_a_grace_period(rclient, pool_name, form):
    raw_configure(rclient, pool_name, CAP)
    lid, token = _grant(rclient, pool_name, 30)
    # a grace period (as after Redis lost the pool and it was made again), planted
    rclient.hset(pool_keys(pool_name)[0], "grace_until", int(server_ms(rclient)) + 60_000)
    r = _release(form, rclient, pool_name, lid, token, "keep", CHAN)
    assert r[0] == 1 and kept_ids(rclient, pool_name) == []
    assert cfg_int(rclient, pool_name, "k_kept") == 0


def test_keep_mode_releases_a_lease_asked_to_yield(rclient, pool_name, form):
    """The asker left the queue (its ask stands): nobody waits, yet the lease ends."""
    raw_configure(rclient, pool_name, CAP)
    enable_preemption(rclient, pool_name, 1, 30.0)
    lid, token = _grant(rclient, pool_name, 80)
    q = raw_acquire(rclient, pool_name, 50, ticket="w1", channel="w", priority=5)
    assert q[0] == 0
    assert cfg_int(rclient, pool_name, "y_asked") == 1
    RAW_FORMS[form](rclient, pool_name, "cancel", "w1")
    assert rclient.zcard(pool_keys(pool_name)[3]) == 0
    r = _release(form, rclient, pool_name, lid, token, "keep", CHAN)
    assert r[0] == 1 and kept_ids(rclient, pool_name) == []
    assert cfg_int(rclient, pool_name, "used") == 0 and cfg_int(rclient, pool_name, "y_done") == 1


def test_a_kept_lease_reaped_leaves_the_list(rclient, pool_name, form):
    raw_configure(rclient, pool_name, CAP)
    lid, token = _grant(rclient, pool_name, 30, ttl_ms=200)
    assert _release(form, rclient, pool_name, lid, token, "keep", CHAN)[0] == 2
    end = server_ms(rclient) + 250
    wait_until(lambda: server_ms(rclient) > end, 10, "the lease's expiry passed")
    RAW_FORMS[form](rclient, pool_name, "reap")
    assert kept_ids(rclient, pool_name) == [] and cfg_int(rclient, pool_name, "used") == 0
    check_consistent(rclient, pool_name)


@pytest.mark.parametrize(
    "mode, word",
    [
        (["bogus", CHAN], "mode"),
        (["KEEP", CHAN], "mode"),
        (["keep"], "channel"),
        (["keep", ""], "channel"),
        (["keep", "a b"], "channel"),
        (["keep", "x" * 33], "channel"),
        (["keep", "ch|an"], "channel"),
    ],
)
def test_a_bad_mode_or_channel_changes_nothing(rclient, pool_name, form, mode, word):
    raw_configure(rclient, pool_name, CAP)
    lid, token = _grant(rclient, pool_name, 30)
    kept, ktok = _grant(rclient, pool_name, 10)
    assert _release(form, rclient, pool_name, kept, ktok, "keep", CHAN)[0] == 2
    before = snapshot(rclient)
    with pytest.raises(redis.ResponseError) as ei:
        _release(form, rclient, pool_name, lid, token, *mode)
    assert str(ei.value).startswith("GPULOCK_BADARG") and word in str(ei.value), ei.value
    assert snapshot(rclient) == before


def test_a_bad_mode_through_the_pool_script_layer(make_pool, rclient, pool_name):
    pool = make_pool(capacity=CAP)
    lease = pool.acquire(30)
    before = snapshot(rclient)
    for mode in (["bogus", CHAN], ["keep", "a b"]):
        with pytest.raises(redis.ResponseError, match="GPULOCK_BADARG"):
            pool._scripts.call("release", [lease.id, str(lease.token), *mode])
        assert snapshot(rclient) == before
    lease.ensure_valid()
    lease.release()


def _calls(c: redis.Redis) -> dict[str, int]:
    st = c.info("commandstats")
    return {k: int(st.get(f"cmdstat_{k}", {}).get("calls", 0)) for k in ("fcall", "evalsha")}


def test_the_cycle_on_a_server_without_functions(server_binary):
    """Scripts (EVALSHA) instead of functions: a release kept, a grant from it with no call,
    another pool object's waiter gets the kept bytes at once."""
    no_functions = ["--rename-command", "FCALL", "", "--rename-command", "FUNCTION", ""]
    with RedisProcess(server_binary, extra_args=no_functions) as srv:
        c = redis.Redis.from_url(srv.url)

        async def run() -> None:
            async with (
                AsyncPool.from_url(srv.url, "sf", capacity=CAP, keep=3600) as holder,
                AsyncPool.from_url(srv.url, "sf") as other,
            ):
                await holder.configure(CAP)
                await holder.status()  # the settings read now, not in the background
                lease = await holder.acquire(60, ttl=60)
                await lease.release()
                assert kept_ids(c, "sf") == [lease.id]
                before = script_calls(c)
                again = await holder.acquire(60, ttl=60)
                assert again.id == lease.id and script_calls(c) == before
                task = asyncio.create_task(other.acquire(50, ttl=60, timeout=60))
                await async_wait_until(
                    lambda: holder._runtime.kept.counts()["draining"], 10, "the holder told"
                )
                await again.release()  # in use when told: goes to Redis at its release
                got = await asyncio.wait_for(task, 10)
                assert cfg_int(c, "sf", "used") == 50
                await got.release()

        asyncio.run(run())
        calls = _calls(c)
        assert calls["evalsha"] > 0 and calls["fcall"] == 0, calls
        check_consistent(c, "sf")
        c.close()


def test_keep_told_drops_stale_entries(rclient, pool_name, form):
    """A kept entry whose lease is gone without a drop (planted) is dropped by the next
    request that does not fit, and nobody is told of it."""
    raw_configure(rclient, pool_name, CAP)
    lid, token = _grant(rclient, pool_name, 90)
    rclient.hset(pool_keys(pool_name)[0], "kept", " " + "cd" * 16 + "|gone")
    q = RAW_FORMS[form](
        rclient, pool_name, "acquire", "w1", "ef" * 16, 50, 60000, 60000, "try", "{}", "w"
    )
    assert q[0] == 2  # refused, not queued
    assert kept_ids(rclient, pool_name) == [] and cfg_int(rclient, pool_name, "k_told") == 0
    assert _release(form, rclient, pool_name, lid, token)[0] == 1
