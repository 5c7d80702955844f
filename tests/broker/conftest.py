"""Fixtures for the HTTP lease API tests: a real Redis server (never the shared one on 6379)
and a real uvicorn server running the broker on a free loopback port."""

from __future__ import annotations

import pytest

from support.servers import RedisProcess

from ._support import ADMIN_TOKEN, OTHER_TOKEN, USER_TOKEN, BrokerServer, client


@pytest.fixture
def redis_srv(default_binary):
    with RedisProcess(default_binary) as p:
        yield p


@pytest.fixture
def broker_srv(redis_srv):
    s = BrokerServer(redis_srv.url, max_wait=5.0, backend_timeout=2.0).start()
    yield s
    s.stop()


@pytest.fixture
def admin(broker_srv):
    with client(broker_srv.url, ADMIN_TOKEN) as c:
        yield c


@pytest.fixture
def user(broker_srv):
    with client(broker_srv.url, USER_TOKEN) as c:
        yield c


@pytest.fixture
def other(broker_srv):
    with client(broker_srv.url, OTHER_TOKEN) as c:
        yield c


@pytest.fixture
def gpu(admin):
    """A pool of 10 GiB named gpu-a."""
    r = admin.put("/v1/pools/gpu-a", json={"capacity": "10GiB"})
    assert r.status_code == 200, r.text
    return "gpu-a"
