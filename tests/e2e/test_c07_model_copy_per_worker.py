"""c07 — every worker loads its own copy of the model.

Capacity 10 GiB, a model of 3 GiB resident per worker, 4 gunicorn workers: each worker holds a
resident lease while it lives; the 4th cannot get 3 GiB more, so it loads no model, answers
requests with 503 not-ready, and /ready names the shortfall (rather than a CUDA OOM); when a
worker dies (kill -9), its resident lease comes back within the ttl and the waiting worker gets
it."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from support.history import lease_intervals, max_overlap
from support.pools import GiB
from support.procs import alive
from support.waiting import wait_until

TTL = 3.0
ENV = {
    "GPULOCK_MODEL": "sleep",
    "GPULOCK_SLEEP_BYTES": "256MiB",
    "GPULOCK_SLEEP_SECONDS": "0.05",
    "GPULOCK_RESIDENT": "3GiB",
    "GPULOCK_TTL": str(TTL),
    "GPULOCK_STARTUP_TIMEOUT": "2",
    "GPULOCK_ACQUIRE_TIMEOUT": "5",
}


@pytest.fixture(scope="module")
def svc(make_service):
    s = make_service("c07", workers=4, env=ENV, capacity=10 * GiB)
    s.wait_ready(3, timeout=90)
    return s


def _residents(st):
    return [lz for lz in st.leases if str(lz.holder.get("purpose", "")).startswith("resident")]


def _not_ready_pid(svc, timeout: float = 30):
    """Ask /ready on new connections until the one worker that is not ready answers."""
    deadline = time.monotonic() + timeout
    ready = set()
    while time.monotonic() < deadline:
        r = httpx.get(svc.url + "/ready", timeout=5)
        if r.status_code == 503:
            return r.json(), ready
        ready.add(r.json()["pid"])
    raise AssertionError("no worker reported not ready")


@pytest.mark.timeout(120)
def test_c07_model_copy_per_worker(svc):
    st = wait_until(
        lambda: (lambda s: s if len(_residents(s)) == 3 else None)(svc.status()),
        30,
        "3 resident leases",
        interval=0.1,
    )
    assert st.used == 9 * GiB and all(lz.amount == 3 * GiB for lz in _residents(st))
    holders = {lz.holder["pid"] for lz in _residents(st)}
    # The 4th worker waits without queueing (a resident request that cannot fit must not block
    # the requests of the 3 ready workers) and says why it is not ready. Two workers that both
    # read the room before the 3rd resident was granted both queue; the one left over sees
    # that it cannot fit at its next check (every reaper interval, 1 s here) and leaves the
    # queue: so the queue is empty within a few intervals, not at once.
    wait_until(lambda: svc.status().waiter_count == 0, 10, "the queue to empty", interval=0.1)
    body, _ = _not_ready_pid(svc)
    waiting_pid = body["pid"]
    assert waiting_pid not in holders and len(svc.worker_pids()) == 4
    msg = body["checks"]["resident_lease"]["message"]
    assert "3.0GiB" in msg and "shortfall 2.0GiB" in msg and "1.0GiB free of 10.0GiB" in msg, msg
    refused = None
    for _ in range(200):
        r = httpx.post(svc.url + "/v1/embeddings", json={"input": ["x"]}, timeout=10)
        if int(r.headers["x-worker-pid"]) == waiting_pid:
            refused = r
            break
        assert r.status_code == 200, r.text  # the ready workers serve meanwhile
    assert (
        refused is not None
        and refused.status_code == 503
        and "not ready" in refused.json()["error"]["message"]
    )
    assert "retry-after" in refused.headers

    # A worker dies: its resident lease comes back within the ttl, and a waiting worker takes it
    # (the one that waited, or gunicorn's replacement if it asks first: both only try).
    victim = sorted(holders)[0]
    os.kill(victim, signal.SIGKILL)
    t_kill = time.time()
    dies_at = svc.expiries_of(victim, t_kill)
    read_at = time.time()
    # A dead holder renews nothing: its lease expires at most a ttl after the last command it
    # sent ran on Redis, which was before expiries_of returned (it waits for the process to be
    # gone and for Redis to run what it had sent; a renewal sent at the kill may run after
    # t_kill on a loaded machine).
    assert max(dies_at.values()) <= read_at + TTL
    victim_expiry = max(v for k, v in dies_at.items() if k != "killed_at")

    def taken_over(s):
        pids = {lz.holder["pid"] for lz in _residents(s)}
        return s if len(pids) == 3 and victim not in pids else None

    # The waiting workers ask every reaper interval (1 s), when they are scheduled: the
    # deadline is generous (how soon is asserted on the server's clock below, not here).
    st2 = wait_until(
        lambda: taken_over(svc.status()),
        TTL + 60,
        "a waiting worker to get the dead worker's bytes",
        interval=0.1,
    )
    assert st2.reaped_leases >= 1 and st2.used == 9 * GiB
    # The new holder got the dead worker's bytes only once its lease had expired, on the
    # server's clock (its grant time, recorded by the worker): nobody held them twice.
    new_lease = next(lz for lz in _residents(st2) if lz.holder["pid"] not in holders)
    # (Its grant record is written just after the grant returned: it may come after status.)
    grant = wait_until(
        lambda: next(
            (
                e
                for e in svc.history()
                if e["e"] == "grant" and e.get("lease_id") == new_lease.lease_id
            ),
            None,
        ),
        30,
        "the new resident lease's grant record",
        interval=0.1,
    )
    assert grant["server_grant_ms"] >= round(victim_expiry * 1000), (grant, victim_expiry)
    assert not alive(victim)
    # gunicorn started a replacement; one of the two waiting workers is now the one not ready.
    wait_until(
        lambda: len(svc.worker_pids()) == 4 and victim not in svc.worker_pids(),
        30,
        "a replacement worker",
        interval=0.1,
    )
    body2, _ = _not_ready_pid(svc)
    new_holders = {lz.holder["pid"] for lz in _residents(st2)}
    assert body2["pid"] not in new_holders and body2["pid"] != victim
    assert waiting_pid in new_holders or body2["pid"] == waiting_pid
    svc.wait_ready(3, timeout=30)
    st3 = svc.status()
    assert st3.used == 9 * GiB and len(_residents(st3)) == 3
    events = svc.history()
    peak, _ = max_overlap(lease_intervals(events, routes={"resident"}, killed={victim: dies_at}))
    assert peak <= 10 * GiB
    peak_all, _ = max_overlap(lease_intervals(events, killed={victim: dies_at}))
    assert peak_all <= 10 * GiB
