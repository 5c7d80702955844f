"""Findings of a new user against the broker (real Redis, real uvicorn):

* holder metadata with a lone surrogate (``"\\ud800"``, as a value or a key) was stored (201),
  and ``GET /v1/pools/{pool}`` then answered 500 for as long as the lease lived: it is a 422
  naming ``holder``, and nothing is stored;
* the first ``GET /v1/pools`` after Redis was killed (-9) and restarted on the same port
  answered 500 (a raw ``ConnectionError`` from the pool scan): every route that reads Redis
  answers from a retry on the core's policy, or 503 ``backend_unavailable`` with
  ``Retry-After`` — never a 500.
"""

from __future__ import annotations

import json

import pytest

from support.servers import RedisProcess

from ._support import ADMIN_TOKEN, USER_TOKEN, BrokerServer, client

GiB = 2**30
JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    "holder", [b'{"x":"\\ud800"}', b'{"\\ud800":"x"}', b'{"x":"ok\\udfff"}', b'{"\\uDC00":1}']
)
def test_a_lone_surrogate_in_holder_is_422_naming_it_and_never_stored(user, gpu, redis_srv, holder):
    import redis

    rc = redis.Redis.from_url(redis_srv.url)
    # the dashboard's history, which the broker's sampler writes every second, aside
    history = (b":samples", b":sampler", b":counters")
    before = {k: rc.dump(k) for k in rc.keys("gpulock:*") if not k.endswith(history)}
    r = user.post(
        "/v1/pools/gpu-a/leases", content=b'{"amount":1,"holder":' + holder + b"}", headers=JSON
    )
    assert r.status_code == 422, r.text
    d = r.json()["detail"]
    assert any("holder" in [str(x) for x in e["loc"]] and "Unicode" in e["msg"] for e in d), d
    r.text.encode("utf-8")  # the echo of the input is renderable
    st = user.get("/v1/pools/gpu-a")
    assert st.status_code == 200, st.text
    assert st.json()["lease_count"] == 0 and st.json()["waiter_count"] == 0
    assert user.get("/v1/pools").status_code == 200
    after = {k: rc.dump(k) for k in rc.keys("gpulock:*") if not k.endswith(history)}
    assert after == before


def test_valid_non_ascii_holders_are_stored_and_shown(user, gpu):
    holder = {"emoji": "\U0001f600", "note": "café"}
    r = user.post(
        "/v1/pools/gpu-a/leases",
        content=json.dumps({"amount": 1, "holder": holder}).encode(),
        headers=JSON,
    )
    assert r.status_code == 201, r.text
    st = user.get("/v1/pools/gpu-a").json()
    assert {k: st["leases"][0]["holder"][k] for k in holder} == holder


@pytest.fixture
def durable_redis(default_binary):
    # the pool survives kill -9 (AOF, fsync always), so a route after the restart has something to read
    with RedisProcess(
        default_binary, extra_args=["--appendonly", "yes", "--appendfsync", "always"]
    ) as p:
        yield p


@pytest.mark.timeout(120)
def test_no_route_answers_500_after_redis_is_killed_and_restarted(durable_redis):
    srv = BrokerServer(durable_redis.url, max_wait=2.0, backend_timeout=2.0).start()
    try:
        with client(srv.url, ADMIN_TOKEN) as admin, client(srv.url, USER_TOKEN) as user:

            def warm() -> None:  # several pooled connections that the restart leaves dead
                assert admin.put("/v1/pools/r0", json={"capacity": "4GiB"}).status_code == 200
                for _ in range(3):
                    assert admin.get("/v1/pools").status_code == 200
                    assert admin.get("/v1/pools/r0").status_code == 200

            def ok_or_503(r, *ok: int) -> None:
                assert r.status_code != 500, (r.request.method, r.request.url, r.text)
                if r.status_code == 503:
                    assert r.json()["detail"]["error"] == "backend_unavailable", r.text
                    assert r.headers.get("retry-after") == "1", r.headers
                else:
                    assert r.status_code in ok, (
                        r.request.method,
                        r.request.url,
                        r.status_code,
                        r.text,
                    )

            calls = [
                ("GET /v1/pools", lambda: admin.get("/v1/pools"), (200,)),
                ("GET /v1/pools/r0", lambda: admin.get("/v1/pools/r0"), (200,)),
                (
                    "PUT /v1/pools/r0",
                    lambda: admin.put("/v1/pools/r0", json={"capacity": "4GiB"}),
                    (200,),
                ),
                (
                    "POST lease",
                    lambda: user.post("/v1/pools/r0/leases", json={"amount": 1, "ttl": 5}),
                    (201,),
                ),
                (
                    "DELETE /v1/pools/r0",
                    lambda: admin.delete("/v1/pools/r0", params={"force": "true"}),
                    (200,),
                ),
            ]
            for _round in range(2):
                for name, call, ok in calls:
                    warm()
                    durable_redis.restart()
                    r = call()
                    ok_or_503(r, *ok)
                    if name == "GET /v1/pools":
                        # a read: retried on the core's policy, so it answers the pools
                        assert r.status_code == 200, r.text
                        assert [p["pool"] for p in r.json()["pools"]] == ["r0"], r.text
    finally:
        srv.stop()
