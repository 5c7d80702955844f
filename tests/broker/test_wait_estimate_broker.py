"""The wait estimate through the lease broker (docs/SEMANTICS.md, "Wait estimate"): its 503s
(queued, busy) carry the server's ``estimated_wait_s``, its pool object each waiter's and the
drain rate, ``gpulock status --broker-url`` shows them, and the SDK's ``on_queued`` gets a
QueuePlace with the estimate. Against a real broker and Redis; the drain rate is measured by
draining a queue (support.drain)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading

import gpulock_client
import pytest
from gpulock_common.queue import QueuePlace

from gpulock import Pool
from support.drain import measure_drain
from support.pools import GiB
from support.waiting import wait_until

from ._support import USER_TOKEN

pytestmark = pytest.mark.timeout(300)


def test_the_brokers_answers_carry_the_servers_estimate(broker_srv, redis_srv, gpu, user):
    core = Pool.from_url(redis_srv.url, gpu)
    try:
        drain = measure_drain(core, 10 * GiB)
        holder = core.acquire(10 * GiB)
        # queued (wait 0: answered at once, its place kept): its own estimate, as status has it
        r = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "1GiB", "request_id": "q1"})
        d = r.json()["detail"]
        assert r.status_code == 503 and d["error"] == "queued", r.text
        st = core.status()
        assert st.drain == drain and st.waiter_count == 1
        assert d["estimated_wait_s"] == pytest.approx(st.waiters[0].estimated_wait), d
        # busy (queue=false): as if it joined the tail, behind the queued 1 GiB
        r = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "2GiB", "queue": False})
        d = r.json()["detail"]
        assert r.status_code == 503 and d["error"] == "busy", r.text
        assert d["estimated_wait_s"] == pytest.approx(core.status().estimated_wait_for(2 * GiB))

        # the pool object: each waiter's estimate and the drain rate
        p = user.get(f"/v1/pools/{gpu}").json()
        assert p["drain"] == dataclasses.asdict(drain)
        want = [w.estimated_wait for w in core.status().waiters]
        assert [w["estimated_wait_s"] for w in p["waiters"]] == pytest.approx(want)
        # ... and gpulock status through the broker shows them as through Redis
        env = {k: v for k, v in os.environ.items() if k != "GPULOCK_REDIS_URL"}
        env["GPULOCK_TOKEN"] = USER_TOKEN
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpulock",
                "--broker-url",
                broker_srv.url,
                "status",
                gpu,
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        s = json.loads(out.stdout)
        assert s["drain"] == p["drain"]
        assert [w["estimated_wait_s"] for w in s["waiters"]] == pytest.approx(want)
        assert user.delete(f"/v1/pools/{gpu}/requests/q1").status_code == 200

        # the SDK: on_queued gets the int position with the broker's estimate
        places: list = []
        done: list = []

        def wait_for_it() -> None:
            with gpulock_client.Pool(broker_srv.url, gpu, token=USER_TOKEN) as sdk:
                lease = sdk.acquire("1GiB", timeout=120, on_queued=places.append)
                lease.release()
                done.append(True)

        th = threading.Thread(target=wait_for_it, daemon=True)
        th.start()
        try:
            wait_until(lambda: places, 60, "the SDK's acquire to queue")
            place = places[0]
            assert isinstance(place, QueuePlace) and place == 1 and place.queue_length == 1
            assert place.estimated_wait == pytest.approx(core.status().waiters[0].estimated_wait)
        finally:
            holder.release()
            th.join(120)
        assert done == [True]
    finally:
        core.close()
