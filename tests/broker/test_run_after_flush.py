"""``gpulock run`` after Redis lost its pool (FLUSHALL; a restart without data is the same to
it): through a broker whose pool object saw the pool, the acquire makes it again as last seen,
with its grace period, and the command runs after it (exit 0), on the lease's device; a pool
that nobody saw (never set, or a run straight to Redis, whose pool object is new) is still
exit 66 with the hint to create it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import redis

from gpulock import Pool
from gpulock.cli import EXIT_NO_POOL, EXIT_USAGE
from support.pools import config

from ._support import USER_TOKEN

# A hang catcher, not a speed check: a test here runs a few `python -m gpulock` processes,
# each a second or more on a loaded machine, and waits out a 2 s grace period.
pytestmark = pytest.mark.timeout(300)

# CMD: prints its GPULOCK_DEVICE and CUDA_VISIBLE_DEVICES
SHOW = "import os; e = os.environ.get; print(e('GPULOCK_DEVICE'), e('CUDA_VISIBLE_DEVICES'))"


def run_show(
    *,
    broker: str | None = None,
    redis_url: str | None = None,
    pool: str,
    visible: str | None = None,
) -> subprocess.CompletedProcess:
    """``gpulock run`` (ttl 2 s, --timeout 60: well past a 2 s grace period) of SHOW, through
    the broker or straight to Redis, with ``visible`` as its own CUDA_VISIBLE_DEVICES."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("CUDA_DEVICE_ORDER", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    where = ["--broker-url", broker] if broker else ["--redis-url", str(redis_url)]
    if broker:
        env["GPULOCK_TOKEN"] = USER_TOKEN
    return subprocess.run(
        [sys.executable, "-m", "gpulock", *where, "run", "--pool", pool, "--amount", "1GiB"]
        + ["--ttl", "2", "--timeout", "60", "--", sys.executable, "-c", SHOW],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )


@pytest.fixture
def direct(redis_srv):
    c = redis.Redis.from_url(redis_srv.url)
    yield c
    c.close()


def operator_sets(url: str, name: str, **devices: object) -> None:
    """`gpulock pool set NAME --capacity 4GiB --max-ttl 2` (so the grace period is 2 s)."""
    with Pool.from_url(url, name) as p:
        p.configure("4GiB", max_ttl=2, **devices)


def test_run_through_the_broker_after_a_flushall_runs_after_the_grace_period(
    redis_srv, broker_srv, direct
):
    operator_sets(redis_srv.url, "qpool")
    first = run_show(broker=broker_srv.url, pool="qpool")
    assert first.returncode == 0, first.stderr  # the broker's pool object saw the pool
    old = config(direct, "qpool")
    direct.flushall()
    r = run_show(broker=broker_srv.url, pool="qpool")
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.split() == ["0", "None"], r.stdout  # a pool of one device: left alone
    cfg = config(direct, "qpool")
    # made again by the acquire, as last seen, with the grace period; released at the end
    assert cfg["epoch"] != old["epoch"] and cfg["grace_until"] > 0, cfg
    assert (cfg["capacity"], cfg["max_ttl_ms"], cfg["used"]) == (4 << 30, 2000, 0), cfg


def test_run_through_the_broker_after_a_flushall_pins_the_leases_device(
    redis_srv, broker_srv, direct
):
    """A pool of two devices lost before the run: the run learns it has two only after the
    grant, and pins CMD to the lease's GPU as it would have; a CUDA_VISIBLE_DEVICES that
    hides a device the lease may be on is exit 2 then, with the lease released."""
    operator_sets(redis_srv.url, "node", devices=2)
    assert run_show(broker=broker_srv.url, pool="node/1").returncode == 0
    direct.flushall()
    r = run_show(broker=broker_srv.url, pool="node/1", visible="5,6")
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.split() == ["1", "6"], r.stdout  # device 1: the 2nd GPU shown
    assert config(direct, "node")["grace_until"] > 0  # it was made again by the acquire

    direct.flushall()
    r = run_show(broker=broker_srv.url, pool="node", visible="5")
    assert r.returncode == EXIT_USAGE, (r.returncode, r.stdout, r.stderr)
    assert "CUDA_VISIBLE_DEVICES='5' shows 1 GPU(s)" in r.stderr, r.stderr
    assert r.stdout == ""  # CMD never ran
    cfg = config(direct, "node")
    assert cfg["grace_until"] > 0 and cfg["used"] == 0, cfg  # granted, then released


@pytest.mark.parametrize("through", ["broker", "redis"])
def test_run_on_a_pool_never_set_is_exit_66_with_the_hint(redis_srv, broker_srv, direct, through):
    where = {"broker": broker_srv.url} if through == "broker" else {"redis_url": redis_srv.url}
    r = run_show(**where, pool="never")  # type: ignore[arg-type]
    assert r.returncode == EXIT_NO_POOL, (r.returncode, r.stderr)
    assert "pool 'never' is not configured in" in r.stderr, r.stderr
    assert "pool set never --capacity SIZE" in r.stderr, r.stderr
    assert r.stdout == "" and direct.keys("*") == []  # nothing ran, nothing made


def test_run_straight_to_redis_after_a_flushall_is_exit_66(redis_srv, direct):
    """Straight to Redis, gpulock run's pool object is new: it never saw the pool, so it
    cannot tell a lost pool from one never set, and makes nothing."""
    operator_sets(redis_srv.url, "qpool")
    assert run_show(redis_url=redis_srv.url, pool="qpool").returncode == 0
    direct.flushall()
    r = run_show(redis_url=redis_srv.url, pool="qpool")
    assert r.returncode == EXIT_NO_POOL, (r.returncode, r.stderr)
    assert "pool set qpool --capacity SIZE" in r.stderr, r.stderr
    assert r.stdout == "" and direct.keys("*") == []
