"""The preemption setting and what shows preemption (docs/SEMANTICS.md, "Preemption"), against
real servers: ``configure(preemption=...)`` sets, changes, keeps and turns it off, refuses bad
values naming them with nothing written, and a pool made again after Redis lost it keeps it;
``gpulock pool set --preempt-gap/--yield-grace/--no-preempt``; a lease asked to yield (a
low-priority holder of the whole pool, a request 20 levels above it queued at the head) as
``status()``, ``gpulock status`` (text and ``--json``), ``gpulock top`` and ``/metrics``' pool
families show it, and the counters once it yielded."""

from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from support.pools import snapshot
from support.procs import gpulock_argv
from support.waiting import async_wait_until, wait_until
from integration.test_cli_pools import gpulock

from gpulock import InvalidArgument, Pool, Preemption
from gpulock.errors import GpuLockError
from gpulock.protocol.keys import pool_keys

pytestmark = pytest.mark.timeout(120)

# Long enough that the asked lease is never taken back while a test reads it (the deadline is
# a bound on the test's speed only through this, and a loaded machine never nears it).
GRACE_S = 600.0


def wide(url: str, *args: str) -> subprocess.CompletedProcess:
    """``gpulock ARGS`` on a 200-column terminal (the tables' columns unwrapped)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    env.update(GPULOCK_REDIS_URL=url, COLUMNS="200")
    return subprocess.run(
        [*gpulock_argv(), *args], env=env, capture_output=True, text=True, timeout=60
    )


async def test_configure_sets_changes_keeps_and_turns_preemption_off(
    make_apool, rclient, pool_name
):
    pool = make_apool()
    out = await pool.configure(100)
    assert out["preemption"] is None  # a new pool: off
    out = await pool.configure(preemption=Preemption(5, 2.5))
    assert out["preemption"] == {"gap": 5, "yield_grace_s": 2.5}
    assert (await pool.status()).preemption == Preemption(5, 2.5)
    out = await pool.configure(preemption=Preemption(7))  # changed; the default grace
    assert out["preemption"] == {"gap": 7, "yield_grace_s": 30.0}
    out = await pool.configure(200, policy="backfill")  # None: unchanged
    assert out["preemption"] == {"gap": 7, "yield_grace_s": 30.0}
    assert (await pool.status()).preemption == Preemption(7)
    out = await pool.configure(preemption=False)
    assert out["preemption"] is None and (await pool.status()).preemption is None
    await pool.configure(preemption=Preemption(3, 1))
    before = snapshot(rclient)
    for bad, shown in (
        (True, "preemption must be None"),
        (5, "got 5"),
        ({"gap": 5}, "got {'gap': 5}"),
    ):
        with pytest.raises(InvalidArgument, match=shown):
            await pool.configure(preemption=bad)
    with pytest.raises(InvalidArgument, match="preemption gap must be an integer in"):
        await pool.configure(preemption=Preemption(0))
    with pytest.raises(InvalidArgument, match="yield_grace must be between 0.1 and 86400"):
        await pool.configure(preemption=Preemption(3, 0.01))
    assert snapshot(rclient) == before  # nothing changed
    # the script refuses what the vocabulary does (a raw ARGV 11 that skipped the checks)
    from gpulock.protocol.flow import configure_args

    for wire in ("0 30000", "201 30000", "5 99", "5 86400001", "5", "on"):
        argv = configure_args(200, 10_000, 60_000, False, False) + [""] * 5 + [wire]
        with pytest.raises(InvalidArgument):
            await pool._eval("configure", argv)
    assert snapshot(rclient) == before


async def test_a_pool_made_again_keeps_its_preemption(make_apool, rclient):
    pool = make_apool("pre-remake", default_ttl=3.0, poll_interval=0.2)
    await pool.configure(100, preemption=Preemption(4, 12))
    lease = await pool.acquire(10)
    rt = pool._runtime
    assert rt is not None and rt.recovery.policy_seen is not None
    assert rt.recovery.policy_seen.preempt == "4 12000"
    rclient.flushall()

    def back() -> bool:
        return rclient.hlen(pool_keys("pre-remake")[2]) == 1  # the lease put back

    await async_wait_until(back, 60, "the pool made again and the lease put back")
    assert (await pool.status()).preemption == Preemption(4, 12)
    await lease.release()


def test_pool_set_preemption_flags(redis_proc1):
    url = redis_proc1.url
    r = gpulock(url, "pool", "set", "pp", "-c", "10GiB", "--preempt-gap", "5")
    assert r.returncode == 0, r.stderr
    assert "preemption gap 5, yield grace 30s" in r.stdout, r.stdout
    r = gpulock(url, "pool", "set", "pp", "--preempt-gap", "3", "--yield-grace", "2m", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["preemption"] == {"gap": 3, "yield_grace_s": 120.0}
    r = gpulock(url, "pool", "set", "pp", "-c", "12GiB", "--json")  # kept
    assert json.loads(r.stdout)["preemption"] == {"gap": 3, "yield_grace_s": 120.0}
    r = gpulock(url, "pool", "set", "pp", "--preempt-gap", "3", "--yield-grace", "500ms", "--json")
    assert json.loads(r.stdout)["preemption"] == {"gap": 3, "yield_grace_s": 0.5}
    r = wide(url, "status", "pp")
    assert "preemption gap 3, yield grace 0.5s; asked 0, yielded 0, taken back 0" in r.stdout
    c = redis.Redis.from_url(url)
    try:
        before = snapshot(c)
        for args, shown in (
            (["--preempt-gap", "0"], "'0'"),
            (["--preempt-gap", "201"], "'201'"),
            (["--preempt-gap", "x"], "'x'"),
            (["--preempt-gap", "3", "--yield-grace", "50ms"], "'50ms'"),
            (["--preempt-gap", "3", "--yield-grace", "soon"], "'soon'"),
            (["--preempt-gap", "3", "--yield-grace", "2d"], "'2d'"),
            (["--yield-grace", "30s"], "needs --preempt-gap"),
            (["--no-preempt", "--preempt-gap", "3"], "--no-preempt"),
        ):
            r = gpulock(url, "pool", "set", "pp", *args)
            assert r.returncode == 2, (args, r.stdout, r.stderr)
            assert shown in r.stderr, (args, r.stderr)
        assert snapshot(c) == before  # nothing changed
    finally:
        c.close()
    r = gpulock(url, "pool", "set", "pp", "--no-preempt")
    assert r.returncode == 0 and "preemption off" in r.stdout, (r.stdout, r.stderr)
    r = gpulock(url, "status", "pp", "--json")
    assert json.loads(r.stdout)["preemption"] is None


def _metrics_text(st) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from gpulock.fastapi._metrics import _pool_families

    class One:
        def collect(self):
            return _pool_families(st.pool, st, None)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(One())  # type: ignore[arg-type]
    return generate_latest(reg).decode()


def _pool_samples(text: str, pool: str) -> dict[str, float]:
    return {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.labels.get("pool") == pool
    }


def test_an_asked_lease_in_status_top_and_metrics(redis_proc1):
    """A holder of the whole pool at priority -10; a request at 10 queues at the head and
    asks it to yield (gap 5): status shows the lease asked with its deadline and priority,
    the counters and the setting; once the holder releases, the request is granted and the
    counters say it yielded."""
    url, name = redis_proc1.url, "pre-asked"
    admin = Pool.from_url(url, name)
    waiter = Pool.from_url(url, name)
    got: list = []
    try:
        admin.configure(100, preemption=Preemption(5, GRACE_S))
        held = admin.acquire(100, priority=-10, holder={"job": "low"})

        def wait() -> None:
            try:
                got.append(waiter.acquire(60, priority=10, timeout=100, holder={"job": "high"}))
            except GpuLockError as e:
                got.append(e)

        th = threading.Thread(target=wait, daemon=True)
        th.start()
        st = wait_until(
            lambda: (s := admin.status()).yields.asked == 1 and s, 60, "the holder asked"
        )
        (lease,) = st.leases
        assert lease.lease_id == held.id and lease.priority == -10 and lease.yield_requested
        assert lease.yield_in is not None and 0 < lease.yield_in <= GRACE_S
        assert st.yielding == [lease] and st.yields.outstanding == 1
        assert st.preemption == Preemption(5, GRACE_S)
        assert [w.priority for w in st.waiters] == [10]

        r = gpulock(url, "status", name, "--json")
        d = json.loads(r.stdout)
        assert d["preemption"] == {"gap": 5, "yield_grace_s": GRACE_S}
        assert d["yields"] == {"asked": 1, "done": 0, "done_seconds": 0.0, "taken": 0}
        (li,) = d["leases"]
        assert li["priority"] == -10 and 0 < li["yield_in"] <= GRACE_S
        r = wide(url, "status", name)
        assert "preemption gap 5, yield grace 600s; asked 1, yielded 0, taken back 0" in r.stdout
        assert "yield by " in r.stdout and "priority" in r.stdout, r.stdout
        r = wide(url, "top", name, "--once")
        assert r.returncode == 0, r.stderr
        assert "preemption gap 5, grace 600s  asked 1  yielded 0  taken back 0" in r.stdout
        assert "yield by" in r.stdout and "in 9m" in r.stdout, r.stdout

        vals = _pool_samples(_metrics_text(st), name)
        assert (
            vals["gpulock_pool_yields_asked_total"] == 1
            and vals["gpulock_pool_leases_yielding"] == 1
        )
        assert (
            vals["gpulock_pool_yields_done_total"] == 0
            and vals["gpulock_pool_yields_taken_total"] == 0
        )
        assert (
            vals["gpulock_pool_yield_seconds_count"] == 0
            and vals["gpulock_pool_yield_seconds_sum"] == 0
        )

        held.release()
        th.join(100)
        (lease2,) = got
        assert not isinstance(lease2, Exception), lease2
        st = admin.status()
        assert (st.yields.asked, st.yields.done, st.yields.taken) == (1, 1, 0)
        assert st.yields.outstanding == 0 and st.yields.mean_time_to_yield is not None
        assert [li.yield_in for li in st.leases] == [None]  # the new lease: not asked
        vals = _pool_samples(_metrics_text(st), name)
        assert (
            vals["gpulock_pool_yields_done_total"] == 1
            and vals["gpulock_pool_leases_yielding"] == 0
        )
        assert vals["gpulock_pool_yield_seconds_count"] == 1
        assert vals["gpulock_pool_yield_seconds_sum"] == st.yields.done_seconds
        lease2.release()
    finally:
        waiter.close()
        admin.close()
