"""A pool in its restart grace period (Redis lost its data; nothing new is granted until one
max_ttl has passed) is named as such on every surface of a refused or timed-out acquire,
never as a lack of memory: the broker's 503 (its message, a ``grace_left`` field, a
Retry-After of the grace, up to the broker's cap), the SDK's AcquireTimeout and its pool
object, and ``gpulock run``'s waiting and error lines, through the broker and through Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import gpulock_client
import pytest
import redis
from support.pools import GiB, raw

from gpulock.protocol.keys import pool_keys

from ._support import USER_TOKEN

GRACE_MS = 30_000


@pytest.fixture
def grace_floor(redis_srv):
    """Makes pool ``graced`` (10 GiB, nothing held) as the core makes it again after Redis lost
    it: with a grace period of one max_ttl (30 s). Returns a function: the least ``grace_left``
    (seconds) that a read made after the call can report, less 1 s for rounding (the grace
    began after this fixture's start; a loaded machine can take several seconds per step)."""
    t0 = time.monotonic()
    c = redis.Redis.from_url(redis_srv.url)
    r = raw(c, "graced", "configure", 10 * GiB, 100, "create", GRACE_MS, "1")
    assert int(r[0]) == 1 and 29_000 < int(r[6]) <= GRACE_MS, r
    c.close()
    return lambda: GRACE_MS / 1000 - (time.monotonic() - t0) - 1


@pytest.fixture
def graced(grace_floor):
    """The name of the pool :func:`grace_floor` made."""
    return "graced"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env["GPULOCK_TOKEN"] = USER_TOKEN
    return subprocess.run(
        [sys.executable, "-m", "gpulock", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_grace_period_is_named_by_the_broker_the_sdk_and_gpulock_run(
    redis_srv, broker_srv, user, graced, grace_floor
):
    r = user.post(f"/v1/pools/{graced}/leases", json={"amount": "1GiB", "ttl": 5, "wait": 0.3})
    d = r.json()["detail"]
    assert r.status_code == 503 and d["error"] == "queued", r.text
    assert "restart grace period" in d["message"] and "Redis lost its data" in d["message"], d
    assert grace_floor() < d["grace_left"] <= 30, d
    assert r.headers["retry-after"] == "5", r.headers  # the grace, up to the broker's cap (5 s)
    assert user.delete(f"/v1/pools/{graced}/requests/{d['request_id']}").status_code == 200
    r = user.post(f"/v1/pools/{graced}/leases", json={"amount": "1GiB", "queue": False})
    d = r.json()["detail"]
    assert r.status_code == 503 and d["error"] == "busy" and d["grace_left"] > grace_floor(), r.text
    assert "restart grace period" in d["message"], d

    with gpulock_client.Pool(broker_srv.url, graced, token=USER_TOKEN) as p:
        with pytest.raises(gpulock_client.AcquireTimeout) as e:
            p.acquire("1GiB", timeout=0.5)
        assert "restart grace period" in str(e.value), e.value
        assert grace_floor() < e.value.grace_left <= 30, e.value
        assert grace_floor() < p.grace_left() <= 30

    # --timeout covers the calls gpulock run makes before its acquire (reading the pool): 0.5 s
    # left nothing for the acquire, so no wait in the queue, when they took longer on a loaded
    # machine. 3 s is still far inside the grace period (30 s).
    for target in (["--broker-url", broker_srv.url], ["--redis-url", redis_srv.url]):
        out = _run(
            *target, "run", "--pool", graced, "--amount", "1GiB", "--timeout", "3", "--", "true"
        )
        assert out.returncode == 75, (target, out.returncode, out.stderr)
        *lines, error = out.stderr.strip().splitlines()
        if target[0] == "--redis-url":  # the grace outlasts the timeout: it never waited
            assert not lines, out.stderr
        else:  # the SDK keeps its place at the broker until its timeout
            assert "position 1 in the queue" in lines[-1], out.stderr
            assert "restart grace period" in lines[-1], out.stderr
        assert error.startswith("gpulock: error: no lease") and "restart grace period" in error, (
            out.stderr
        )


def test_a_long_poll_that_ends_before_the_grace_period_is_answered_at_once(
    redis_srv, user, graced, grace_floor
):
    """Nothing is granted for 30 s: a request that would be held 5 s is answered at once
    (503, Retry-After to the grace end up to the broker's cap), its place kept for its retry."""
    t0 = time.monotonic()
    r = user.post(f"/v1/pools/{graced}/leases", json={"amount": "1GiB", "ttl": 5, "wait": 5})
    elapsed = time.monotonic() - t0
    d = r.json()["detail"]
    # "at once": well before the 5 s the long poll would have held it (2.5 s left a loaded
    # machine too little room; the bound is what tells the two apart, not a speed target)
    assert r.status_code == 503 and d["error"] == "queued" and elapsed < 4.0, (elapsed, r.text)
    assert grace_floor() < d["grace_left"] <= 30 and r.headers["retry-after"] == "5", (d, r.headers)
    c = redis.Redis.from_url(redis_srv.url)
    assert c.zcard(pool_keys(graced).queue) == 1  # the place is kept for the retry
    assert user.delete(f"/v1/pools/{graced}/requests/{d['request_id']}").status_code == 200
    assert c.zcard(pool_keys(graced).queue) == 0
    c.close()
