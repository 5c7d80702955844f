"""Redis restarts without its data (the usual deployment: no persistence) under a running
2-worker service: the workers notice the pool is gone, make it again as they last saw it (the
operator's capacity and max_ttl) with a grace period of one max_ttl, put their resident leases
back with their tokens, and serve on: a request that comes during the grace period waits for
its end."""

from __future__ import annotations

import time

import httpx
import pytest
from support.pools import MiB
from support.service import Service

from gpulock import Pool
from gpulock.embedded import find_server_binary
from support.servers import RedisProcess


@pytest.mark.timeout(120)
def test_service_survives_redis_restart_without_data(tmp_path):
    with RedisProcess(find_server_binary("any")) as redis:
        svc = Service(
            "restart",
            tmp_path,
            redis.url,
            {
                "GPULOCK_MODEL": "sleep",
                "GPULOCK_SLEEP_SECONDS": "0.05",
                "GPULOCK_RESIDENT": "128MiB",
                "GPULOCK_TTL": "3",
                "GPULOCK_CONFIGURE": "create",
            },
            workers=2,
            capacity=1024 * MiB,
        )
        try:
            # The operator made the pool first (`gpulock pool set --capacity 1GiB --max-ttl 5`): a
            # 5 s grace period after a loss; the workers (create-only) see it at their start.
            op = Pool.from_url(redis.url, svc.pool)
            op.configure(1024 * MiB, max_ttl=5)
            op.close()
            svc.start()
            svc.wait_ready(2, timeout=60)
            assert (
                httpx.post(
                    svc.url + "/v1/embeddings", json={"input": ["x"]}, timeout=10
                ).status_code
                == 200
            )
            before = svc.status()
            epoch, tokens = before.epoch, {li.lease_id: li.token for li in before.leases}
            assert before.max_ttl == 5 and len(tokens) == 2
            redis.restart()  # a new, empty server on the same port
            deadline = time.monotonic() + 30
            st = None
            while time.monotonic() < deadline:
                try:
                    st = svc.status()
                    if st.lease_count == 2 and st.used == 256 * MiB and st.epoch != epoch:
                        break
                except Exception:
                    pass
                time.sleep(0.2)
            assert st is not None and st.capacity == 1024 * MiB and st.used == 256 * MiB, st
            assert {li.lease_id: li.token for li in st.leases} == tokens and st.reasserted == 2, st
            assert st.max_ttl == 5 and 0 < st.grace_left <= 5, st
            svc.wait_ready(2, timeout=30)
            r = httpx.post(
                svc.url + "/v1/embeddings", json={"input": ["after the restart"]}, timeout=10
            )
            assert r.status_code == 200
        finally:
            svc.stop()
