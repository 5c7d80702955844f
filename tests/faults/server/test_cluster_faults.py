"""kill -9 (and SIGSTOP) of a pool's master on a real Redis Cluster / Valkey cluster (3 masters,
3 replicas, started here): the cluster promotes the master's replica (cluster-node-timeout 1 s),
and

* a call made while the shard has no master is retried until the promotion (within its
  bound), not failed;
* with ``sync_replicas=1`` (and two replicas per master, so that one is left to acknowledge
  after the promotion) a lease held across the failover is kept (every grant and renewal
  the holder relied on reached the replica first), its heartbeat renews it on the new master,
  a waiter queued before the kill is granted after it, and fencing tokens keep increasing;
* several processes acquiring on pools spread over the masters through such a failover never
  hold more than a pool's capacity (recorded history, swept on the server clock), and none of
  their calls fails.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cluster import Cluster, start_cluster
from support.history import max_concurrent
from support.procs import finish_all, kill_all
from support.soaklog import read_logs
from support.waiting import wait_until

from gpulock import AsyncPool
from gpulock.protocol.keys import pool_key

pytestmark = pytest.mark.timeout(180)

WORKER = Path(__file__).parents[1] / "clients" / "_soak_worker.py"


@pytest.fixture
def cluster(server_binary):
    # Two replicas per master: after a promotion the shard still has one to acknowledge
    # sync_replicas=1 (with one, every renewal after the failover would go unacknowledged).
    c = start_cluster(server_binary, replicas=2)
    yield c
    c.stop()


def _on(c: Cluster, master: int, prefix: str) -> str:
    """A pool name whose slot master ``master`` serves."""
    return c.names_by_master(prefix)[master][0]


def _promoted(c: Cluster, key: str, old) -> bool:
    try:
        return c.master_of(key) is not old
    except RuntimeError:
        return False


async def _wait_for(pred, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_master_kill_keeps_synced_leases_and_wakes_waiters(cluster):
    name = _on(cluster, 1, "kill")
    key = pool_key(name, "cfg")
    master = cluster.masters[1]
    p = AsyncPool.from_url(cluster.url, name, sync_replicas=1, sync_timeout=2.0)
    try:
        await p.configure(100)
        held = await p.acquire(60, ttl=12)  # outlasts the failover on a loaded machine
        waiter = asyncio.create_task(p.acquire(60, ttl=12, timeout=60))
        while not (await p.status()).waiter_count:
            await asyncio.sleep(0.01)
        master.kill()
        t0 = time.monotonic()
        # A call made while the shard has no master (connection refused, then CLUSTERDOWN or
        # MOVED to the promoted replica) is retried within its bound, not failed.
        during = AsyncPool.from_url(cluster.url, name, backend_timeout=30)
        try:
            st = await during.status()
        finally:
            await during.aclose()
        assert [li.lease_id for li in st.leases] == [held.id]
        await _wait_for(lambda: _promoted(cluster, key, master), "the replica's promotion")
        promoted_s = time.monotonic() - t0
        # The new master knows the lease (acknowledged by a replica before it was used).
        st = await p.status()
        assert [li.lease_id for li in st.leases] == [held.id], st
        # The waiter's queue record is not synced (nothing relies on it): if the failover lost
        # it, the pool object's periodic refresh queues it again.
        while not (await p.status()).waiter_count:
            assert time.monotonic() - t0 < 60, "the waiter was never queued on the new master"
            await asyncio.sleep(0.05)
        # The heartbeat renews the lease on the new master: its validity moves on.
        before = held.valid_until
        await _wait_for(lambda: held.valid_until > before, "a renewal on the new master")
        assert not held.lost
        held.ensure_valid()
        await held.release()
        lease = await asyncio.wait_for(waiter, 30)  # woken on the new master
        assert lease.token > held.token
        st = await p.status()
        assert st.used == 60 and st.lease_count == 1
        await lease.release()
        print(f"\ncluster failover: replica promoted {promoted_s:.2f}s after kill -9")
    finally:
        await p.aclose()


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_processes_through_a_master_fault_never_overbook(cluster, tmp_path, how):
    """Pools on two masters, two processes each (sync and async pools), sync_replicas=1;
    one master is killed (kill -9) or stopped (SIGSTOP) once every process has had grants.
    Each pool's recorded holds never exceed its capacity (swept on the server clock), and no
    call fails: the acquires (timeout 30 s) ride the election, those on the other master never
    notice. The workers run until each pool has made ``AFTER`` more grants after the fault (the
    test observes it, then writes the end instant the workers read). (Before, BackendUnavailable
    was tolerated here: both pools' calls failed while the master was away.)"""
    names = [_on(cluster, 0, "hist"), _on(cluster, 2, "hist")]
    from gpulock import Pool

    for n in names:
        with Pool.from_url(cluster.url, n) as p:
            p.configure(100)
    end_file = tmp_path / "end_at"
    env = {
        **os.environ,
        "GPULOCK_SOAK_SYNC_REPLICAS": "1",
        "GPULOCK_SOAK_SYNC_TIMEOUT": "1.0",
        "GPULOCK_SOAK_TTL": "5",  # a release retries while its lease is valid: past the election
        # the TIME reads: a master that stays up (loopback nodes share one clock)
        "GPULOCK_SOAK_CLOCK_URL": cluster.node_url(1),
    }
    logs = [tmp_path / f"{n}-w{i}.log" for n in names for i in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                cluster.url,
                n,
                str(logs[2 * j + i]),
                str(10 * j + i),
                f"@{end_file}",
                "60",
                "0",
                "sync" if i == 0 else "async",
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for j, n in enumerate(names)
        for i in range(2)
    ]

    def grants(f: Path) -> int:
        return sum(ln.startswith("G ") for ln in f.read_text().splitlines()) if f.exists() else 0

    def pool_grants() -> list[int]:
        return [grants(logs[2 * j]) + grants(logs[2 * j + 1]) for j in range(2)]

    AFTER = 10  # grants per pool after the fault: the faulted pool's rode the election
    try:
        # Bounds on failure only; every step waits on what the logs show.
        wait_until(
            lambda: all(grants(f) >= 3 for f in logs) or any(pr.poll() is not None for pr in procs),
            timeout=120,
            what="every worker made grants",
        )
        assert all(pr.poll() is None for pr in procs), "a worker ended early"
        if how == "kill":
            cluster.masters[0].kill()
        else:
            cluster.pause(cluster.masters[0])
        at_fault = pool_grants()
        wait_until(
            lambda: (
                all(g >= a + AFTER for g, a in zip(pool_grants(), at_fault))
                or any(pr.poll() is not None for pr in procs)
            ),
            timeout=180,
            what=f"{AFTER} grants per pool after the fault",
        )
        tmp = end_file.with_suffix(".tmp")
        tmp.write_text(repr(time.time()))
        tmp.rename(end_file)
        finish_all(procs, timeout=120)
    finally:
        kill_all(procs)
    for n in names:
        h = read_logs(tmp_path.glob(f"{n}-w*.log"))
        errors = h.errors
        assert not errors, errors[:5]
        peak, at = max_concurrent(h.intervals())
        print(f"\npool {n}: {len(h.grants)} grants, peak {peak}/100")
        assert peak <= 100, f"pool {n}: {peak} bytes in use at server time {at} us"
    assert all(g >= a + AFTER for g, a in zip(pool_grants(), at_fault)), (at_fault, pool_grants())


async def test_a_shard_without_a_master_leaves_the_other_pools_working(server_binary):
    """A shard whose master died with no replica to promote (its slots fail): new pool objects
    and processes still lease from pools on the other masters. (redis-py's asyncio cluster
    client sends COMMAND to the first primary it lists when it starts: with that shard down
    every new client failed, for every pool.)"""
    from gpulock import Pool

    c = start_cluster(server_binary, masters=3, replicas=0)
    try:
        names = [_on(c, 1, "alive"), _on(c, 2, "alive")]
        for n in names:
            with Pool.from_url(c.url, n) as p:
                p.configure(100)
        c.masters[0].kill()  # slots 0-5460: the shard redis-py lists first
        for n in names:
            ap = AsyncPool.from_url(c.url, n, poll_interval=60, backend_timeout=10)
            try:
                held = await ap.acquire(80, ttl=10)
                waiter = asyncio.create_task(ap.acquire(80, ttl=10, timeout=20))
                while not (await ap.status()).waiter_count:
                    await asyncio.sleep(0.02)
                await held.release()
                await (await asyncio.wait_for(waiter, 15)).release()
            finally:
                await ap.aclose()
            with Pool.from_url(c.url, n, backend_timeout=10) as sp:
                sp.acquire(10, ttl=5).release()
            r = subprocess.run(
                [sys.executable, "-m", "gpulock", "--redis-url", c.url, "status", n],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert r.returncode == 0, r.stderr
    finally:
        c.stop()
