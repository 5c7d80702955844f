"""Fuzz the HTTP lease API: no 500s, answers that match its OpenAPI schema, and no change of
state from a rejected request.

* Schemathesis, from the OpenAPI schema (when installed; the same run from a shell is in
  docs/MULTIHOST.md).
* Hypothesis on the request bodies, with a state snapshot around each rejected request.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpulock.embedded import RedisProcess

from ._support import ADMIN_TOKEN, USER_TOKEN, BrokerServer, client

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def live(default_binary):
    with RedisProcess(default_binary) as rp:
        b = BrokerServer(rp.url, max_wait=0.5, backend_timeout=2.0).start()
        try:
            with client(b.url, ADMIN_TOKEN) as a:
                assert a.put("/v1/pools/gpu-a", json={"capacity": "10GiB"}).status_code == 200
            yield b
        finally:
            b.stop()


def snapshot(c):
    r = c.get("/v1/pools")
    assert r.status_code == 200
    return sorted(
        (
            p["pool"],
            p["capacity"],
            p["used"],
            p["lease_count"],
            p["waiter_count"],
            p["grants"],
            p["max_waiters"],
            p["max_ttl"],
        )
        for p in r.json()["pools"]
    )


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
sizes = st.one_of(
    st.integers(-5, 2**60),
    st.sampled_from(
        ["4GiB", "1.5GB", "0", "-1", "4XB", "1e3", "", " 7 kib", "99999999999999999999TiB", "1.25"]
    ),
    json_values,
)
lease_bodies = st.fixed_dictionaries(
    {"amount": sizes},
    optional={
        "ttl": json_values | st.floats(-10, 1e6),
        "wait": json_values | st.floats(-1, 5),
        "queue": json_values,
        "holder": json_values,
        "request_id": st.text(max_size=130) | json_values,
        "extra": json_values,
    },
)
config_bodies = st.fixed_dictionaries(
    {"capacity": sizes},
    optional={
        "max_waiters": json_values | st.integers(),
        "max_ttl": json_values | st.floats(-1, 1e6),
    },
)
pools = st.sampled_from(["gpu-a", "no-such-pool", "a" * 65, "bad{x}", "x"])


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=lease_bodies, pool=pools)
def test_acquire_bodies(live, body, pool):
    with client(live.url, USER_TOKEN) as c:
        before = snapshot(c)
        body = {**body, "wait": 0} if isinstance(body.get("wait"), (int, float)) else body
        r = c.post(f"/v1/pools/{pool}/leases", json=body)
        assert r.status_code in (201, 400, 404, 413, 422, 503), r.text
        if r.status_code == 201:
            assert c.delete(f"/v1/pools/{pool}/leases/{r.json()['lease_id']}").status_code == 200
        elif r.status_code == 503:
            assert (
                c.delete(
                    f"/v1/pools/{pool}/requests/{r.json()['detail']['request_id']}"
                ).status_code
                == 200
            )
        else:
            assert snapshot(c) == before, r.text


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=config_bodies | json_values, pool=pools, token=st.sampled_from([USER_TOKEN, ADMIN_TOKEN])
)
def test_config_bodies(live, body, pool, token):
    with client(live.url, token) as c:
        before = snapshot(c)
        r = c.put(f"/v1/pools/{pool}", json=body)
        assert r.status_code in (200, 400, 403, 422), r.text
        if r.status_code != 200:
            assert snapshot(c) == before, r.text
        elif pool == "gpu-a":
            c.put(
                "/v1/pools/gpu-a", json={"capacity": "10GiB", "max_waiters": 10000, "max_ttl": 60}
            )


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    body=json_values,
    lease_id=st.sampled_from(["0" * 32, "f" * 32, "xyz", "0" * 33]),
    method=st.sampled_from(["PUT", "DELETE"]),
)
def test_renew_release_of_unknown_leases(live, body, lease_id, method):
    with client(live.url, USER_TOKEN) as c:
        before = snapshot(c)
        r = c.request(method, f"/v1/pools/gpu-a/leases/{lease_id}", json=body)
        assert r.status_code in (400, 404, 410, 422), r.text
        assert snapshot(c) == before


@pytest.mark.parametrize(
    "raw",
    [
        '{"amount": 1, "ttl": NaN}',
        '{"amount": 1, "wait": Infinity}',
        '{"amount": NaN}',
        '{"amount": 1e400}',
        '{"amount": "1", "ttl": -Infinity}',
        '{"amount": 1, "holder": {"x": NaN}}',
    ],
)
def test_non_finite_numbers(live, raw):
    with client(live.url, USER_TOKEN) as c:
        before = snapshot(c)
        r = c.post(
            "/v1/pools/gpu-a/leases", content=raw, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 422, r.text
        assert snapshot(c) == before


def test_schemathesis(live):
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.checks import load_all_checks

    load_all_checks()
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    excluded = {
        "positive_data_acceptance",  # 410/413/404 depend on state, not on the schema
        "allow_header_conformance",
        "ignored_auth",
        "use_after_free",
        "ensure_resource_availability",
    }
    failures, calls = [], []

    def fuzz(op):
        @settings(
            max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        @given(case=op.as_strategy())
        def run(case):
            calls.append(op.path)
            case.call_and_validate(
                headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                excluded_checks=[
                    c for c in schemathesis.checks.CHECKS.get_all() if c.__name__ in excluded
                ],
            )

        try:
            run()
        except Exception as e:  # collect, to report every operation at once
            failures.append(f"{op.method.upper()} {op.path}: {e}")

    for op in schema.get_all_operations():
        fuzz(op.ok())
    assert not failures, "\n\n".join(failures[:5])
    # the six /v1 operations and GET /dashboard/data
    assert len(set(calls)) == 7 and len(calls) > 100, calls
