"""Redis restarts while a pool object holds kept bytes (docs/SEMANTICS.md, "Kept bytes";
docs/RELIABILITY.md, "Redis loses its data").

* Without its data: the holder's recovery puts its leases back (reassert), idle kept ones
  too; the grace period (its renewals' replies show it) makes it give the idle kept ones back
  and stop granting from kept bytes; nothing is granted twice (the raw keys, sampled all
  along, never hold more than the capacity); after the grace period the pool works, and once
  the server answers "kept" again the holder grants from kept bytes again.
* With its data (the append-only file of ``gpulock serve``'s embedded server): the kept list
  is still there, and the 'k' path works after it: a request that does not fit is granted the
  moment the holder hears the server's message (its ttl and ``keep`` are 600 s: no renewal or
  expiry could give the bytes back in the waiter's timeout).
"""

from __future__ import annotations

import pytest
import redis
from faults.server.test_restart_grace import Sampler

from gpulock import Pool
from gpulock.protocol.keys import pool_keys
from support.pools import _s, check_consistent, server_ms
from support.servers import RedisProcess
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

TTL, G = 3.0, 10.0  # lease ttl; max_ttl = the grace period after a loss


def _kept(r: redis.Redis, name: str) -> list[str]:
    v = r.hget(pool_keys(name).cfg, "kept")
    return [] if v is None else [x.split("|")[0] for x in _s(v).split()]


def _holders(r: redis.Redis, name: str) -> dict[str, int]:
    """lease id -> token, from the raw holder records."""
    return {_s(k): int(_s(v).split("|")[1]) for k, v in r.hgetall(pool_keys(name).holders).items()}


def test_restart_without_data_gives_idle_kept_bytes_back_in_the_grace_period(redis_proc1):
    rp, name = redis_proc1, "keeprestart"
    r = redis.Redis.from_url(rp.url)
    samp = Sampler(rp.url, name)
    holder = Pool.from_url(
        rp.url, name, capacity=100, default_ttl=TTL, max_ttl=G, poll_interval=0.2, keep=60
    )
    other = Pool.from_url(rp.url, name, capacity=100, default_ttl=TTL, max_ttl=G)
    try:
        a = holder.acquire(20)
        b = holder.acquire(30)
        b.release()
        inuse = holder.acquire(30)  # from b's kept bytes
        a.release()  # kept: idle
        assert inuse.id == b.id and inuse.token == b.token
        assert holder._bg is not None
        kept = holder._bg.rt.kept
        assert kept.counts()["idle"] == 1 and kept.counts()["grants"] == 1
        assert sorted(_kept(r, name)) == sorted([a.id, b.id])
        tokens = {a.id: a.token, b.id: b.token}
        old_epoch = holder.status().epoch

        rp.restart()  # a new, empty server on the same port
        # the lease in use is put back with its token; the idle one is given back, in the
        # grace period (the heartbeat that finds the pool lost gives it back, so it may or
        # may not have been put back first)
        wait_until(
            lambda: _holders(r, name) == {b.id: tokens[b.id]},
            30,
            "the lease in use put back and the idle kept one given back",
        )
        st = other.status()
        assert st.epoch != old_epoch and st.reasserted in (1, 2) and st.grace_left > 0, st
        grace_until = int(r.hget(pool_keys(name).cfg, "grace_until") or 0)
        assert server_ms(r) < grace_until, "given back after the grace period, not for it"
        assert kept.counts()["draining"] and kept.counts()["idle"] == 0, kept.counts()
        assert _holders(r, name) == {b.id: b.token}
        inuse.ensure_valid()

        # nothing new is granted in the grace period; after it, the rest is
        w = other.acquire(70, timeout=G + 30)
        assert w.token > max(tokens.values())
        assert round(w.expires_at * 1000) - round(w.ttl * 1000) >= grace_until
        # draining: the release goes to Redis in 'keep' mode, which keeps it (nobody waits)
        # and says so, and draining ends. (Its first try may meet a connection the restart
        # broke: the retry is a plain release, as a retry cannot know whether the first kept
        # it; the next release is then the one kept.)
        inuse.release()
        last = inuse
        for _ in range(3):
            if _kept(r, name):
                break
            last = holder.acquire(30)
            last.release()
        assert _kept(r, name) == [last.id] and not kept.counts()["draining"], kept.counts()
        grants = kept.counts()["grants"]
        again = holder.acquire(30)
        assert again.id == last.id and kept.counts()["grants"] == grants + 1  # kept bytes again
        again.release()
        w.release()
    finally:
        samp.stop()
        other.close()
        holder.close()
    assert samp.peak <= 100, samp.peak
    assert r.hget(pool_keys(name).cfg, "kept") is None  # close gave the idle one back
    assert check_consistent(r, name)["used"] == 0
    r.close()


def _numsub(r: redis.Redis, channel: str) -> int:
    try:
        got = r.execute_command("PUBSUB", "SHARDNUMSUB", channel)
    except redis.ResponseError:  # no sharded pub/sub: the scripts PUBLISH
        got = r.execute_command("PUBSUB", "NUMSUB", channel)
    return int(got[1])


def test_restart_with_data_keeps_the_kept_list_and_the_k_path(server_binary, tmp_path):
    long = 600.0
    with RedisProcess(server_binary, data_dir=tmp_path / "data") as rp:
        name = "keepdata"
        holder = Pool.from_url(rp.url, name, capacity=100, default_ttl=long, keep=long)
        other = Pool.from_url(rp.url, name)
        r = redis.Redis.from_url(rp.url)
        try:
            a = holder.acquire(60)
            a.release()
            assert _kept(r, name) == [a.id]
            assert holder._bg is not None
            channel = holder._bg.rt.channel
            wait_until(lambda: _numsub(r, channel) >= 1, 10, "the holder listening")
            rp.restart()  # kill -9, then a server on the same port and directory
            r = redis.Redis.from_url(rp.url)
            assert _kept(r, name) == [a.id]
            st = other.status()
            assert st.reasserted == 0 and st.grace_left == 0 and st.used == 60, st
            wait_until(lambda: _numsub(r, channel) >= 1, 30, "the holder listening again")
            told = int(r.hget(pool_keys(name).cfg, "k_told") or 0)
            with other.acquire(100, timeout=60):  # told, the holder gives its kept bytes back
                assert int(r.hget(pool_keys(name).cfg, "k_told") or 0) > told
            assert holder._bg.rt.kept.counts()["idle"] == 0 and _kept(r, name) == []
            assert check_consistent(r, name)["used"] == 0
        finally:
            other.close()
            holder.close()
            r.close()
