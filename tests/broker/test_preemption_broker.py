"""Preemption through the broker (issue 33): a holder on the SDK (sync and asyncio) learns from
its renewals that it is asked to yield (``on_yield``, ``yield_requested``, ``yield_deadline``;
the renewal's ``yield_requested`` and ``yield_deadline_s``), releases, and the waiter of higher
priority is granted; ``preemptible=False`` is never asked; ``gpulock run --broker-url`` signals
its command. Every wait is on observed state with a generous deadline."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import redis
from gpulock_client import AcquireTimeout, AsyncPool, Pool

from gpulock import Pool as CorePool
from gpulock.protocol.keys import pool_key
from support.background import acquire_in_thread
from support.preempt import enable_preemption
from support.waiting import async_wait_until, wait_until

from ._support import OTHER_TOKEN, USER_TOKEN

GiB = 2**30
WAIT_S = 30.0  # a generous deadline for what must happen; never a bound on its speed
YIELD_GRACE_S = 3.0
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def rc(redis_srv):
    c = redis.Redis.from_url(redis_srv.url)
    yield c
    c.close()


@pytest.fixture
def preempting(gpu, rc):
    """gpu-a (10 GiB) with preemption on: gap 5, a yield grace of 3 s."""
    enable_preemption(rc, gpu, 5, YIELD_GRACE_S)
    return gpu


def _cfg(rc, field: str) -> int:
    v = rc.hget(pool_key("gpu-a", "cfg"), field)
    return int(v) if v else 0


def test_sdk_holder_learns_releases_and_the_waiter_is_granted(broker_srv, preempting, rc):
    with (
        Pool(broker_srv.url, preempting, token=USER_TOKEN) as sdk,
        Pool(broker_srv.url, preempting, token=OTHER_TOKEN) as urgent_pool,
    ):
        lease = sdk.acquire("8GiB", ttl=1.5)
        asked = threading.Event()
        lease.on_yield(lambda l: asked.set())
        assert not lease.yield_requested and lease.yield_deadline is None
        t, out = acquire_in_thread(urgent_pool, "6GiB", priority=10, timeout=WAIT_S)
        wait_until(asked.is_set, WAIT_S, "the SDK holder's on_yield")
        assert lease.yield_requested
        deadline = lease.yield_deadline
        assert isinstance(deadline, float) and deadline <= time.monotonic() + YIELD_GRACE_S
        assert lease.valid_until <= deadline + 1e-9 and not lease.lost
        late: list = []
        lease.on_yield(late.append)  # registered after the fact: at once
        assert late == [lease]
        lease.release()
        t.join(WAIT_S)
        got = out["lease"]
        assert got.token > lease.token
        got.release()
    assert _cfg(rc, "y_asked") == 1 and _cfg(rc, "y_done") == 1


def test_async_sdk_holder_coroutine_on_yield(broker_srv, redis_srv, preempting, rc):
    async def main():
        async with AsyncPool(broker_srv.url, preempting, token=USER_TOKEN) as sdk:
            lease = await sdk.acquire("8GiB", ttl=1.5)
            released = asyncio.Event()

            async def on_yield(l):  # a coroutine callback: runs as a task of the loop
                assert l is lease and l.yield_requested
                await l.release()
                released.set()

            lease.on_yield(on_yield)
            with CorePool.from_url(redis_srv.url, preempting) as core:
                # a core acquire of higher priority, in a thread (it blocks)
                t, out = acquire_in_thread(core, "6GiB", priority=10, timeout=WAIT_S)
                await asyncio.wait_for(released.wait(), WAIT_S)
                await async_wait_until(lambda: not t.is_alive(), WAIT_S, "the urgent grant")
                got = out["lease"]
                assert got.token > lease.token
                got.release()

    asyncio.run(main())
    assert _cfg(rc, "y_asked") == 1 and _cfg(rc, "y_done") == 1


def test_renewal_reply_says_yield(broker_srv, redis_srv, preempting, user):
    r = user.post(f"/v1/pools/{preempting}/leases", json={"amount": "8GiB", "ttl": 5})
    assert r.status_code == 201, r.text
    lid = r.json()["lease_id"]
    r = user.put(f"/v1/pools/{preempting}/leases/{lid}", json={})
    assert r.status_code == 200 and r.json()["yield_requested"] is False
    assert r.json()["yield_deadline_s"] is None
    with CorePool.from_url(redis_srv.url, preempting) as core:
        t, out = acquire_in_thread(core, "6GiB", priority=10, timeout=WAIT_S)
        body = wait_until(
            lambda: (
                (b := user.put(f"/v1/pools/{preempting}/leases/{lid}", json={}).json())[
                    "yield_requested"
                ]
                and b
            ),
            WAIT_S,
            "a renewal saying yield",
        )
        assert 0 < body["yield_deadline_s"] <= YIELD_GRACE_S + 5  # max(grace, the expiry)
        assert body["expires_in"] <= body["yield_deadline_s"]  # capped at the deadline
        assert user.delete(f"/v1/pools/{preempting}/leases/{lid}").status_code == 200
        t.join(WAIT_S)
        out["lease"].release()


def test_not_preemptible_through_the_broker_is_never_asked(broker_srv, preempting, rc):
    with Pool(broker_srv.url, preempting, token=USER_TOKEN) as sdk:
        lease = sdk.acquire("8GiB", ttl=1.5, preemptible=False)
        asked: list = []
        lease.on_yield(asked.append)
        with Pool(broker_srv.url, preempting, token=OTHER_TOKEN) as urgent:
            with pytest.raises(AcquireTimeout):  # past the grace: nothing asked, nothing taken
                urgent.acquire("6GiB", priority=10, timeout=2 * YIELD_GRACE_S)
        assert not asked and not lease.yield_requested and not lease.lost
        lease.release()
    assert _cfg(rc, "y_asked") == 0


JOB = textwrap.dedent("""
    import signal, sys, time
    def on_term(signum, frame):
        open(sys.argv[1], "a").write("TERM\\n")
        sys.exit(42)
    signal.signal(signal.SIGTERM, on_term)
    open(sys.argv[1] + ".ready", "w").write("1")
    while True:
        time.sleep(0.05)
""")


def test_run_through_the_broker_signals_its_command(broker_srv, preempting, tmp_path):
    marker = tmp_path / "m"
    env = dict(os.environ, GPULOCK_TOKEN=USER_TOKEN)
    env.pop("GPULOCK_REDIS_URL", None)
    p = subprocess.Popen(
        [sys.executable, "-m", "gpulock", "--broker-url", broker_srv.url, "run", "-p"]
        + [
            preempting,
            "-a",
            "8GiB",
            "--ttl",
            "3",
            "--",  # no --purpose: the command line (longer than a broker takes) is clipped
            sys.executable,
            "-c",
            JOB,
            str(marker),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: Path(str(marker) + ".ready").exists() or p.poll() is not None,
            WAIT_S,
            "CMD started",
        )
        assert p.poll() is None, p.communicate()
        with Pool(broker_srv.url, preempting, token=OTHER_TOKEN) as urgent:
            lease = urgent.acquire("6GiB", priority=10, timeout=WAIT_S)
            lease.release()
        out, err = p.communicate(timeout=WAIT_S)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 42, err
    assert marker.read_text() == "TERM\n" and "asked to yield" in err
