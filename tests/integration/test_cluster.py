"""gpulock on a real Redis Cluster and a real Valkey cluster (3 masters, 3 replicas, on loopback,
started here): the URL forms, pools spread over the masters, sharded hand-offs, sync_replicas
through the pool's own primary, listing across masters, and errors that name their cause.

The fault tests (kill -9 of a pool's master, the safety history over several processes) are in
tests/faults/server/test_cluster_faults.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import redis
from redis.cluster import RedisCluster
from support.cluster import Cluster, start_cluster

from gpulock import AsyncPool, InvalidArgument, Pool
from gpulock.admin.pools import pool_names
from gpulock.transport.connect import async_client, sync_client
from gpulock.protocol.keys import pool_key

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster(server_binary):
    c = start_cluster(server_binary)
    yield c
    c.stop()


def spread(c: Cluster, prefix: str) -> list[str]:
    """Pool names, one served by each master (in master order)."""
    return [names[0] for names in c.names_by_master(prefix)]


def test_every_url_form_reaches_every_master(cluster):
    names = spread(cluster, "url")
    urls = [cluster.url, cluster.node_url(0), cluster.node_url(2)]
    for url in urls:
        assert isinstance(sync_client(url), RedisCluster), url
        for name in names:  # a plain URL of one node serves pools on the other masters too
            with Pool.from_url(url, name) as p:
                p.configure(100)
                lease = p.acquire(60, ttl=5)
                assert p.status().used == 60
                lease.release()
    for name in names:
        with Pool.from_url(cluster.url, name) as p:
            assert p.status().grants == len(urls)


async def test_async_pools_on_every_master_hand_off_over_sharded_pubsub(cluster):
    """A waiter is woken by its grant, published with SPUBLISH on its pool's shard and read
    by the listener's SSUBSCRIBE; poll_interval is 60 s, so only the hand-off can deliver it
    within the test's bound."""
    for name in spread(cluster, "ho"):
        p = AsyncPool.from_url(cluster.url, name, poll_interval=60)
        try:
            await p.configure(100)
            held = await p.acquire(80, ttl=30)
            w = asyncio.create_task(p.acquire(80, ttl=30, timeout=30))
            while not (await p.status()).waiter_count:
                await asyncio.sleep(0.01)
            assert p._runtime is not None and p._runtime.listener.sharded is True
            await held.release()
            lease = await asyncio.wait_for(w, 10)
            assert lease.token > held.token
            await lease.release()
        finally:
            await p.aclose()


async def test_the_drain_rate_and_wait_estimates_on_a_cluster(cluster):
    """The drain rate lives in the pool's cfg hash, in the pool's slot: measured by hand-offs
    on a cluster as on one server, and the bytes ahead walked in the pool's queue
    (docs/SEMANTICS.md, "Wait estimate")."""
    from gpulock_common.options import AcquireOptions

    from gpulock.runtime.remote import RemoteHolders

    name = spread(cluster, "est")[0]
    p = AsyncPool.from_url(cluster.url, name, poll_interval=60)
    try:
        await p.configure(100)
        held = await p.acquire(100, ttl=30)
        assert (await p.status()).drain is None
        rh = RemoteHolders(p)
        for i in range(2):
            res = await rh.enqueue(100, AcquireOptions(request_id=f"w{i}", ttl=30))
            assert res.queued and res.position == i + 1 and res.ahead_bytes == 100 * i
            assert res.estimated_wait is None  # not measured yet
        await asyncio.sleep(0.3)  # a lower bound on the busy time the first hand-off counts
        await held.release()
        for i in range(2):
            g = await rh.wait(f"w{i}", 30)
            assert g is not None
            await asyncio.sleep(0.1)  # each grant after at least 0.1 s of busy time
            assert (await rh.release(g.lease_id, g.token))[0]
        st = await p.status()
        assert st.drain is not None and st.drain.bytes_per_s <= 100 / 0.1 * 1.01
    finally:
        await p.aclose()


async def test_pools_of_several_devices_place_and_hand_off_on_every_master(cluster):
    """A pool of several devices keeps them in its one hash tag: placement, pinning and a
    hand-off onto the device freed work on each master."""
    for name in spread(cluster, "dv"):
        p = AsyncPool.from_url(cluster.url, name, poll_interval=60)
        try:
            await p.configure(devices=[50, 100])
            big = await p.acquire(90, ttl=30)  # only device 1 can hold it
            small = await p.acquire(40, ttl=30)  # best fit: 10 free on 1 is too few: device 0
            assert (big.device, small.device) == (1, 0)
            w = asyncio.create_task(p.acquire(60, ttl=30, timeout=30, device=1))
            while not (await p.status()).waiter_count:
                await asyncio.sleep(0.01)
            await big.release()
            lease = await asyncio.wait_for(w, 10)
            assert lease.device == 1
            st = await p.status()
            assert [(d.capacity, d.used) for d in st.devices] == [(50, 40), (100, 60)]
            await lease.release()
            await small.release()
        finally:
            await p.aclose()


def test_sync_pool_on_a_cluster_client_hands_off(cluster):
    name = spread(cluster, "sy")[1]
    rc = RedisCluster(host=cluster.masters[0].host, port=cluster.masters[0].port)
    with Pool(rc, name, poll_interval=60) as p:
        p.configure(100)
        held = p.acquire(80, ttl=30)
        got: list = []
        t = threading.Thread(target=lambda: got.append(p.acquire(80, ttl=30, timeout=30)))
        t.start()
        while not p.status().waiter_count:
            time.sleep(0.01)
        held.release()
        t.join(10)
        assert got and got[0].token > held.token
        got[0].release()
    rc.close()


@pytest.mark.parametrize("shell", ["sync", "async"])
async def test_sync_replicas_waits_on_the_pools_own_primary(cluster, shell):
    """A grant with sync_replicas is confirmed by a renewal and WAIT on one connection; WAIT
    counts the replicas of that connection's server, so it must run on the pool's primary
    (redis-py's cluster pipeline refuses a keyless WAIT)."""
    for name in spread(cluster, f"sr{shell}"):
        if shell == "sync":
            with Pool.from_url(cluster.url, name, sync_replicas=1, sync_timeout=2.0) as p:
                p.configure(100)
                lease = p.acquire(10, ttl=5)
                assert not lease.lost
                lease.release()
        else:
            ap = AsyncPool.from_url(cluster.url, name, sync_replicas=1, sync_timeout=2.0)
            try:
                await ap.configure(100)
                alease = await ap.acquire(10, ttl=5)
                await alease.release()
            finally:
                await ap.aclose()
        # the pool's replica has the confirming renewal (the sync counter moved with it)
        master = cluster.master_of(pool_key(name, "cfg"))
        replica = cluster.replicas[cluster.masters.index(master)][0]
        r = redis.Redis(host=replica.host, port=replica.port, single_connection_client=True)
        r.execute_command("READONLY")  # a replica answers reads of its slots only so
        assert int(r.get(pool_key(name, "sync")) or 0) >= 1
        r.close()


def test_listing_and_cli_status_cover_every_master(cluster):
    names = spread(cluster, "ls")
    for name in names:
        with Pool.from_url(cluster.url, name) as p:
            p.configure(100)
    assert set(names) <= set(pool_names(sync_client(cluster.node_url(1))))
    env = {**os.environ, "GPULOCK_REDIS_URL": cluster.node_url(1)}
    r = subprocess.run(
        [sys.executable, "-m", "gpulock", "status", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    listed = {s["pool"] for s in json.loads(r.stdout)}
    assert set(names) <= listed, (names, listed)


def test_a_lone_server_client_of_a_cluster_node_names_the_fix(cluster):
    """A client of one server (the probe could not tell, or the user built it) gets MOVED
    for a pool on another master: that is an InvalidArgument saying to use a cluster URL,
    never "Redis unavailable"."""
    name = spread(cluster, "mv")[1]
    lone = redis.Redis(host=cluster.masters[0].host, port=cluster.masters[0].port)
    with Pool(lone, name) as p:
        with pytest.raises(InvalidArgument, match=r"redis\+cluster://"):
            p.configure(100)
    lone.close()


@pytest.mark.parametrize(
    "url, bad",
    [
        ("redis+cluster://127.0.0.1:notaport", "notaport"),
        ("redis+cluster://127.0.0.1:7000/3", "database 0"),
        ("redis+cluster://127.0.0.1:7000?colour=red", "colour"),
        ("redis+cluster://:7000", "empty host"),
    ],
)
def test_bad_cluster_urls_name_the_bad_part(url, bad):
    for build in (sync_client, async_client):
        with pytest.raises(InvalidArgument, match=bad):
            build(url)


def test_cluster_url_seeds_and_tls_scheme_parse():
    from gpulock.transport.cluster import ClusterURL

    cu = ClusterURL("rediss+cluster://u:p%40ss@h1:7000,h2:7001,h3/0?max_connections=8")
    assert cu.nodes == [("h1", 7000), ("h2", 7001), ("h3", 6379)] and cu.ssl
    assert (cu.username, cu.password) == ("u", "p@ss")


async def test_gpulimiter_on_a_cluster_guards_and_replays(cluster):
    """The FastAPI integration on a cluster URL: a guarded call, an X-Request-ID replay (the
    claim and result keys share the pool's slot), the reaper's status reads."""
    from support.apps import Running

    from .test_fastapi import _app

    name = spread(cluster, "svc")[2]
    app, gpu, seen = _app(cluster.url, name)
    async with Running(app) as c:
        r = await c.post("/sync", json={"gib": 1})
        assert r.status_code == 200, r.text
        h = {"X-Request-ID": "on-a-cluster"}
        first = await c.post("/sync", json={"gib": 1}, headers=h)
        while gpu.jobs.by_ticket:  # released and unclaimed (a retry now would join it)
            await asyncio.sleep(0.01)
        again = await c.post("/sync", json={"gib": 1}, headers=h)
        assert first.status_code == again.status_code == 200
        assert again.headers["x-idempotent-replay"] == "true"
        await gpu.reaper.tick()
        assert gpu.backend.status is not None and gpu.backend.status.grants == 2


async def test_oom_backoff_on_a_cluster(cluster):
    """The OOM back-off's reads (HGETALL + TIME pipelined) and its compare-and-set script on a
    cluster URL: an injected OOM raises the bucket and cuts the factor, as a second limiter
    reads them."""
    from support.apps import Running

    from gpulock.oom_backoff import BackoffRule

    from .test_fastapi_oom_backoff import BUCKET, _app

    name = spread(cluster, "bo")[1]
    rule = BackoffRule(capacity_every_s=3600.0)
    app_a, a, _ = _app(cluster.url, name, rule)
    app_b, b, _ = _app(cluster.url, name, rule)
    async with Running(app_a) as ca, Running(app_b):
        assert (await ca.post("/embed", json={"oom": True})).status_code == 503
        deadline = time.monotonic() + 10
        while True:
            await b.backoff.refresh()
            if b.backoff.scale(BUCKET) == 1.5:
                break
            assert time.monotonic() < deadline, b.backoff.state()
            await asyncio.sleep(0.01)
        assert b.backoff.factor() == pytest.approx(0.8)


def _pubsub_conns(node_clients) -> list[dict]:
    """The clients on these servers that hold subscriptions (classic or sharded)."""
    out = []
    for c in node_clients:
        for cl in c.client_list():
            if int(cl.get("sub", 0)) + int(cl.get("ssub", 0)) + int(cl.get("psub", 0)):
                out.append(cl)
    return out


async def _until_closed(node_clients, timeout: float = 10.0) -> None:
    """Until the servers list no subscribed client (a closed socket is seen a moment later)."""
    deadline = time.monotonic() + timeout
    while conns := _pubsub_conns(node_clients):
        assert time.monotonic() < deadline, conns
        await asyncio.sleep(0.02)


async def test_one_subscription_connection_per_shard_for_all_pool_objects(cluster):
    """30 pool objects on one cluster client (as the broker keeps them), each with a waiter:
    one hand-off subscription connection per master, not one per pool; all hand-offs still
    arrive; closing the pool objects closes the connections."""
    from gpulock.transport.connect import async_client

    client = async_client(cluster.url)
    nodes = [cluster.client(m) for m in cluster.masters]
    pools = [AsyncPool(client, f"share{i}", poll_interval=60) for i in range(30)]
    try:
        held, waits = [], []
        for p in pools:
            await p.configure(1)
            held.append(await p.acquire(1, ttl=30))
            waits.append(asyncio.create_task(p.acquire(1, ttl=30, timeout=30)))
        while sum([(await p.status()).waiter_count for p in pools]) < len(pools):
            await asyncio.sleep(0.01)
        conns = _pubsub_conns(nodes)
        masters_used = {cluster.master_of(pool_key(p.name, "cfg")).port for p in pools}
        assert len(conns) == len(masters_used) == 3, conns
        assert sum(int(c.get("ssub", 0)) for c in conns) == 30
        for h in held:
            await h.release()
        for w in waits:
            await (await asyncio.wait_for(w, 10)).release()
    finally:
        for p in pools:
            await p.aclose()
    await _until_closed(nodes)
    await client.aclose()


async def test_one_subscription_connection_for_all_pool_objects_on_one_server(redis_proc):
    from gpulock.transport.connect import async_client

    client = async_client(redis_proc.url)
    pools = [AsyncPool(client, f"one{i}", poll_interval=60) for i in range(20)]
    try:
        for p in pools:
            await p.configure(1)
            h = await p.acquire(1, ttl=30)
            w = asyncio.create_task(p.acquire(1, ttl=30, timeout=30))
            while not (await p.status()).waiter_count:
                await asyncio.sleep(0.01)
            await h.release()
            await (await asyncio.wait_for(w, 10)).release()
        conns = _pubsub_conns([redis.Redis.from_url(redis_proc.url)])
        assert len(conns) == 1 and int(conns[0].get("ssub", 0)) == 20, conns
    finally:
        for p in pools:
            await p.aclose()
    await _until_closed([redis.Redis.from_url(redis_proc.url)])
    await client.aclose()


def test_an_unreachable_cluster_is_exit_69_with_its_cause():
    """No seed answers: the CLI says which cluster is unavailable and why (exit 69), with no
    traceback; the library raises BackendUnavailable when the sync client is made (redis-py
    reads the slot map then) and InvalidArgument only for a malformed URL."""
    from gpulock import BackendUnavailable
    from gpulock.transport.connect import check_url
    from support.ports import free_port

    url = f"redis+cluster://127.0.0.1:{free_port('127.0.0.1')}"
    assert check_url(url) == url  # the form is fine; nothing is asked
    with pytest.raises(BackendUnavailable, match="Redis Cluster at .* is unavailable"):
        sync_client(url)
    r = subprocess.run(
        [sys.executable, "-m", "gpulock", "--redis-url", url, "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 69, (r.returncode, r.stderr)
    assert "is unavailable" in r.stderr and "Traceback" not in r.stderr


def test_plain_urls_refused_before_any_connection_name_the_bad_part(cluster):
    """A plain URL with an option no connection takes, a port out of range, or a database
    other than 0 on a cluster node: InvalidArgument naming it (it was a TypeError, an outage
    message, or "SELECT is not allowed in cluster mode" reported as Redis unavailable)."""
    from gpulock.transport.connect import check_url

    node = f"redis://{cluster.masters[0].host}:{cluster.masters[0].port}"
    for url, bad in [
        (node + "?foo=bar", "unknown option"),
        ("redis://127.0.0.1:99999", "out of range"),
        ("redis+cluster://127.0.0.1:99999", "out of range"),
    ]:
        with pytest.raises(InvalidArgument, match=bad):
            check_url(url)
        with pytest.raises(InvalidArgument, match=bad):
            Pool.from_url(url, "x")
    with pytest.raises(InvalidArgument, match="only database 0"):
        Pool.from_url(node + "/3", "x")
    r = subprocess.run(
        [sys.executable, "-m", "gpulock", "--redis-url", node + "?foo=bar", "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "unknown option" in r.stderr, (r.returncode, r.stderr)


def test_serve_and_broker_name_a_bad_or_unreachable_cluster_url(tmp_path):
    """`gpulock broker` checks its URL before starting (exit 2, it was a uvicorn traceback);
    `gpulock serve` with a cluster none of whose seeds answers exits 69 with one line (it was a
    traceback)."""
    from support.ports import free_port

    tokens = tmp_path / "tokens.json"
    tokens.write_text(
        '{"tokens": [{"name": "a", "token": "a-token-0123456789abcdef", "pools": ["*"]}]}'
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpulock",
            "broker",
            "--redis-url",
            "redis+clustr://127.0.0.1:1",
            "--tokens-file",
            str(tokens),
            "--port",
            str(free_port("127.0.0.1")),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "scheme 'redis+clustr'" in r.stderr, (r.returncode, r.stderr)
    url = f"redis+cluster://127.0.0.1:{free_port('127.0.0.1')}"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpulock",
            "serve",
            "--redis-url",
            url,
            "--model",
            "sleep",
            "--port",
            str(free_port("127.0.0.1")),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 69, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "unreachable" in r.stderr


async def test_device_report_holds_bytes_back_on_every_master(cluster):
    """external.lua on a real cluster: the report (and the hand-off when it drops) stays in
    the pool's slot, on each master."""
    for name in spread(cluster, "dev"):
        p = AsyncPool.from_url(cluster.url, name, poll_interval=60)
        try:
            await p.configure(100)
            r = await p.device_report("s1", 3000, 40, 30000, "[]")
            assert (r.holder, r.written, r.external) == (1, 1, 40)
            assert (await p.status()).effective_capacity == 60
            w = asyncio.create_task(p.acquire(80, ttl=30, timeout=30))
            while not (await p.status()).waiter_count:
                await asyncio.sleep(0.01)
            r = await p.device_report("s1", 3000, 0, 30000, "")
            assert r.granted == 1
            lease = await asyncio.wait_for(w, 10)
            await lease.release()
        finally:
            await p.aclose()


async def test_a_master_that_lost_the_library_gets_it_again(cluster):
    """The library is loaded on every master; one that loses it (FUNCTION FLUSH there, as a
    master added later or a replica promoted before the library reached it) answers
    "Function not found" and gets it loaded again, while the other masters keep theirs."""
    names = spread(cluster, "fl")
    pools = [AsyncPool.from_url(cluster.url, n) for n in names]
    try:
        for p in pools:
            await p.configure(100)
            await (await p.acquire(10)).release()
        assert pools[0]._scripts.heads.dialect.functions is True
        victim = redis.Redis(host=cluster.masters[1].host, port=cluster.masters[1].port)
        victim.function_flush()
        assert victim.function_list() == []
        for p in pools:
            lease = await p.acquire(20)
            assert (await p.status()).used == 20
            await lease.release()
        assert victim.function_list() != []  # loaded there again
        assert pools[1]._scripts.heads.dialect.functions is True  # still functions
        victim.close()
    finally:
        for p in pools:
            await p.aclose()
