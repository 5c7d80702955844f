"""Tenant quotas on the command line: ``gpulock pool set --quota TENANT=SIZE`` sets, keeps and
removes them; ``gpulock status`` shows use per tenant and each lease's and waiter's tenant;
``gpulock run --tenant`` counts its lease under a tenant (exit 65 over the quota, a wait at it);
bad values exit 2 naming them with nothing changed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis
from support.waiting import wait_until
from integration.test_cli_pools import _status, gpulock

from gpulock import Pool

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def url(redis_proc1):
    return redis_proc1.url


def test_pool_set_quota_sets_keeps_and_removes(url):
    r = gpulock(url, "pool", "set", "q", "-c", "10GiB", "--quota", "a=4GiB", "--quota", "b=1GiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip().endswith("quotas a=4.0GiB b=1.0GiB"), r.stdout
    r = gpulock(url, "pool", "set", "q", "--quota", "b=none", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["quotas"] == {"a": 4 * 2**30}
    r = gpulock(url, "pool", "set", "q", "--capacity", "12GiB", "--json")  # kept
    assert json.loads(r.stdout)["quotas"] == {"a": 4 * 2**30}
    r = gpulock(url, "pool", "set", "q", "--quota", "a=0", "--json")
    assert json.loads(r.stdout)["quotas"] == {}
    assert _status(url, "q")["tenants"] == {}


def test_status_shows_tenants_and_run_counts_under_its_tenant(url, tmp_path):
    assert gpulock(url, "pool", "set", "q", "-c", "10GiB", "--quota", "a=4GiB").returncode == 0
    r = gpulock(url, "run", "--pool", "q", "--amount", "5GiB", "--tenant", "a", "--", "true")
    assert r.returncode == 65, (r.returncode, r.stderr)
    assert "exceeds the quota of tenant 'a'" in r.stderr, r.stderr
    pool = Pool.from_url(url, "q")
    try:
        held = pool.acquire(3 * 2**30, tenant="a")
        # a at 3 of its 4 GiB: a 2 GiB run of a waits (and times out), one of b runs
        r = gpulock(
            url, "run", "--pool", "q", "--amount", "2GiB", "--tenant", "a", "--timeout", "0",
            "--", "true",
        )  # fmt: skip
        assert r.returncode == 75, (r.returncode, r.stderr)
        r = gpulock(url, "run", "--pool", "q", "--amount", "2GiB", "--tenant", "b", "--", "true")
        assert r.returncode == 0, r.stderr
        flag = tmp_path / "waiting"
        waiter = subprocess.Popen(
            [sys.executable, "-m", "gpulock", "--redis-url", url, "run", "--pool", "q",
             "--amount", "2GiB", "--tenant", "a", "--timeout", "30", "--", "true"],
            stderr=flag.open("w"),
        )  # fmt: skip
        try:
            wait_until(lambda: "position 1" in flag.read_text(), timeout=20)
            st = _status(url, "q")
            assert st["tenants"] == {"a": {"used": 3 * 2**30, "quota": 4 * 2**30}}, st
            assert [li["tenant"] for li in st["leases"]] == ["a"]
            assert [w["tenant"] for w in st["waiters"]] == ["a"]
            r = gpulock(url, "status", "q")
            assert "tenants: a 3.0GiB of quota 4.0GiB" in r.stdout, r.stdout
            assert r.stdout.count(" tenant ") == 2, r.stdout  # both tables have the column
        finally:
            held.release()
            assert waiter.wait(30) == 0
    finally:
        pool.close()


@pytest.mark.parametrize(
    "args, shown",
    [
        (("--quota", "a"), "TENANT=SIZE"),
        (("--quota", "=4GiB"), "TENANT=SIZE"),
        (("--quota", "a b=4GiB"), "'a b'"),
        (("--quota", "a=lots"), "'lots'"),
        (("--quota", "a=-1"), "'-1'"),
        (("--quota", "a=0GiB"), "0 or none removes it"),
        (("--quota", "a=1GiB", "--quota", "a=2GiB"), "'a' is given twice"),
    ],
)
def test_pool_set_bad_quota_exits_2_naming_it(url, args, shown):
    assert gpulock(url, "pool", "set", "p", "--capacity", "1GiB", "--quota", "z=1").returncode == 0
    c = redis.Redis.from_url(url)
    try:
        before = {k: c.dump(k) for k in sorted(c.keys("*"))}
        r = gpulock(url, "pool", "set", "p", *args)
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        assert "--quota" in r.stderr and shown in r.stderr, r.stderr
        assert "Traceback" not in r.stderr, r.stderr
        assert {k: c.dump(k) for k in sorted(c.keys("*"))} == before  # nothing changed
    finally:
        c.close()


@pytest.mark.parametrize("bad, shown", [("a/b", "'a/b'"), ("", "empty tenant"), (" ", "empty")])
def test_run_bad_tenant_exits_2_naming_it(url, bad, shown):
    """An empty --tenant too: an unset variable in --tenant "$T" must not escape the quota."""
    assert gpulock(url, "pool", "set", "p", "--capacity", "1GiB").returncode == 0
    r = gpulock(url, "run", "--pool", "p", "--amount", "1", "--tenant", bad, "--", "true")
    assert r.returncode == 2 and shown in r.stderr and "--tenant" in r.stderr, r.stderr
