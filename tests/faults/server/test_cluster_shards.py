"""One shard's failure touches only its own pools: a real Redis Cluster and a real Valkey cluster
(3 masters with one replica each, cluster-node-timeout 1 s), started here once per server kind
and shared by this module's tests, each of which heals what it broke (the killed node started
again, the stopped one resumed: each rejoins as a replica).

* kill -9 and SIGSTOP of a master (connects succeed, replies never come), with a pool on every
  master in one process on one client, ``AsyncPool`` and ``Pool``: the pools on the other
  masters keep granting through the outage with no error; the faulted master's pool grants again
  after the promotion (its acquires, with time left, ride the election instead of failing); a
  lease held across the failover is renewed on the new master, and a waiter queued before it is
  granted after it. (Before: every pool of the client stopped with "Error 111 connecting to"
  the dead master, for good with ``AsyncPool``; redis-py learnt each FCALL's keys from one
  "default" master.)
* a replica killed, then the slot of a busy pool migrated key by key under load (ASK, TRYAGAIN
  for 1.6 s): no call fails (redis-py's redirect budget leaked "TTL exhausted" from release()).
* ``gpulock run --timeout 45`` with a plain URL of a live node, started right after the pool's
  master was killed and its replica stopped for 10 s, rides the outage (it exited 69).

Timings (the stall of the other shards, promotion to first grant) are measured by
benchmarks/cluster_faults.py, not asserted here: these tests assert what happened.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest
from support.cluster import (
    Cluster,
    Failover,
    masters_now,
    pool_on,
    seeds_url,
    start_cluster,
    wait_replicated,
)
from support.servers import server_kinds
from support.shard_load import ShardLoad

from gpulock import Pool
from gpulock.protocol.keys import pool_key

pytestmark = pytest.mark.timeout(180)

KINDS = dict(server_kinds())
#: (fault, shell, server kind): each fault and each shell on each kind of server, once.
CASES = [
    ("kill", "async", "redis"),
    ("kill", "sync", "embedded"),
    ("stop", "sync", "redis"),
    ("stop", "async", "embedded"),
]


@pytest.fixture(scope="module")
def clusters():
    made: dict[str, Cluster] = {}

    def get(kind: str) -> Cluster:
        if kind not in KINDS:
            kind = next(iter(KINDS))  # this machine has one kind only
        if kind not in made:
            made[kind] = start_cluster(KINDS[kind], masters=3, replicas=1, node_timeout_ms=1000)
        return made[kind]

    yield get
    for c in made.values():
        c.stop()


def _hold_and_queue(load: ShardLoad, name: str) -> tuple:
    """On pool ``name`` (of the load's client): a lease of the whole capacity (ttl 8 s:
    renewed every 2.7 s, valid through the failover), and a waiter queued behind it (timeout
    30 s). Returns (lease,
    the waiter's outcome holder: a future (async) or a list filled by a thread (sync))."""
    if load.shell == "async":

        async def go(pools):
            p = pools[name]
            lease = await p.acquire(100, ttl=8)
            waiter = asyncio.ensure_future(p.acquire(100, ttl=8, timeout=30))
            return lease, waiter

        return load.run(go)
    p = load.pools[name]
    lease = p.acquire(100, ttl=8)
    out: list = []

    def wait() -> None:
        try:
            out.append(p.acquire(100, ttl=8, timeout=30))
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            out.append(e)

    threading.Thread(target=wait, daemon=True).start()
    return lease, out


def _release_and_take(load: ShardLoad, lease, waiter) -> int:
    """Release ``lease``; the waiter's grant (released at once): its token."""
    if load.shell == "async":

        async def go(_pools):
            await lease.release()
            got = await asyncio.wait_for(waiter, 20)
            await got.release()
            return got.token

        return load.run(go)
    lease.release()
    deadline = time.monotonic() + 20
    while not waiter:
        assert time.monotonic() < deadline, "the waiter was not granted"
        time.sleep(0.01)
    got = waiter[0]
    assert not isinstance(got, Exception), got
    got.release()
    return got.token


@pytest.mark.parametrize("how,shell,kind", CASES)
def test_a_dead_or_hung_master_stalls_no_other_shard(clusters, how, shell, kind):
    c = clusters(kind)
    masters = masters_now(c)
    victim = masters[0]
    loaded = [pool_on(c, m, f"ld-{how}-{shell}-") for m in masters]
    held = pool_on(c, victim, f"hd-{how}-{shell}-")
    for n in [*loaded, held]:
        with Pool.from_url(c.url, n) as p:
            p.configure(100)
    url = seeds_url(victim, masters[1])  # one URL, two seeds: the faulted master first
    load = ShardLoad(url, loaded, shell).start(extra=[held])
    fault = Failover(c, victim, how)
    try:
        lease, waiter = _hold_and_queue(load, held)
        with Pool.from_url(c.url, held) as probe:
            deadline = time.monotonic() + 10
            while probe.status().waiter_count != 1:
                assert time.monotonic() < deadline, "the waiter did not queue"
                time.sleep(0.01)
        wait_replicated(c, victim)  # the lease and the waiter's place are on the replica
        t_fault = fault.start()
        t_promo = fault.promoted()
        before = lease.valid_until  # no renewal got through since the fault
        # The faulted pool grants again after the promotion; its acquires rode the election.
        deadline = time.monotonic() + 20
        while load.first_after(loaded[0], t_promo) is None:
            assert time.monotonic() < deadline, f"no grant after the promotion: {load.errors[:3]}"
            time.sleep(0.02)
        # The lease held across the failover is renewed on the new master: its validity moves
        # past what the last renewal before the fault gave it.
        deadline = time.monotonic() + 10
        while lease.valid_until <= before:
            assert time.monotonic() < deadline, "the lease was not renewed on the new master"
            assert not lease.lost, lease.lost
            time.sleep(0.02)
        token = _release_and_take(load, lease, waiter)  # the waiter kept its place
        assert token > lease.token
        t_end = time.monotonic()
    finally:
        load.stop()
        fault.heal()
    assert not load.errors, load.errors[:5]
    window = (t_fault + 0.2, t_promo)
    for n in loaded[1:]:
        # the other masters' pools granted through the outage (they stopped, before)
        assert load.count(n, *window) >= 3, (n, load.count(n, *window), window)
    stall = max(load.longest_gap(n, t_fault, t_end) for n in loaded[1:])
    first = load.first_after(loaded[0], t_promo) - t_promo
    print(
        f"\n{how} {shell} {kind}: promoted {t_promo - t_fault:.2f}s after the fault; other "
        f"shards' longest gap {stall:.2f}s; the faulted pool's first grant {first:.2f}s after "
        f"the promotion"
    )


def test_replica_kill_then_slot_migration_under_load(clusters):
    """A replica killed and started again, then the slot of a busy pool moved to another master
    key by key (0.2 s between keys: its scripts meet ASK and TRYAGAIN for over a second), the
    load running all along (sync and asyncio clients): no call fails, every pool keeps
    granting, and the migrated pool grants on its new master."""
    c = clusters("embedded")
    masters = masters_now(c)
    names = [pool_on(c, m, "mg-") for m in masters]
    for n in names:
        with Pool.from_url(c.url, n) as p:
            p.configure(100)
    loads = [ShardLoad(c.url, names, "async").start(), ShardLoad(c.url, names, "sync").start()]
    try:
        replica = c.replica_of(masters[1])
        replica.kill()
        t0 = time.monotonic()
        time.sleep(0.5)
        replica.start()
        c.wait_synced(replica, 60)
        c.migrate_slot(pool_key(names[0], "cfg"), masters[2], step_pause=0.2)
        t_moved = time.monotonic()
        assert c.master_of(pool_key(names[0], "cfg")) is masters[2]
        deadline = time.monotonic() + 20
        while not all(ld.first_after(names[0], t_moved) for ld in loads):
            assert time.monotonic() < deadline, "no grant after the migration"
            time.sleep(0.02)
        t_end = time.monotonic()
    finally:
        for ld in loads:
            ld.stop()
    for ld in loads:
        assert not ld.errors, ld.errors[:5]
        for n in names:
            assert ld.count(n, t0, t_end) >= 3, (ld.shell, n)
    gaps = {ld.shell: round(ld.longest_gap(names[0], t0, t_end), 2) for ld in loads}
    print(f"\nmigration: the migrated pool's longest gap {gaps}")


def test_gpulock_run_rides_a_failover_longer_than_backend_timeout(clusters):
    """`gpulock --redis-url redis://<a live node>/0 run --pool P --timeout 45 -- CMD` started
    right after P's master was killed, its replica stopped for 10 s (so the shard has no master
    for longer than the 5 s backend_timeout): CMD runs once the replica is back and promoted,
    exit 0. (It exited 69: the calls before the acquire retried for backend_timeout only.)"""
    c = clusters("redis")
    masters = masters_now(c)
    victim = masters[0]
    name = pool_on(c, victim, "run-")
    with Pool.from_url(c.url, name) as p:
        p.configure("2GiB")
    fault = Failover(c, victim, "kill")
    live = masters[1]
    try:
        c.pause(fault.replica)
        t0 = fault.start()
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpulock",
                "--redis-url",
                f"redis://{live.host}:{live.port}/0",
                "run",
                "--pool",
                name,
                "--amount",
                "1GiB",
                "--timeout",
                "45",
                "--",
                sys.executable,
                "-c",
                "print('ran')",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while time.monotonic() - t0 < 10.0:
            assert run.poll() is None, (run.returncode, run.stderr.read()[-2000:])
            time.sleep(0.05)
        c.resume(fault.replica)
        out, err = run.communicate(timeout=60)
        assert run.returncode == 0, (run.returncode, err[-2000:])
        assert "ran" in out
    finally:
        if fault.replica.port in c.paused:
            c.resume(fault.replica)
        fault.heal()


async def test_service_a_hung_master_stalls_no_other_pool(clusters):
    """A FastAPI app with a GpuLimiter per pool, a pool on every master (one URL, the hung
    master its first seed), requests looping on each route; SIGSTOP of one master: the other
    routes keep answering 200 through the outage, and the hung master's route answers 200
    again after the promotion (its requests' acquires ride the election within their
    acquire_timeout). No request fails."""
    from contextlib import AsyncExitStack, asynccontextmanager

    from fastapi import FastAPI
    from support.apps import Running

    from gpulock.fastapi import GpuLimiter

    c = clusters("embedded")
    masters = masters_now(c)
    names = [pool_on(c, m, "svc-") for m in masters]
    url = seeds_url(masters[0], masters[1])
    gpus = [
        GpuLimiter(url, n, capacity=100, configure="set", acquire_timeout=30, reaper_interval=5)
        for n in names
    ]

    @asynccontextmanager
    async def lifespan(app):
        async with AsyncExitStack() as stack:
            for g in gpus:
                await stack.enter_async_context(g.lifespan(app))
            yield

    app = FastAPI(lifespan=lifespan)
    for i, g in enumerate(gpus):

        @app.post(f"/r{i}")
        @g.endpoint(f"r{i}", estimate=lambda body: 60)
        def route(body: dict) -> dict:
            time.sleep(0.01)
            return {"ok": True}

    oks: dict[int, list[float]] = {i: [] for i in range(3)}
    errors: list = []
    stop = asyncio.Event()

    async def worker(client, i: int) -> None:
        while not stop.is_set():
            r = await client.post(f"/r{i}", json={})
            if r.status_code == 200:
                oks[i].append(time.monotonic())
            else:
                errors.append((i, r.status_code, r.text[:200]))
                await asyncio.sleep(0.05)

    fault = Failover(c, masters[0], "stop")
    try:
        async with Running(app) as client:
            tasks = [asyncio.create_task(worker(client, i)) for i in range(3) for _ in "ab"]
            deadline = time.monotonic() + 30
            while not all(oks.values()):
                assert time.monotonic() < deadline, f"no answers yet: {errors[:3]}"
                await asyncio.sleep(0.02)
            t_fault = fault.start()
            t_promo = await asyncio.to_thread(fault.promoted)
            deadline = time.monotonic() + 30
            while not any(t > t_promo for t in oks[0]):
                assert time.monotonic() < deadline, f"no answer after the promotion: {errors[:3]}"
                await asyncio.sleep(0.02)
            stop.set()
            await asyncio.gather(*tasks)
    finally:
        await asyncio.to_thread(fault.heal)
    assert not errors, errors[:5]
    for i in (1, 2):
        assert sum(1 for t in oks[i] if t_fault + 0.2 < t < t_promo) >= 3, i
    first = min(t for t in oks[0] if t > t_promo) - t_promo
    print(f"\nservice: the hung master's route answered {first:.2f}s after the promotion")
