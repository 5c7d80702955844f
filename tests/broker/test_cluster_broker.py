"""The lease broker on a real Redis Cluster (3 masters, 3 replicas, started here): a
``redis+cluster://`` URL, pools on every master, long-poll hand-offs on each, and the pool
list across masters. Each pool's calls go to its own shard."""

from __future__ import annotations

import threading
import time

import pytest
from support.cluster import Failover, masters_now, pool_on, seeds_url, start_cluster
from support.shard_load import ShardLoad


from ._support import ADMIN_TOKEN, USER_TOKEN, BrokerServer, client

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cluster(default_binary):
    c = start_cluster(default_binary)
    yield c
    c.stop()


def test_broker_on_a_cluster_serves_pools_on_every_master(cluster):
    names = {i: ns[0] for i, ns in enumerate(cluster.names_by_master("gpu-"))}
    s = BrokerServer(cluster.node_url(0), max_wait=5.0, backend_timeout=2.0).start()
    try:
        with client(s.url, ADMIN_TOKEN) as admin, client(s.url, USER_TOKEN) as user:
            for n in names.values():
                assert admin.put(f"/v1/pools/{n}", json={"capacity": 100}).status_code == 200
            listed = {p["pool"] for p in user.get("/v1/pools").json()["pools"]}
            assert set(names.values()) <= listed
            for n in names.values():
                h = user.post(f"/v1/pools/{n}/leases", json={"amount": 80, "ttl": 10})
                assert h.status_code == 201, h.text
                out: dict = {}

                def wait(n=n):
                    with client(s.url, USER_TOKEN) as c:
                        out["r"] = c.post(
                            f"/v1/pools/{n}/leases", json={"amount": 80, "ttl": 10, "wait": 20}
                        )

                t = threading.Thread(target=wait)
                t.start()
                while user.get(f"/v1/pools/{n}").json()["waiter_count"] == 0:
                    time.sleep(0.01)
                lid = h.json()["lease_id"]
                assert user.delete(f"/v1/pools/{n}/leases/{lid}").status_code == 200
                t.join(20)
                assert out["r"].status_code == 201, out["r"].text
                assert out["r"].json()["token"] > h.json()["token"]
    finally:
        s.stop()


def test_broker_a_hung_master_stalls_no_other_shard(cluster):
    """One broker (one Redis client, an AsyncPool per pool), pools on every master, SDK
    clients looping acquire/release on each; SIGSTOP of one master (connects succeed, replies
    never come): the pools on the others keep granting through the outage, and the hung
    master's pool grants again after the promotion (long polls and releases ride the election:
    the broker retries an enqueue for as long as it would hold the request, a release while
    the lease is valid). No call fails. (Before, every pool's calls waited on the hung master:
    redis-py asked it for each script call's keys.)"""
    masters = masters_now(cluster)
    names = [pool_on(cluster, m, "bk-") for m in masters]
    url = seeds_url(masters[0], masters[1])  # one URL, two seeds: the hung master first
    s = BrokerServer(url, max_wait=5.0, backend_timeout=2.0).start()
    load = None
    fault = Failover(cluster, masters[0], "stop")
    try:
        with client(s.url, ADMIN_TOKEN) as admin:
            for n in names:
                assert admin.put(f"/v1/pools/{n}", json={"capacity": 100}).status_code == 200
        load = ShardLoad(s.url, names, "broker", token=USER_TOKEN).start()
        t_fault = fault.start()
        t_promo = fault.promoted()
        deadline = time.monotonic() + 30
        while load.first_after(names[0], t_promo) is None:
            assert time.monotonic() < deadline, f"no grant after the promotion: {load.errors[:3]}"
            time.sleep(0.02)
        t_end = time.monotonic()
    finally:
        if load is not None:
            load.stop()
        s.stop()
        fault.heal()
    assert not load.errors, load.errors[:5]
    for n in names[1:]:
        assert load.count(n, t_fault + 0.2, t_promo) >= 3, (n, load.count(n, t_fault, t_promo))
    stall = max(load.longest_gap(n, t_fault, t_end) for n in names[1:])
    first = load.first_after(names[0], t_promo) - t_promo
    print(
        f"\nbroker: other shards' longest gap {stall:.2f}s; first grant {first:.2f}s after promotion"
    )
