"""End-to-end fixtures: one Redis server for the whole e2e session (each service gets its own
pool), and a per-module factory of services that stops every process it started, also when a
test fails."""

from __future__ import annotations

import pytest
from support.service import Service

from gpulock.embedded import find_server_binary
from support.servers import RedisProcess


@pytest.fixture(scope="session")
def e2e_redis():
    with RedisProcess(find_server_binary("any")) as p:
        yield p


@pytest.fixture(scope="module")
def make_service(e2e_redis, tmp_path_factory):
    started: list[Service] = []

    def make(name: str, **kw) -> Service:
        svc = Service(name, tmp_path_factory.mktemp(name), e2e_redis.url, **kw)
        started.append(svc)
        return svc.start()

    try:
        yield make
    finally:
        for svc in started:
            svc.stop()
