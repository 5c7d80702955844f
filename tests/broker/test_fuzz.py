"""Fuzz the HTTP lease API: no 500s, answers that match its OpenAPI schema, and no change of
state from a rejected request.

* Schemathesis, from the OpenAPI schema: every check, every phase (stateful included), a
  fixed seed (the same run from a shell is in docs/MULTIHOST.md), and the regressions it found;
* Hypothesis on the request bodies, with a state snapshot around each rejected request.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.servers import RedisProcess

from support.schemathesis_cli import run_schemathesis

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
            tuple((d["index"], d["capacity"], d["used"]) for d in p["devices"]),
            p["placement"],
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
        "device": json_values | st.integers(-2, 66),
        "extra": json_values,
    },
)
config_bodies = st.fixed_dictionaries(
    {"capacity": sizes},
    optional={
        "max_waiters": json_values | st.integers(),
        "max_ttl": json_values | st.floats(-1, 1e6),
        "devices": json_values | st.lists(sizes, max_size=3),
        "placement": json_values | st.sampled_from(["bestfit", "spread", "random"]),
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
            r = c.put(
                "/v1/pools/gpu-a",
                json={
                    "devices": ["10GiB"],
                    "max_waiters": 10000,
                    "max_ttl": 60,
                    "placement": "bestfit",
                },
            )
            assert r.status_code == 200, r.text


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


@pytest.fixture
def fuzzed(default_binary):
    """A broker of its own (schemathesis configures and deletes pools): pool gpu-a allows the
    schema's longest ttl, so most schema-valid requests in it are granted."""
    with RedisProcess(default_binary) as rp:
        b = BrokerServer(rp.url, max_wait=0.5, backend_timeout=10.0).start()
        try:
            with client(b.url, ADMIN_TOKEN) as a:
                r = a.put("/v1/pools/gpu-a", json={"capacity": "10GiB", "max_ttl": 86400})
                assert r.status_code == 200, r.text
            yield b
        finally:
            b.stop()


@pytest.mark.timeout(300)
def test_schemathesis(fuzzed):
    """Every check and every phase (stateful included, following the schema's links from a
    grant to its renewal and release) against the live broker; the only configuration is
    tests/schemathesis/broker.toml's statuses that depend on a pool's state."""
    pytest.importorskip("schemathesis")
    run = run_schemathesis(
        f"{fuzzed.url}/openapi.json",
        "broker",
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        max_examples=50,
    )
    assert run.returncode == 0, run.output[-20000:]
    assert run.phases_passed() == ["Examples", "Coverage", "Fuzzing", "Stateful"], run.output
    assert run.generated > 300, run.output
    # the schema's links (grant -> renew/release/cancel, configure -> acquire, ...) and the
    # ones schemathesis infers: lease lifecycles were run
    assert run.links_covered >= 3, run.output


# Regressions that schemathesis found (each was a schema-valid request refused, or a header
# that did not match the schema)


@pytest.mark.parametrize("field,path", [("amount", "leases"), ("capacity", "")])
def test_zero_size_text_is_outside_the_schema_and_refused(live, field, path):
    """``"0"`` matched the size pattern and was refused (422): the pattern now refuses it."""
    import re

    schema = live.app.openapi()["components"]["schemas"]
    model = "LeaseRequest" if field == "amount" else "PoolConfigRequest"
    pattern = next(
        s["pattern"] for s in schema[model]["properties"][field]["anyOf"] if "pattern" in s
    )
    for text in ("0", "0.0GiB", "0.5", "1.5B", "1.0625GiB"):
        assert not re.search(pattern, text), text
    for text in ("4GiB", "0.5GiB", "1.5GB", " 7 kib", "8.0GiB", "1.1KiB", "1.4GiB"):
        assert re.search(pattern, text), text
    with client(live.url, ADMIN_TOKEN) as c:
        before = snapshot(c)
        url = f"/v1/pools/gpu-a/{path}".rstrip("/")
        r = (c.post if path else c.put)(url, json={field: "0"})
        assert r.status_code == 422 and field in json.dumps(r.json()), r.text
        assert snapshot(c) == before


def test_max_waiters_as_an_integral_float_is_an_integer(live):
    """JSON Schema's integer includes 3.0; the strict model refused ``max_waiters: 1.0``."""
    with client(live.url, ADMIN_TOKEN) as c:
        r = c.put("/v1/pools/fuzz-int", json={"capacity": "1GiB", "max_waiters": 7.0})
        assert r.status_code == 200 and r.json()["max_waiters"] == 7, r.text
        for bad in (7.5, "7", True):
            r = c.put("/v1/pools/fuzz-int", json={"capacity": "1GiB", "max_waiters": bad})
            assert r.status_code == 422, (bad, r.text)
        assert c.delete("/v1/pools/fuzz-int").status_code == 200


@pytest.mark.parametrize(
    "path,allow",
    [
        ("/v1/pools/gpu-a", "DELETE, GET, PUT"),
        (f"/v1/pools/gpu-a/leases/{'0' * 32}", "DELETE, PUT"),
        ("/v1/pools/gpu-a/leases", "POST"),
    ],
)
def test_405_allow_names_every_method_of_the_path(live, path, allow):
    """Starlette's 405 named the methods of the path's first route only (``Allow: GET``)."""
    with client(live.url, ADMIN_TOKEN) as c:
        r = c.request("PATCH", path)
        assert r.status_code == 405 and r.headers["allow"] == allow, r.headers


def test_every_status_schemathesis_may_accept_is_declared(live):
    """The statuses tests/schemathesis/broker.toml lets a schema-valid request get are each
    declared (with the error body) on that operation, and every route declares its errors."""
    import tomllib

    from support.schemathesis_cli import CONFIG_DIR

    spec = live.app.openapi()
    ops = {op["operationId"]: op for item in spec["paths"].values() for op in item.values()}
    config = tomllib.loads((CONFIG_DIR / "broker.toml").read_text())
    default = {"2xx", "3xx", "401", "403", "404", "409", "429", "5xx"}
    for entry in config["operations"]:
        op = ops[entry["include-operation-id"]]
        extra = set(entry["checks"]["positive_data_acceptance"]["expected-statuses"]) - default
        assert extra and extra <= set(op["responses"]), (entry, sorted(op["responses"]))
    for op_id, op in ops.items():
        if op_id.startswith(
            ("acquire", "renew", "resize", "release", "cancel", "pool", "configure", "delete")
        ):
            assert {"400", "401", "403", "413", "422", "503"} <= set(op["responses"]), op_id
            assert op["responses"]["503"]["headers"]["Retry-After"]["required"], op_id
    granted = ops["acquire_lease"]["responses"]["201"]["links"]
    assert granted["RenewLease"]["parameters"]["lease_id"] == "$response.body#/lease_id"
    assert granted["ResizeLease"]["parameters"]["lease_id"] == "$response.body#/lease_id"
    assert "401" in ops[next(k for k in ops if "dashboard" in k)]["responses"]
