"""Redis restarted without its data, back behind the same URL on another port, or down for a
while: the grace period (docs/RELIABILITY.md; issue 5 item 1).

What is promised (docs/RELIABILITY.md, "Redis loses its data"):
* a holder finds the loss at its next heartbeat (the pool's epoch is gone or changed); if the
  pool is gone it creates it again — with the capacity it was given or last saw — and opens a
  grace period of one ``max_ttl``; then it puts its leases back with their old ids, amounts
  and fencing tokens (``reassert.lua``), and keeps them: no ``on_lost``;
* during the grace period nothing new is granted (requests queue; ``timeout=0`` is refused);
  when it ends the queue moves on, and new tokens are above every token from before;
* a lease that cannot be put back (it does not fit, or it comes after the grace period) is
  lost, and its holder is told why;
* when Redis stays down, holders go to jeopardy (logged) and then lost on their own clocks
  (logged, ``on_lost``), and do not come back when Redis does.

The checks read the raw keys (holder records with their grant times, the pool's
``grace_until``) sampled all along, not gpulock's own view.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import redis

from gpulock import AcquireTimeout, AsyncPool, LeaseLost, Pool
from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys
from support.servers import RedisProcess
from support.pools import _s, check_consistent, raw, raw_acquire, snapshot
from support.proxy import Proxy
from support.waiting import wait_until


pytestmark = pytest.mark.timeout(90)

# Lease ttl and max_ttl (= the grace period) of the pool objects here. A held lease must stay
# locally valid across a Redis restart (a redis-server start can take over a second on a loaded
# machine; a lease renewed every TTL/3 has at least 2/3 TTL left when it begins), and the checks
# made during the grace period must all fit in it: neither is what is tested, so both leave
# room for a loaded machine (with 1 s and 2 s, a slow server start lost a lease).
TTL, G = 3.0, 5.0


class Sampler:
    """Reads a pool's raw keys every few ms on its own connection: the largest sum of held
    amounts, every (token, grant time) seen, and the pool's grace_until and epoch."""

    def __init__(self, url: str, pool: str):
        self.c = redis.Redis.from_url(url, socket_timeout=1)
        self.k = pool_keys(pool)
        self.peak = 0
        self.grants: dict[int, int] = {}  # token -> acquired_ms (server clock)
        self.cfgs: list[dict] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with self.c.pipeline(transaction=True) as p:
                    p.hgetall(self.k[2]).hmget(self.k[0], "epoch", "grace_until", "capacity")
                    holders, cfg = p.execute()
            except redis.RedisError:
                time.sleep(0.01)
                continue
            total = 0
            for v in holders.values():
                a, tok, acq = v.decode().split("|")[:3]
                total += int(a)
                self.grants.setdefault(int(tok), int(acq))
            self.peak = max(self.peak, total)
            if cfg[0] is not None:
                d = {"epoch": int(cfg[0]), "grace_until": int(cfg[1] or 0), "capacity": int(cfg[2])}
                if not self.cfgs or self.cfgs[-1] != d:
                    self.cfgs.append(d)
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(2)
        self.c.close()


def _grants_after(sampler: Sampler, epoch: int) -> dict[int, int]:
    return {t: a for t, a in sampler.grants.items() if t > epoch}


def test_restart_empty_holders_put_leases_back(redis_proc1, caplog):
    caplog.set_level(logging.WARNING, logger="gpulock")
    rp, name = redis_proc1, "grace"
    direct = redis.Redis.from_url(rp.url)
    samp = Sampler(rp.url, name)
    loop = asyncio.new_event_loop()
    apool = AsyncPool.from_url(
        rp.url, name, capacity=100, default_ttl=TTL, max_ttl=G, poll_interval=0.2
    )
    spool = Pool.from_url(rp.url, name, capacity=100, default_ttl=TTL, max_ttl=G, poll_interval=0.2)
    fresh = Pool.from_url(
        rp.url, name, capacity=100, default_ttl=TTL, max_ttl=G
    )  # never saw the pool
    try:
        h1 = loop.run_until_complete(apool.acquire(40, holder={"who": "h1"}, tenant="t1"))
        h2 = spool.acquire(30, tenant="t2")
        lost: list = []
        h1.on_lost(lost.append)
        h2.on_lost(lost.append)
        old = {h1.token, h2.token}
        old_epoch = spool.status().epoch
        waiter = loop.create_task(apool.acquire(50, timeout=20))  # 120 > 100: queued
        loop.run_until_complete(asyncio.sleep(0.2))
        assert not waiter.done()

        t_restart = time.monotonic()
        rp.restart()

        def both_back() -> bool:
            loop.run_until_complete(asyncio.sleep(0.02))  # let the async holder's heartbeat run
            return direct.hlen(pool_keys(name)[2]) >= 2

        wait_until(both_back, timeout=3 * TTL)
        back_s = time.monotonic() - t_restart
        st = spool.status()
        assert st.epoch != old_epoch and st.grace_left > 0 and st.reasserted == 2
        assert {(li.lease_id, li.token, li.amount) for li in st.leases} == {
            (h1.id, h1.token, 40),
            (h2.id, h2.token, 30),
        }
        assert (
            next(li for li in st.leases if li.lease_id == h1.id).holder.get("who") == "h1"
        )  # metadata kept
        # tenants kept, and what each holds counted again
        assert {li.lease_id: li.tenant for li in st.leases} == {h1.id: "t1", h2.id: "t2"}
        assert {t: u.used for t, u in st.tenants.items()} == {"t1": 40, "t2": 30}
        grace_end = int(direct.hget(pool_keys(name)[0], "grace_until"))
        # In the grace period: 30 bytes are free, but nothing new is granted, and a refusal
        # says it is the grace period (not a lack of memory), with a retry_after to its end.
        with pytest.raises(AcquireTimeout) as refused:
            fresh.acquire(20, timeout=0)
        e = refused.value
        assert "restart grace period" in str(e) and "bytes used" not in str(e), str(e)
        assert 0 < e.grace_left <= G and e.retry_after >= e.grace_left - 0.05, (e.grace_left, e)
        with pytest.raises(AcquireTimeout) as refused:  # a wait that runs out in it, likewise
            spool.acquire(20, timeout=0.2)
        assert "restart grace period" in str(refused.value) and refused.value.grace_left > 0
        assert 0 < spool.grace_left() <= G and 0 < fresh.grace_left() <= G
        for _ in range(5):
            h1.ensure_valid()
            h2.ensure_valid()
            loop.run_until_complete(asyncio.sleep(0.1))
        assert not waiter.done()

        # After the grace period: the waiter (queued again) is granted when bytes come free.
        h2.release()
        w = loop.run_until_complete(asyncio.wait_for(waiter, G + 5))
        f = fresh.acquire(10, timeout=G + 5)
        assert min(w.token, f.token) > max(old), "tokens went backwards across the restart"
        # The sampler thread polls every 5 ms but may lag on a loaded machine: let it see both.
        wait_until(lambda: {w.token, f.token} <= set(samp.grants), timeout=5)
        new_epoch = samp.cfgs[-1]["epoch"]
        late = _grants_after(samp, new_epoch)
        assert late and min(late.values()) >= grace_end, (late, grace_end)
        assert samp.peak <= 100
        assert not lost, "a holder lost its lease although it was put back"
        loop.run_until_complete(h1.release())
        loop.run_until_complete(w.release())
        f.release()
        assert check_consistent(direct, name) == {"used": 0, "leases": 0, "queued": 0}
        assert spool.status().grace_left == 0 and spool.grace_left() == 0
        msgs = [r.getMessage() for r in caplog.records]
        assert any("created it again" in m and "grace period" in m for m in msgs), msgs
        assert sum("put back after Redis lost the pool" in m for m in msgs) == 2
        print(
            f"\nrestart: both leases back {back_s:.2f}s after the restart (ttl {TTL}s, renew every {TTL / 3:.2f}s); "
            f"grace {G}s; first new grant {min(late.values()) - grace_end} ms after the grace end; "
            f"peak {samp.peak}/100"
        )
    finally:
        samp.stop()
        loop.run_until_complete(apool.aclose())
        loop.close()
        spool.close()
        fresh.close()
        direct.close()


def test_restart_empty_devices_and_each_lease_on_its_device_come_back(redis_proc1):
    """A pool of several devices lost with Redis's data is made again with its devices and
    placement as last seen (by a pool object that configured it and by one that only
    acquired), and each lease is put back on its own device, a resident one as resident."""
    rp, name = redis_proc1, "gdev"
    direct = redis.Redis.from_url(rp.url)
    loop = asyncio.new_event_loop()
    apool = AsyncPool.from_url(rp.url, name, default_ttl=TTL, max_ttl=G, poll_interval=0.2)
    spool = Pool.from_url(rp.url, name, default_ttl=TTL, max_ttl=G, poll_interval=0.2)
    try:
        loop.run_until_complete(apool.configure(devices=[40, 60, 60], placement="spread"))
        h1 = loop.run_until_complete(apool.acquire(30, device=0, resident=True))
        h2 = spool.acquire(50)  # spread: device 1 (60 free, the lowest index of the most free)
        assert (h1.device, h2.device) == (0, 1)
        wait_until(
            lambda: spool._runtime is not None and spool._runtime.recovery.policy_seen, timeout=5
        )
        rp.restart()

        def both_back() -> bool:
            loop.run_until_complete(asyncio.sleep(0.02))  # let the async holder's heartbeat run
            return direct.hlen(pool_keys(name)[2]) >= 2

        wait_until(both_back, timeout=3 * TTL)
        st = spool.status()
        assert [(d.capacity, d.used) for d in st.devices] == [(40, 30), (60, 50), (60, 0)]
        assert st.placement == "spread" and st.reasserted == 2
        assert {li.lease_id: li.device for li in st.leases} == {h1.id: 0, h2.id: 1}
        assert st.resident == 30  # and on device 0 (check_consistent)
        check_consistent(direct, name)
        loop.run_until_complete(h1.release())
        h2.release()
        assert check_consistent(direct, name) == {"used": 0, "leases": 0, "queued": 0}
    finally:
        loop.run_until_complete(apool.aclose())
        loop.close()
        spool.close()
        direct.close()


def test_devices_changed_by_another_process_come_back_as_changed(redis_proc1):
    """The devices a pool object saw were changed since by another process (their capacities
    while it holds a lease, then their count while the pool is idle): its next reply's
    capacity is not their sum, so it reads them again, and the pool it makes after Redis
    lost the data has the devices as changed, its lease on its device (not a pool whose
    capacity and devices disagree, which configure would refuse again and again)."""
    rp, name = redis_proc1, "gdev2"
    direct = redis.Redis.from_url(rp.url)
    holder = Pool.from_url(rp.url, name, default_ttl=TTL, max_ttl=G, poll_interval=0.2)

    def other(devices: str) -> None:  # another process's `gpulock pool set` (not this runtime)
        total = sum(int(c) for c in devices.split())
        raw(direct, name, "configure", total, 10000, "set", 0, 0, "", "", "", devices, "")

    try:
        holder.configure(devices=[10, 10])
        first = holder.acquire(5, device=1)
        rt = holder._runtime.recovery  # what the pool object last saw
        assert rt is not None
        wait_until(lambda: rt.policy_seen and rt.policy_seen.devices == "10 10", timeout=5)
        other("8 8")  # `gpulock pool set --capacity 8`: each device's
        first.release()
        other("20 20 20 20")  # idle: the count may change
        lease = holder.acquire(15, device=3)  # its reply says capacity 80, not 20
        wait_until(lambda: rt.policy_seen and rt.policy_seen.devices == "20 20 20 20", timeout=5)
        rp.restart()
        wait_until(
            lambda: lease.id in {_s(x) for x in direct.hkeys(pool_keys(name)[2])}, timeout=3 * TTL
        )
        st = holder.status()
        assert [(d.capacity, d.used) for d in st.devices] == [(20, 0), (20, 0), (20, 0), (20, 15)]
        assert {li.lease_id: li.device for li in st.leases} == {lease.id: 3}
        lease.release()
        assert check_consistent(direct, name) == {"used": 0, "leases": 0, "queued": 0}
    finally:
        holder.close()
        direct.close()


async def test_redis_back_on_another_port_behind_the_same_url(redis_proc1, default_binary):
    """The URL names a proxy (as a DNS name would): Redis comes back empty on another port and
    the name is repointed. Holders reconnect and put their leases back."""
    old = redis_proc1
    with Proxy(old.port) as px:
        p = AsyncPool.from_url(
            px.url, "moved", capacity=100, default_ttl=TTL, max_ttl=G, poll_interval=0.2
        )
        q = AsyncPool.from_url(
            px.url, "moved", capacity=100, default_ttl=TTL, max_ttl=G, poll_interval=0.2
        )
        a = await p.acquire(60)
        b = await q.acquire(40)
        lost: list = []
        a.on_lost(lost.append)
        b.on_lost(lost.append)
        with RedisProcess(default_binary) as new:
            old.kill()
            px.set_target(new.port)  # the name now points at the new, empty server
            t0 = time.monotonic()
            nd = redis.Redis.from_url(new.url)
            while nd.hlen(pool_keys("moved")[2]) < 2:
                assert time.monotonic() - t0 < 3 * TTL, "leases not put back on the new server"
                await asyncio.sleep(0.02)
            back_s = time.monotonic() - t0
            for _ in range(10):  # held across several renewals on the new server
                a.ensure_valid()
                b.ensure_valid()
                await asyncio.sleep(0.1)
            st = await p.status()
            assert st.used == 100 and {li.token for li in st.leases} == {a.token, b.token}
            await a.release()
            c = await q.acquire(60, timeout=G + 5)  # after the grace period
            assert c.token > max(a.token, b.token)
            await b.release()
            await c.release()
            assert not lost
            assert check_consistent(nd, "moved") == {"used": 0, "leases": 0, "queued": 0}
            nd.close()
        await p.aclose()
        await q.aclose()
    print(f"\nnew port behind the same URL: both leases back {back_s:.2f}s after the switch")


async def test_redis_down_for_longer_than_the_ttl(redis_proc1, caplog):
    """Holders go to jeopardy at the first failed renewal and lose their leases at their own
    local deadline, saying so; when Redis comes back (empty) they do not come back, and the
    pool object that knew the pool makes it again with a grace period."""
    caplog.set_level(logging.WARNING, logger="gpulock")
    rp = redis_proc1
    p = AsyncPool.from_url(
        rp.url,
        "down",
        capacity=100,
        default_ttl=TTL,
        max_ttl=G,
        poll_interval=0.2,
        backend_timeout=0.5,
    )
    lease = await p.acquire(70)
    lost_at: list[float] = []
    lease.on_lost(lambda _l: lost_at.append(time.monotonic()))
    first = lease.expires_at
    while lease.expires_at == first:  # one renewal (observed, not slept for)
        await asyncio.sleep(0.01)
    rp.kill()
    t_down = time.monotonic()
    while not lost_at and time.monotonic() - t_down < TTL + 5:  # waits on on_lost (seen)
        await asyncio.sleep(0.01)
    # The deadline of the last renewal the holder read (read now: a reply could still land
    # between a read before the kill and the kill).
    deadline = lease.valid_until
    # Lost at the deadline (the heartbeat's timer), not before; the upper slack is for a loaded
    # machine's scheduling of this process, not the deadline the code computed.
    assert lost_at and lost_at[0] >= deadline and lost_at[0] - deadline < 1.0, (lost_at, deadline)
    with pytest.raises(LeaseLost):
        lease.ensure_valid()
    msgs = [r.getMessage() for r in caplog.records]
    j = next(i for i, m in enumerate(msgs) if "in jeopardy" in m)
    lo = next(i for i, m in enumerate(msgs) if "lost:" in m and "local validity deadline" in m)
    assert j < lo, msgs
    await asyncio.sleep(0.5)
    rp.start()  # back, empty, on the same port
    t_back = time.monotonic()
    c = await p.acquire(30, timeout=G + 5)  # this pool object knew the pool: grace period first
    waited = time.monotonic() - t_back
    st = await p.status()
    assert [li.lease_id for li in st.leases] == [
        c.id
    ] and st.reasserted == 0  # the lost lease stayed lost
    assert waited >= G - 0.5, f"granted {waited:.2f}s after Redis came back: no grace period"
    await c.release()
    with pytest.raises(LeaseLost):
        await lease.release()
    await p.aclose()
    # Back, with no lease still held (the only one was lost): no "out of jeopardy" for leases.
    msgs = [r.getMessage() for r in caplog.records]
    assert not any("out of jeopardy" in m for m in msgs), msgs
    assert any(
        "Redis answers renewals again" in m and "no lease was still held" in m for m in msgs
    ), msgs
    print(
        f"\nRedis down: jeopardy logged, lost {lost_at[0] - t_down:.2f}s after Redis went away "
        f"(local deadline {deadline - t_down:+.2f}s); after it came back empty the next grant waited {waited:.2f}s "
        f"(grace {G}s)"
    )


def test_a_process_that_never_saw_the_pool_recreates_it_first(redis_proc1, default_binary):
    """The documented limit: a process that never saw the pool cannot know Redis lost it, so
    it creates the pool without a grace period and may be granted at once. The first holder
    that comes back then opens the grace period; a lease that no longer fits is lost, and its
    holder is told why.

    The holders reach Redis through a proxy (the URL they know); Redis comes back empty on
    another port, where the newcomer makes the pool and is granted while the holders still
    renew on the old server; only then is the proxy repointed. So the newcomer is first
    whatever the scheduling (acquiring after a restart on the same port raced the holders'
    next heartbeat)."""
    old, name = redis_proc1, "hole"
    with Proxy(old.port) as px, RedisProcess(default_binary) as rp:
        direct = redis.Redis.from_url(rp.url)
        a = Pool.from_url(px.url, name, capacity=100, default_ttl=TTL, max_ttl=G, poll_interval=0.2)
        b = Pool.from_url(px.url, name, capacity=100, default_ttl=TTL, max_ttl=G, poll_interval=0.2)
        ha = a.acquire(50)
        hb = b.acquire(40)
        why: list[str] = []
        ha.on_lost(lambda lz: why.append(lz._state.lost_reason))
        newcomer = Pool.from_url(rp.url, name, capacity=100, default_ttl=TTL, max_ttl=G)
        n = newcomer.acquire(55, timeout=0)  # on the empty server, before any holder is there
        old.kill()
        px.set_target(rp.port)  # the holders' URL now reaches the server that lost the pool
        wait_until(lambda: why and direct.hlen(pool_keys(name)[2]) == 2, timeout=3 * TTL)
        st = newcomer.status()
        # 55 + 50 > 100: a's lease cannot come back (lost, and told why); 55 + 40 fits: b's is
        # back.
        assert {li.lease_id for li in st.leases} == {n.id, hb.id} and st.used == 95
        hb.ensure_valid()
        assert st.grace_left > 0  # opened by the first re-assertion
        assert "does not fit" in why[0]
        with pytest.raises(AcquireTimeout):
            newcomer.acquire(1, timeout=0)
        for lz in (ha, hb):
            try:
                lz.release()
            except LeaseLost:
                pass
        n.release()
        for x in (a, b, newcomer):
            x.close()
        direct.close()


def test_a_sync_pool_that_only_read_the_status_knows_the_pool(redis_proc1):
    """A blocking Pool whose only call before Redis lost the pool was status() (its
    background runtime, which keeps what the pool object saw, starts with its first acquire)
    knows the pool all the same: its first acquire after the restart makes the pool again with
    the grace period, and is not granted during it. (The churn soak found such a process
    making the pool without one, granted at once while other holders' leases were still live
    on their clocks: 108 of 100 bytes in use until their next heartbeat.)"""
    rp, name = redis_proc1, "seen-by-status"
    with Pool.from_url(rp.url, name, capacity=100, default_ttl=TTL, max_ttl=G) as admin:
        admin.configure(100, max_ttl=G)
    reader = Pool.from_url(rp.url, name, capacity=100, default_ttl=TTL, max_ttl=G)
    old_epoch = reader.status().epoch
    assert reader._runtime is None  # no background yet: the case at hand
    rp.restart()
    with pytest.raises(AcquireTimeout) as e:
        reader.acquire(50, timeout=0)
    assert e.value.grace_left > 0, e.value
    direct = redis.Redis.from_url(rp.url)
    epoch, grace_until = direct.hmget(pool_keys(name)[0], "epoch", "grace_until")
    assert int(epoch) != old_epoch and int(grace_until or 0) > 0, (epoch, grace_until)
    direct.close()
    reader.close()


# ---- the rules of reassert.lua, straight on the script ------------------------------------


def test_reassert_rules(rclient):
    pool, k = "rules", pool_keys("rules")
    # A pool created by a process that knew it existed: grace period of one max_ttl (1 s).
    r = raw(rclient, pool, "configure", 100, 100, "create", 1000, "1")
    epoch = int(r[2])
    assert int(r[5]) == 1000 and 900 < int(r[6]) <= 1000
    st = raw(rclient, pool, "status", 10)
    assert int(st[14]) > 0
    # No new grant in the grace period, even with all the room in the world.
    assert int(raw_acquire(rclient, pool, 10, ttl_ms=1000, mode="try")[0]) == 2
    q = raw_acquire(rclient, pool, 10, ticket="q", ttl_ms=1000)
    assert int(q[0]) == 0 and 0 < int(q[2]) <= 1000  # queued; retry_after = the grace end
    # ttl above max_ttl: refused by acquire before any write.
    before = snapshot(rclient)
    with pytest.raises(redis.ResponseError, match="max_ttl_ms"):
        raw_acquire(rclient, pool, 10, ttl_ms=1001)
    assert snapshot(rclient) == before

    L1, L2, L3 = new_id(), new_id(), new_id()

    def reassert(*recs):
        flat = [len(recs)]
        for rec in recs:
            flat += list(rec)
        return [int(x) for x in raw(rclient, pool, "reassert", *flat)[3]]

    res = reassert(
        (L1, epoch - 10, 60, 1000, "t1", "{}"),  # ok
        (L2, epoch, 10, 1000, "t2", "{}"),  # token not older: -3
        (L3, epoch - 5, 10, 2000, "t3", "{}"),  # ttl > max_ttl: -4
        (new_id(), epoch - 4, 50, 1000, "t4", "{}"),
    )  # 60 + 50 > 100: -2
    assert res[0] > 0 and res[1:] == [-3, -4, -2]
    assert reassert((L1, epoch - 10, 60, 1000, "t1", "{}"))[0] > 0  # again: idempotent
    assert reassert((L1, epoch - 11, 60, 1000, "t1", "{}")) == [-5]  # same id, other token
    assert reassert((L3, epoch - 12, 10, 1000, "t1", "{}")) == [-5]  # ticket of another lease
    assert check_consistent(rclient, pool) == {"used": 60, "leases": 1, "queued": 1}
    assert int(rclient.hget(k[0], "fence")) == epoch  # no token was issued
    # Bad arguments: refused before any write.
    before = snapshot(rclient)
    for argv in (
        (1, L2, "x", 10, 1000, "t", "{}"),
        (1, "zz", 1, 10, 1000, "t", "{}"),
        (2, L2, 1, 10, 1000, "t", "{}"),
        (1, L2, 1, 0, 1000, "t", "{}"),
        (1, L2, 1, 10, 50, "t", "{}"),
        (1, L2, 1, 10, 1000, "a b", "{}"),
    ):
        with pytest.raises(redis.ResponseError, match="GPULOCK_BADARG"):
            raw(rclient, pool, "reassert", *argv)
    assert snapshot(rclient) == before
    with pytest.raises(redis.ResponseError, match="GPULOCK_NOPOOL"):
        raw(rclient, "nopool", "reassert", 0)

    time.sleep(1.05)  # the grace period ends
    assert reassert((L2, epoch - 3, 10, 1000, "t2", "{}")) == [-1]  # too late: lost
    raw(rclient, pool, "reap")
    g = raw(rclient, pool, "renew", 0, 1, "q", 1000)[3][0]  # the queued request is granted now
    assert g[0] == b"g" and int(g[2]) > epoch  # a new token, above the epoch


def test_reassert_opens_the_grace_period_of_a_pool_made_without_one(rclient):
    pool = "rules2"
    epoch = int(raw(rclient, pool, "configure", 100, 100, "create", 1000)[2])  # no grace
    assert int(raw(rclient, pool, "status", 10)[14]) == 0
    r = raw(rclient, pool, "reassert", 1, new_id(), epoch - 1, 30, 1000, "", "{}")
    assert (
        int(r[3][0]) > 0 and 0 < int(r[2]) <= 1000
    )  # accepted, grace opened until created + max_ttl
    assert int(raw_acquire(rclient, pool, 10, ttl_ms=1000, mode="try")[0]) == 2
    # A pool older than one max_ttl: nothing comes back, no grace period is opened.
    time.sleep(1.05)
    r = raw(rclient, pool, "reassert", 1, new_id(), epoch - 2, 30, 1000, "", "{}")
    assert [int(x) for x in r[3]] == [-1] and int(r[2]) == 0
