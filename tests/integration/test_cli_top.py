"""``gpulock top`` (issue 15): the dashboard's view in the terminal, run as a real process
against a real Redis the test starts; ``--once`` and ``--iterations`` render and exit."""

from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest

from gpulock.errors import GpuLockError
from gpulock.units import format_size
from support.pools import GiB
from support.procs import gpulock_argv
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(90)


def cli(url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPULOCK_REDIS_URL": url, "COLUMNS": "200"}
    return subprocess.run(
        [*gpulock_argv(), *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_top_once_shows_the_pool_its_leases_and_its_queue(redis_proc, make_pool, pool_name):
    pool = make_pool(capacity=4 * GiB)
    a = pool.acquire(GiB, holder={"job": "train"})
    b = pool.acquire(2 * GiB, holder={"purpose": "resident:model"}, resident=True)
    waiter = make_pool()
    got: list = []

    def wait_for_2() -> None:  # fits next to the resident 2 GiB once the 1 GiB is back
        try:
            got.append(waiter.acquire(2 * GiB, timeout=60, holder={"job": "eval"}))
        except GpuLockError as e:
            got.append(e)

    th = threading.Thread(target=wait_for_2, daemon=True)
    th.start()
    try:
        wait_until(lambda: pool.status().waiter_count == 1, 10, "the waiter")
        r = cli(redis_proc.url, "top", pool_name, "--once")
        assert r.returncode == 0, r.stderr
        out = r.stdout
        st = json.loads(cli(redis_proc.url, "status", pool_name, "--json").stdout)
        assert pool_name in out
        assert f"capacity {format_size(st['capacity'])}" in out
        assert (
            f"used {format_size(st['used'])}" in out and f"resident {format_size(2 * GiB)}" in out
        )
        assert "leases 2" in out and "queued 1" in out
        for lz in st["leases"]:
            assert str(lz["token"]) in out
        assert "job=train" in out and "job=eval" in out and "queue (1)" in out
        # several frames, then it exits by itself
        r = cli(redis_proc.url, "top", pool_name, "--iterations", "2", "--interval", "0.1")
        assert r.returncode == 0, r.stderr
        # not a terminal (a pipe): each frame is printed, not only the last
        assert r.stdout.count("queue (1)") == 2, r.stdout
        # every pool, and a pool that does not exist
        r = cli(redis_proc.url, "top", "--once")
        assert r.returncode == 0 and pool_name in r.stdout
        # one frame of a pool that does not exist says so, and fails as gpulock status does
        r = cli(redis_proc.url, "top", "nosuchpool", "--once")
        assert r.returncode == 66 and "not configured" in r.stdout, (r.returncode, r.stdout)
        r = cli("redis://127.0.0.1:1/0", "top", pool_name, "--once")
        assert r.returncode == 69, (r.returncode, r.stdout, r.stderr)
    finally:
        waiter.close()
        th.join(10)
        a.release()
        b.release()


def test_top_once_and_iterations_together_is_a_usage_error(redis_proc):
    r = cli(redis_proc.url, "top", "--once", "--iterations", "3")
    assert r.returncode == 2 and "not both" in r.stderr


def test_top_with_no_pools_says_so(redis_proc):
    r = cli(redis_proc.url, "top", "--once")
    assert r.returncode == 0 and "no pools" in r.stdout


def test_top_shows_the_device_report_and_its_over_users(redis_proc, make_pool, pool_name):
    import asyncio

    from gpulock import AsyncPool

    make_pool().configure(4 * GiB)
    over = [
        {"pid": 7, "holder": {"job": "hog"}, "leased": GiB, "actual": 3 * GiB, "excess": 2 * GiB}
    ]

    async def report() -> None:
        p = AsyncPool.from_url(redis_proc.url, pool_name)
        try:
            await p.device_report("s1", 60_000, GiB, 60_000, json.dumps(over))
        finally:
            await p.aclose()

    asyncio.run(report())
    r = cli(redis_proc.url, "top", pool_name, "--once")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "device: 1.0GiB in use outside the leases, effective capacity 3.0GiB" in out, out
    assert "over-user: job=hog uses 3.0GiB for a lease of 1.0GiB (2.0GiB over)" in out, out
    assert "free 3.0GiB" in out


def test_top_shows_the_pools_policy_and_each_waiters_priority(redis_proc, make_pool, pool_name):
    """The queue lists each waiter's priority (a column after the amount), and the head says
    the pool's queue policy (FIFO, or backfill with its window)."""
    pool = make_pool()
    pool.configure(4 * GiB, policy="backfill", backfill_window=30)
    lease = pool.acquire(4 * GiB)
    waiters = [make_pool(), make_pool()]
    got: list = []

    def wait(p, amount: int, prio: int, job: str) -> None:
        try:
            got.append(p.acquire(amount, timeout=60, priority=prio, holder={"job": job}))
        except GpuLockError as e:
            got.append(e)

    threads = [
        threading.Thread(target=wait, args=(waiters[0], 3 * GiB, 0, "low"), daemon=True),
        threading.Thread(target=wait, args=(waiters[1], 2 * GiB, 7, "high"), daemon=True),
    ]
    try:
        threads[0].start()
        wait_until(lambda: pool.status().waiter_count == 1, 10, "the first waiter")
        threads[1].start()
        wait_until(lambda: pool.status().waiter_count == 2, 10, "the second waiter")
        r = cli(redis_proc.url, "top", pool_name, "--once")
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert "policy backfill (window 30s)" in out, out
        assert "priority" in out, out

        def row(job: str) -> list[str]:
            (line,) = [ln for ln in out.splitlines() if f"job={job}" in ln]
            return [c for c in line.replace("│", " ").split() if c]

        assert row("high")[:3] == ["1", "2.0GiB", "7"], out
        assert row("low")[:3] == ["2", "3.0GiB", "0"], out
        pool.configure(4 * GiB, policy="fifo")
        r = cli(redis_proc.url, "top", pool_name, "--once")
        assert r.returncode == 0 and "policy fifo" in r.stdout, (r.stdout, r.stderr)
    finally:
        for w in waiters:
            w.close()
        for th in threads:
            th.join(10)
        lease.release()


def test_top_labels_a_queued_growth_by_its_leases_token(redis_proc, make_pool, pool_name):
    """A growth waiting in the queue (lease.resize) shows in the queue as the growth of its
    lease, named by the lease's fencing token (the view names no lease id), by the bytes it
    grows by; a new request shows "-" there."""
    pool = make_pool(capacity=4 * GiB)
    a = pool.acquire(2 * GiB, holder={"job": "stream-a"})
    b = pool.acquire(2 * GiB, holder={"job": "stream-b"})
    got: dict = {}  # by thread: the two end in either order

    def grow() -> None:
        try:
            a.resize(3 * GiB, timeout=60)  # B may free bytes: queued until it does
            got["grow"] = a.amount
        except GpuLockError as e:
            got["grow"] = e

    def new() -> None:
        try:
            got["new"] = make_pool().acquire(GiB, timeout=60, holder={"job": "new"})
        except GpuLockError as e:
            got["new"] = e

    threads = [
        threading.Thread(target=grow, daemon=True),
        threading.Thread(target=new, daemon=True),
    ]
    try:
        threads[0].start()
        wait_until(lambda: pool.status().waiter_count == 1, 10, "the growth queued")
        threads[1].start()
        wait_until(lambda: pool.status().waiter_count == 2, 10, "the new request queued")
        r = cli(redis_proc.url, "top", pool_name, "--once")
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert "growth of" in out, out

        def row(job: str) -> list[str]:
            """The queue's row of ``job`` (a lease's row starts with its holder)."""
            rows = [[c for c in ln.replace("│", " ").split() if c] for ln in out.splitlines()]
            (r,) = [r for r in rows if f"job={job}" in r and r[0].isdigit()]
            return r

        assert row("stream-a")[:5] == ["1", "1.0GiB", "token", str(a.token), "+1.0GiB"], out
        assert row("new")[:4] == ["2", "1.0GiB", "-", "0"], out
    finally:
        b.release()  # the growth is granted, then the new request (1 GiB left)
        for th in threads:
            th.join(10)
        for x in got.values():
            if not isinstance(x, (int, GpuLockError)):
                x.release()
        a.release()
    assert got["grow"] == 3 * GiB and not isinstance(got["new"], GpuLockError), got
