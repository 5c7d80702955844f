"""The lease broker on a real Redis Cluster (3 masters, 3 replicas, started here): a
``redis+cluster://`` URL, pools on every master, long-poll hand-offs on each, and the pool
list across masters. Each pool's calls go to its own shard."""

from __future__ import annotations

import threading
import time

import pytest
from support.cluster import start_cluster


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
