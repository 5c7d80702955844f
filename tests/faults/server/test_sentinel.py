"""Redis Sentinel: a pool reached through ``redis+sentinel://`` follows a failover.

A primary, a replica and one sentinel (real ``redis-server --sentinel`` processes on free
ports). A lease is taken and replicated (``WAIT``), the primary is killed (-9), the sentinel
sees it down and promotes the replica, and the same pool objects — sync and async — go on
against the new primary without being told: the lease is still there and still renewed, new
grants work, a queued waiter is granted when the holder releases on the new primary, and
nothing is left behind. This is the failover of issue 5 done by Sentinel instead of by hand;
what makes an unplanned failover lose no grant is ``sync_replicas`` (test_failover.py).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time

import pytest
import redis

from gpulock import AsyncPool, Pool
from support.servers import RedisProcess
from support.ports import free_port

from support.pools import check_consistent
from support.servers import FAST_REPLICATION
from support.waiting import async_wait_until, wait_until

pytestmark = pytest.mark.timeout(120)


class SentinelSetup:
    def __init__(self, binary: str):
        self.primary = RedisProcess(binary, extra_args=FAST_REPLICATION).start()
        self.replica = RedisProcess(
            binary,
            extra_args=[*FAST_REPLICATION, "--replicaof", "127.0.0.1", str(self.primary.port)],
        ).start()
        self.port = free_port("127.0.0.1")
        self.dir = self.primary.dir
        conf = os.path.join(self.dir, "sentinel.conf")
        with open(conf, "w") as f:
            f.write(
                f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\n"
                f"dir {self.dir}\nlogfile {os.path.join(self.dir, 'sentinel.log')}\n"
                f"sentinel monitor gl 127.0.0.1 {self.primary.port} 1\n"
                f"sentinel down-after-milliseconds gl 1000\nsentinel failover-timeout gl 5000\n"
            )
        self.proc = subprocess.Popen(
            [binary, conf, "--sentinel"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.s = redis.Redis(port=self.port, socket_timeout=2, decode_responses=True)
        wait_until(self._ready, timeout=20, interval=0.1)

    def _ready(self) -> bool:
        """The sentinel knows the replica, connected, with its link to the primary up."""
        try:
            for rep in self.s.execute_command("SENTINEL", "REPLICAS", "gl"):
                d = dict(zip(rep[::2], rep[1::2])) if isinstance(rep, list) else rep
                if d.get("flags") == "slave" and d.get("master-link-status") == "ok":
                    return True
        except redis.RedisError:
            pass
        return False

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/gl/0"

    def master_port(self) -> int:
        return int(self.s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "gl")[1])

    def fail_over(self) -> float:
        """kill -9 the primary; the sentinel sees it down (down-after 1 s) and promotes the
        replica. Returns the seconds until the replica is primary. (A planned ``SENTINEL
        FAILOVER`` is not used: it leaves the old primary writable for seconds, until the
        sentinel demotes it, and clients connected to it keep writing there — Sentinel's own
        split-brain window, which only ``min-replicas-to-write`` on the servers closes.)"""
        t0 = time.monotonic()
        self.primary.kill()
        wait_until(lambda: self.master_port() == self.replica.port, timeout=30, interval=0.05)
        r = redis.Redis(port=self.replica.port)
        wait_until(lambda: r.info("replication")["role"] == "master", timeout=10)
        r.close()
        return time.monotonic() - t0

    def in_sync(self) -> None:
        """The replica has every write made so far (WAIT on a direct connection)."""
        p = redis.Redis(port=self.primary.port)
        assert p.execute_command("WAIT", 1, 5000) == 1
        p.close()

    def close(self) -> None:
        self.s.close()
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.replica.stop()
        self.primary.stop()


@pytest.fixture
def sentinel(default_binary):
    s = SentinelSetup(default_binary)
    try:
        yield s
    finally:
        s.close()


def test_sync_pool_follows_a_sentinel_failover(sentinel):
    with Pool.from_url(sentinel.url, "sent", capacity=100, default_ttl=6) as p:
        p.configure(100)
        held = p.acquire(30)
        sentinel.in_sync()
        down = sentinel.fail_over()
        # The same object, not told anything: the lease is on the new primary and renewed there.
        st = p.status()
        assert [li.lease_id for li in st.leases] == [held.id] and st.used == 30
        first = held.expires_at
        wait_until(
            lambda: held.expires_at > first, timeout=10
        )  # a renewal (every ttl/3) on the new primary
        held.ensure_valid()
        more = p.acquire(70, timeout=5)
        assert p.status().used == 100
        more.release()
        held.release()
    new = redis.Redis(port=sentinel.replica.port)
    assert check_consistent(new, "sent") == {"used": 0, "leases": 0, "queued": 0}
    new.close()
    print(f"\nsentinel failover: promoted in {down:.2f}s; the sync pool kept its lease and went on")


def test_async_pool_and_waiter_follow_a_sentinel_failover(sentinel):
    async def run() -> None:
        p = AsyncPool.from_url(sentinel.url, "sent-a", capacity=100, default_ttl=6)
        await p.configure(100)
        held = await p.acquire(60)
        waiter = asyncio.create_task(p.acquire(60, timeout=20))  # queued: 120 > 100
        while (await p.status()).waiter_count != 1:  # queued (seen on the server)
            await asyncio.sleep(0.01)
        assert not waiter.done()
        await asyncio.to_thread(sentinel.in_sync)
        await asyncio.to_thread(sentinel.fail_over)
        first = held.expires_at
        for _ in range(1000):  # a renewal (every ttl/3) on the new primary, observed
            if held.expires_at > first:
                break
            await asyncio.sleep(0.01)
        held.ensure_valid()
        await held.release()  # frees the bytes on the new primary: the waiter is granted
        got = await asyncio.wait_for(waiter, 10)
        assert (await p.status()).used == 60
        await got.release()
        await p.aclose()

    asyncio.run(run())
    new = redis.Redis(port=sentinel.replica.port)
    assert check_consistent(new, "sent-a") == {"used": 0, "leases": 0, "queued": 0}
    new.close()


def test_growth_queued_before_a_sentinel_failover_is_granted_after_it(sentinel):
    """A holds 60 and B 40 through ``redis+sentinel://``; A's growth to 80 queues (seen on the
    primary's raw queue), is replicated, and the primary is killed (-9): after the sentinel
    promoted the replica, B's release on the new primary hands A its growth (docs/SEMANTICS.md,
    "Resizing a lease"); A keeps its id and token, and nothing is left behind."""

    async def run() -> None:
        p = AsyncPool.from_url(sentinel.url, "sent-g", capacity=100, default_ttl=6)
        try:
            await p.configure(100)
            a, b = await p.acquire(60), await p.acquire(40)
            lid, token = a.id, a.token
            grow = asyncio.create_task(a.resize(80, timeout=30))
            old = redis.Redis(port=sentinel.primary.port)
            await async_wait_until(
                lambda: old.zrange("gpulock:{sent-g}:queue", 0, -1) == [f"grow:{lid}".encode()],
                10,
                "the growth to queue",
            )
            old.close()
            assert a.amount == 60 and not grow.done()
            await asyncio.to_thread(sentinel.in_sync)
            await asyncio.to_thread(sentinel.fail_over)
            new = redis.Redis(port=sentinel.replica.port)
            assert new.zrange("gpulock:{sent-g}:queue", 0, -1) == [f"grow:{lid}".encode()]
            new.close()
            await b.release()  # on the new primary: its bytes go to the growth
            await asyncio.wait_for(grow, 15)
            assert (a.id, a.token, a.amount) == (lid, token, 80)
            st = await p.status()
            assert st.used == 80 and [h.amount for h in st.leases] == [80] and not st.waiters
            await a.release()
        finally:
            await p.aclose()

    asyncio.run(run())
    new = redis.Redis(port=sentinel.replica.port)
    assert check_consistent(new, "sent-g") == {"used": 0, "leases": 0, "queued": 0}
    new.close()


def test_broker_over_a_sentinel_url_follows_a_failover(sentinel):
    """The lease broker takes a ``redis+sentinel://`` URL like the library (one connect path,
    gpulock.transport.connect): pools are configured, leased, renewed and released through it, also
    after the sentinel promoted the replica; a waiter queued before the failover is granted
    after it."""
    from broker._support import ADMIN_TOKEN, TOKENS, USER_TOKEN
    from gpulock_broker import create_broker_app, parse_tokens
    from support.apps import Running

    app = create_broker_app(sentinel.url, parse_tokens(TOKENS, "test"), max_wait=20.0)
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    user = {"Authorization": f"Bearer {USER_TOKEN}"}
    leases = "/v1/pools/sent-b/leases"

    async def run() -> None:
        async with Running(app) as c:
            r = await c.put("/v1/pools/sent-b", json={"capacity": 100}, headers=admin)
            assert r.status_code == 200 and r.json()["created"], r.text
            r = await c.post(leases, json={"amount": 60, "ttl": 30}, headers=user)
            assert r.status_code == 201, r.text
            held = r.json()["lease_id"]
            waiter = asyncio.create_task(
                c.post(leases, json={"amount": 60, "ttl": 30, "wait": 20}, headers=user)
            )
            for _ in range(500):  # queued, seen on the server through the broker
                if (await c.get("/v1/pools/sent-b", headers=user)).json()["waiter_count"] == 1:
                    break
                await asyncio.sleep(0.01)
            assert not waiter.done()
            await asyncio.to_thread(sentinel.in_sync)
            await asyncio.to_thread(sentinel.fail_over)
            r = await c.put(f"{leases}/{held}", json={}, headers=user)  # renewed on the new primary
            assert r.status_code == 200, r.text
            assert (await c.delete(f"{leases}/{held}", headers=user)).status_code == 200
            got = await asyncio.wait_for(waiter, 20)
            assert got.status_code == 201, got.text
            st = (await c.get("/v1/pools/sent-b", headers=user)).json()
            assert st["used"] == 60 and st["lease_count"] == 1
            r = await c.delete(f"{leases}/{got.json()['lease_id']}", headers=user)
            assert r.status_code == 200

    asyncio.run(run())
    new = redis.Redis(port=sentinel.replica.port)
    assert check_consistent(new, "sent-b") == {"used": 0, "leases": 0, "queued": 0}
    new.close()


def test_sync_pool_on_a_sentinel_client_object_heartbeats_on_the_primary(sentinel):
    """A Pool given a Sentinel-managed ``redis.Redis`` (not a URL): its background client (the
    heartbeat, the hand-off subscription) also asks the sentinel for the primary, so the lease
    is renewed there and a queued waiter is granted when the holder releases."""
    from redis.sentinel import Sentinel

    sentinels = Sentinel([("127.0.0.1", sentinel.port)], socket_timeout=2)
    client = sentinels.master_for("gl", socket_timeout=2)
    with Pool(client, "sent-o", capacity=100, default_ttl=1.5) as p:
        held = p.acquire(60)
        first = held.expires_at
        wait_until(
            lambda: held.expires_at > first, timeout=10
        )  # a renewal (every ttl/3) on the primary
        held.ensure_valid()
        got: dict = {}
        t = threading.Thread(
            target=lambda: got.setdefault("w", p.acquire(60, timeout=10)), daemon=True
        )
        t.start()
        wait_until(lambda: p.status().waiter_count == 1, timeout=10)
        held.release()
        t.join(10)
        got["w"].release()
    client.close()
    primary = redis.Redis(port=sentinel.primary.port)
    assert check_consistent(primary, "sent-o") == {"used": 0, "leases": 0, "queued": 0}
    primary.close()
