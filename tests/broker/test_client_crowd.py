"""gpulock-client with more waiters in one pool object than it has connections for the long
polls (a real broker and Redis): the control calls (renewals, release, status) have their own
connections and never wait behind the waits; the waits beyond the limit wait locally for a
connection within their own acquire timeout, and all of them are granted as capacity frees."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from gpulock_client import AcquireTimeout, AsyncPool, Pool

from support.waiting import wait_until
from ._support import ADMIN_TOKEN, USER_TOKEN

pytestmark = pytest.mark.timeout(180)

DEFAULT_LIMIT = 64  # the documented default of max_connections (the long polls of one pool object)
# Only a hang fails on time: starvation showed as errors (httpx PoolTimeout after 5 s: the
# release raised BackendUnavailable, renewals failed, the kept lease was lost), which the
# tests assert on directly. A control call takes milliseconds on loopback, but 1.6 s once
# under a loaded CI machine, so no speed is asserted here (speeds live in benchmarks/).
QUICK = 30.0
# The kept lease's ttl: renewed every ttl/3 by the heartbeat, lost after a ttl without one. A
# starved control connection shows as an error (PoolTimeout after 5 s) whatever the ttl; 2 s
# lost the lease when the test process (its 300 waiting tasks and the broker's thread) got too
# little CPU for two seconds on a loaded machine, so it is 6 s.
KEEPER_TTL = 6


def _make_pool(admin, name: str) -> None:
    r = admin.put(f"/v1/pools/{name}", json={"capacity": 1000, "max_waiters": 2000})
    assert r.status_code == 200, r.text


def _broker_waiters(admin, name: str) -> int:
    r = admin.get(f"/v1/pools/{name}")
    assert r.status_code == 200, r.text
    return r.json()["waiter_count"]


def test_sync_pool_150_waiting_threads(broker_srv, admin):
    n = 150
    _make_pool(admin, "crowd-s")
    with Pool(broker_srv.url, "crowd-s", token=USER_TOKEN) as pool:
        limit = getattr(pool, "max_connections", DEFAULT_LIMIT)
        keeper = pool.acquire(100, ttl=KEEPER_TTL)  # held throughout, renewed by the heartbeat
        holder = pool.acquire(900, ttl=30)
        granted: list[int] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def waiter() -> None:
            try:
                lease = pool.acquire(100, ttl=30, timeout=60)
                with lock:
                    granted.append(lease.token)
                lease.release()
            except BaseException as e:  # noqa: BLE001 - reported by the test
                with lock:
                    errors.append(e)

        threads = [threading.Thread(target=waiter, daemon=True) for _ in range(n)]
        for t in threads:
            t.start()
        # The broker's queue fills up to the limit of connections for waits, never beyond.
        wait_until(lambda: _broker_waiters(admin, "crowd-s") >= limit, timeout=30, interval=0.05)
        first_expiry, valid = keeper.expires_at, keeper.valid_until
        # a heartbeat renewal (within a ttl, or the lease is lost)
        wait_until(lambda: keeper.valid_until > valid, timeout=KEEPER_TTL, interval=0.02)
        for _ in range(3):  # control calls while the waits hold every wait connection
            t0 = time.monotonic()
            keeper.renew()
            st = pool.status()
            assert time.monotonic() - t0 < QUICK
            assert st["waiter_count"] == limit, st["waiter_count"]
        assert not errors, errors[:3]

        t0 = time.monotonic()
        holder.release()
        assert time.monotonic() - t0 < QUICK

        deadline = time.monotonic() + 90
        renewals = 0
        while any(t.is_alive() for t in threads):  # renewals keep succeeding while they are granted
            assert time.monotonic() < deadline, f"{len(granted)} of {n} granted"
            t0 = time.monotonic()
            keeper.renew()
            assert time.monotonic() - t0 < QUICK
            renewals += 1
            keeper.ensure_valid()
            alive = next((t for t in threads if t.is_alive()), None)
            if alive is not None:
                alive.join(0.2)
        assert not errors, errors[:3]
        assert len(granted) == n and len(set(granted)) == n
        assert renewals >= 1
        keeper.ensure_valid()
        assert keeper.expires_at > first_expiry
        keeper.release()
        st = pool.status()
        assert st["used"] == 0 and st["waiter_count"] == 0 and st["leases"] == []


def test_async_pool_300_waiting_tasks(broker_srv, admin):
    n = 300
    _make_pool(admin, "crowd-a")
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    async def crowd(pool: AsyncPool, watch: httpx.AsyncClient) -> None:
        limit = getattr(pool, "max_connections", DEFAULT_LIMIT)
        # held throughout, renewed by the heartbeat task
        keeper = await pool.acquire(100, ttl=KEEPER_TTL)
        holder = await pool.acquire(900, ttl=30)
        granted: list[int] = []

        async def waiter() -> None:
            lease = await pool.acquire(100, ttl=30, timeout=60)
            granted.append(lease.token)
            await lease.release()

        tasks = [asyncio.create_task(waiter()) for _ in range(n)]
        try:
            deadline = time.monotonic() + 30
            while (await watch.get("/v1/pools/crowd-a")).json()["waiter_count"] < limit:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            first_expiry, valid = keeper.expires_at, keeper.valid_until
            while keeper.valid_until <= valid:  # a heartbeat renewal
                assert time.monotonic() < deadline + 5
                await asyncio.sleep(0.02)
            for _ in range(3):  # control calls while the waits hold every wait connection
                t0 = time.monotonic()
                await keeper.renew()
                st = await pool.status()
                assert time.monotonic() - t0 < QUICK
                assert st["waiter_count"] == limit, st["waiter_count"]
            assert not any(t.done() for t in tasks)

            t0 = time.monotonic()
            await holder.release()
            assert time.monotonic() - t0 < QUICK

            renewals = 0
            pending = set(tasks)
            deadline = time.monotonic() + 90
            while pending:  # renewals keep succeeding while the crowd is granted
                assert time.monotonic() < deadline, f"{len(granted)} of {n} granted"
                t0 = time.monotonic()
                await keeper.renew()
                assert time.monotonic() - t0 < QUICK
                renewals += 1
                keeper.ensure_valid()
                _, pending = await asyncio.wait(pending, timeout=0.2)
            for t in tasks:
                t.result()  # raises a waiter's error
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert len(granted) == n and len(set(granted)) == n
        assert renewals >= 1
        keeper.ensure_valid()
        assert keeper.expires_at > first_expiry
        await keeper.release()
        st = await pool.status()
        assert st["used"] == 0 and st["waiter_count"] == 0 and st["leases"] == []

    async def main() -> None:
        async with httpx.AsyncClient(base_url=broker_srv.url, headers=headers, timeout=30) as watch:
            async with AsyncPool(broker_srv.url, "crowd-a", token=USER_TOKEN) as pool:
                await crowd(pool, watch)

    asyncio.run(main())


def test_a_wait_beyond_the_limit_times_out_locally_as_acquire_timeout(broker_srv, admin):
    """max_connections=2: a third waiter waits in the process for a connection; its acquire
    timeout ends that wait with AcquireTimeout (not a pool timeout or BackendUnavailable), and
    it never reached the broker's queue."""
    _make_pool(admin, "crowd-t")

    async def main() -> None:
        async with AsyncPool(
            broker_srv.url, "crowd-t", token=USER_TOKEN, max_connections=2
        ) as pool:
            assert pool.max_connections == 2
            holder = await pool.acquire(1000, ttl=30)
            first = [asyncio.create_task(pool.acquire(100, ttl=30, timeout=60)) for _ in range(2)]
            deadline = time.monotonic() + 10
            while (await pool.status())["waiter_count"] < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            with pytest.raises(AcquireTimeout) as e:
                await pool.acquire(100, ttl=30, timeout=0.5)
            assert 0.4 < time.monotonic() - t0 < 0.5 + QUICK
            assert e.value.position == 0
            assert (await pool.status())["waiter_count"] == 2
            # timeout=0 tries once without a long poll: not held up behind the waits
            t0 = time.monotonic()
            with pytest.raises(AcquireTimeout):
                await pool.acquire(100, timeout=0)
            assert time.monotonic() - t0 < QUICK
            await holder.release()
            for lease in await asyncio.gather(*first):
                await lease.release()
            st = await pool.status()
            assert st["used"] == 0 and st["waiter_count"] == 0

    asyncio.run(main())


def test_cancelled_waits_hand_their_connection_to_the_next(broker_srv, admin):
    """max_connections=1: cancelling the wait that holds the connection lets the next one (in
    FIFO order) reach the broker's queue; cancelling one that waits locally leaves nothing."""
    _make_pool(admin, "crowd-c")

    def waiting_holders() -> list:
        return [w["holder"].get("who") for w in admin.get("/v1/pools/crowd-c").json()["waiters"]]

    async def until(pred) -> None:
        deadline = time.monotonic() + 10
        while not pred():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)

    async def main() -> None:
        async with AsyncPool(
            broker_srv.url, "crowd-c", token=USER_TOKEN, max_connections=1
        ) as pool:
            gate = pool._cfg.gate
            holder = await pool.acquire(1000, ttl=30)
            a = asyncio.create_task(pool.acquire(100, timeout=60, holder={"who": "a"}))
            await until(lambda: waiting_holders() == ["a"])
            b = asyncio.create_task(pool.acquire(100, timeout=60, holder={"who": "b"}))
            c = asyncio.create_task(pool.acquire(100, timeout=60, holder={"who": "c"}))
            await until(lambda: gate.waiting == 2)
            c.cancel()  # waiting locally: just leaves the line
            with pytest.raises(asyncio.CancelledError):
                await c
            assert gate.waiting == 1 and waiting_holders() == ["a"]
            a.cancel()  # holds the connection: withdraws its place, b goes next
            with pytest.raises(asyncio.CancelledError):
                await a
            await until(lambda: waiting_holders() == ["b"])
            assert gate.in_use == 1 and gate.waiting == 0
            await holder.release()
            lease = await b
            assert gate.in_use == 0
            await lease.release()
            st = await pool.status()
            assert st["used"] == 0 and st["waiter_count"] == 0

    asyncio.run(main())


def test_sync_wait_beyond_the_limit_times_out_locally(broker_srv, admin):
    _make_pool(admin, "crowd-st")
    with Pool(broker_srv.url, "crowd-st", token=USER_TOKEN, max_connections=1) as pool:
        holder = pool.acquire(1000, ttl=30)
        out: dict = {}
        first = threading.Thread(
            target=lambda: out.setdefault("a", pool.acquire(100, ttl=30, timeout=60))
        )
        first.start()
        wait_until(lambda: _broker_waiters(admin, "crowd-st") == 1, timeout=10, interval=0.02)
        t0 = time.monotonic()
        with pytest.raises(AcquireTimeout) as e:
            pool.acquire(100, ttl=30, timeout=0.5)
        assert 0.4 < time.monotonic() - t0 < 0.5 + QUICK and e.value.position == 0
        assert pool._cfg.gate.waiting == 0 and _broker_waiters(admin, "crowd-st") == 1
        t0 = time.monotonic()
        holder.release()
        assert time.monotonic() - t0 < QUICK
        first.join(30)
        out["a"].release()
        assert pool._cfg.gate.in_use == 0
        assert pool.status()["used"] == 0
