"""Waiters through the broker survive Redis losing its data (docs/RELIABILITY.md): the
broker's pool object keeps their places, makes the pool again when it finds it gone and puts
the places back, so the SDK's acquires are granted after the grace period, whatever point of
their long polls the loss falls on; never PoolNotFound (a 404, which the SDK gives up on)."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from gpulock_client import Pool

from gpulock import Pool as CorePool
from gpulock.protocol.keys import pool_keys
from support.pools import config

from ._support import USER_TOKEN

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("round_", range(3))
def test_queued_sdk_acquires_survive_a_flushall(redis_srv, broker_srv, admin, round_):
    r = admin.put("/v1/pools/gpu-r", json={"capacity": "1GiB", "max_ttl": 4})
    assert r.status_code == 200, r.text
    with Pool(broker_srv.url, "gpu-r", token=USER_TOKEN, max_wait=3.0) as pool:
        holder = pool.acquire("600MiB", ttl=4, timeout=30)
        positions: list[list] = [[], []]
        got: list = []
        errors: list[BaseException] = []

        def wait(i: int) -> None:
            try:
                lease = pool.acquire("600MiB", ttl=4, timeout=60, on_queued=positions[i].append)
                lease.release()  # the other waiter's turn (two do not fit together)
                got.append(lease)
            except BaseException as e:  # noqa: BLE001 - the test reports it
                errors.append(e)

        ts = [threading.Thread(target=wait, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        deadline = time.monotonic() + 60
        while not all(positions) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(positions), "the acquires never queued"
        time.sleep(round_ * 0.7)  # not a wait for state: where in the long polls the loss falls
        c = redis.Redis.from_url(redis_srv.url)
        c.flushall()  # the holder's lease goes with it; the waiters' places are put back
        c.close()
        for t in ts:
            t.join(100)
        assert not any(t.is_alive() for t in ts)
        assert errors == [], errors
        assert len(got) == 2
        del holder  # lost with the data: its release would raise LeaseLost


def test_an_sdk_acquire_after_a_flushall_of_an_idle_pool_is_granted(redis_srv, broker_srv, admin):
    """Redis lost the pool while nobody held or waited through the broker: the broker's pool
    object (opened without a capacity; the pool was set by an operator on Redis, not through
    this broker, or before it started) saw the pool, so the next acquire makes it again as
    last seen, with its grace period, and is granted after it; never PoolNotFound (a 404)."""
    direct = redis.Redis.from_url(redis_srv.url)
    try:
        with CorePool.from_url(redis_srv.url, "gpu-f") as operator:  # `gpulock pool set`
            operator.configure("1GiB", max_ttl=2, max_waiters=9)
        with Pool(broker_srv.url, "gpu-f", token=USER_TOKEN, max_wait=3.0) as pool:
            pool.acquire("600MiB", ttl=2, timeout=30).release()
            # a status read through the broker's pool object (as a dashboard's): it knows the
            # operator's max_ttl then, so the grace period is 2 s, not its own 60 s
            st = admin.get("/v1/pools/gpu-f")
            assert st.status_code == 200 and st.json()["max_ttl"] == 2, st.text
            old = config(direct, "gpu-f")
            direct.flushall()
            lease = pool.acquire("600MiB", ttl=2, timeout=30)
            cfg = config(direct, "gpu-f")
            assert cfg["epoch"] != old["epoch"] and cfg["grace_until"] > 0, cfg
            assert (cfg["capacity"], cfg["max_ttl_ms"], cfg["max_waiters"]) == (
                1 << 30,
                2000,
                9,
            ), cfg
            raw = direct.hget(pool_keys("gpu-f")[2], lease.id)
            assert raw is not None and int(raw.decode().split("|")[2]) >= cfg["grace_until"]
            lease.release()
    finally:
        direct.close()
