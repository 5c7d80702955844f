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
