"""Tenant quotas through the broker: a token's leases count under its tenant (its ``tenant``
in the tokens file, else its name); ``PUT /v1/pools/{pool}`` sets quotas (422 naming a bad
one, nothing changed); over the quota is 413 ``quota_exceeded`` (the SDK's QuotaExceeded); at
the quota the request queues while other tenants are granted; ``GET`` shows use per tenant."""

from __future__ import annotations

import json

import pytest
from gpulock_broker.auth import TokenConfigError, parse_tokens
from gpulock_client import AcquireTimeout, CapacityExceeded, Pool, QuotaExceeded

from support.pools import snapshot

from ._support import ADMIN_TOKEN, USER_TOKEN
from .test_cli_via_broker import _gpulock

GiB = 2**30
pytestmark = pytest.mark.timeout(60)


def test_quotas_are_set_enforced_per_token_tenant_and_shown(broker_srv, admin, user, other, gpu):
    r = admin.put(f"/v1/pools/{gpu}", json={"capacity": "10GiB", "quotas": {"user": "2GiB"}})
    assert r.status_code == 200, r.text
    assert r.json()["quotas"] == {"user": 2 * GiB}
    r = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "3GiB"})
    assert r.status_code == 413, r.text
    d = r.json()["detail"]
    assert (d["error"], d["amount"], d["quota"], d["tenant"]) == (
        "quota_exceeded",
        3 * GiB,
        2 * GiB,
        "user",
    )
    held = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "2GiB"})
    assert held.status_code == 201, held.text
    r = user.post(f"/v1/pools/{gpu}/leases", json={"amount": 1, "wait": 0})
    assert r.status_code == 503 and r.json()["detail"]["error"] == "queued", r.text
    rid = r.json()["detail"]["request_id"]
    r = other.post(f"/v1/pools/{gpu}/leases", json={"amount": "5GiB", "wait": 0})
    assert r.status_code == 201, r.text  # another tenant passes the one at its quota
    st = admin.get(f"/v1/pools/{gpu}").json()
    assert st["tenants"] == {
        "user": {"used": 2 * GiB, "quota": 2 * GiB},
        "other": {"used": 5 * GiB, "quota": 0},
    }, st
    assert sorted(li["tenant"] for li in st["leases"]) == ["other", "user"]
    assert [w["tenant"] for w in st["waiters"]] == ["user"]
    # the CLI through the broker shows the same
    r = _gpulock("--broker-url", broker_srv.url, "status", gpu, "--json", token=ADMIN_TOKEN)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["tenants"] == st["tenants"], d
    assert sorted(li["tenant"] for li in d["leases"]) == ["other", "user"], d
    assert [w["tenant"] for w in d["waiters"]] == ["user"], d
    r = _gpulock("--broker-url", broker_srv.url, "status", gpu, token=ADMIN_TOKEN)
    assert "tenants: other 5.0GiB (no quota), user 2.0GiB of quota 2.0GiB" in r.stdout, r.stdout
    lid = held.json()["lease_id"]
    assert user.delete(f"/v1/pools/{gpu}/leases/{lid}").status_code == 200
    r = user.post(f"/v1/pools/{gpu}/leases", json={"amount": 1, "request_id": rid, "wait": 5})
    assert r.status_code == 201, r.text
    # quotas left out of a PUT are kept; 0 (or null) removes one
    r = admin.put(f"/v1/pools/{gpu}", json={"capacity": "10GiB"})
    assert r.json()["quotas"] == {"user": 2 * GiB}
    r = admin.put(f"/v1/pools/{gpu}", json={"capacity": "10GiB", "quotas": {"user": 0}})
    assert r.json()["quotas"] == {}
    # gpulock pool set --quota through the broker
    r = _gpulock(
        "--broker-url", broker_srv.url, "pool", "set", gpu, "--quota", "other=3GiB", "--json",
        token=ADMIN_TOKEN,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["quotas"] == {"other": 3 * GiB}


@pytest.mark.parametrize(
    "quotas, shown",
    [
        ({"a b": 1}, '"a b"'),
        ({"a": "lots"}, '"lots"'),
        ({"a": "0GiB"}, '"0GiB"'),
        ({"a": "\t0"}, "quotas"),
        ({"a": -1}, "-1"),
        ({"a": 1.5}, "quotas"),
        ({"a": True}, "quotas"),
        (["a"], "quotas"),
    ],
)
def test_a_bad_quota_is_422_naming_it_and_changes_nothing(admin, gpu, redis_srv, quotas, shown):
    import redis

    c = redis.Redis.from_url(redis_srv.url)
    try:
        before = snapshot(c)
        r = admin.put(f"/v1/pools/{gpu}", json={"capacity": "10GiB", "quotas": quotas})
        assert r.status_code == 422, r.text
        assert shown in r.text, r.text
        assert snapshot(c) == before
    finally:
        c.close()


def test_a_quota_that_is_not_a_size_is_named_in_a_short_message(admin, gpu):
    """The 422 names the tenant and the value, not the size pattern of the schema."""
    r = admin.put(f"/v1/pools/{gpu}", json={"capacity": "10GiB", "quotas": {"a": "lots"}})
    assert r.status_code == 422, r.text
    msgs = [e["msg"] for e in r.json()["detail"]]
    assert any("quota of tenant 'a'" in m and "'lots'" in m for m in msgs), msgs
    assert all("(?:" not in m and len(m) < 300 for m in msgs), msgs


def test_the_sdk_raises_quota_exceeded_and_waits_at_the_quota(broker_srv, admin, gpu):
    r = admin.put(f"/v1/pools/{gpu}", json={"capacity": "10GiB", "quotas": {"user": "2GiB"}})
    assert r.status_code == 200, r.text
    pool = Pool(broker_srv.url, gpu, token=USER_TOKEN)
    try:
        with pytest.raises(QuotaExceeded) as e:
            pool.acquire("3GiB", timeout=5)
        assert (e.value.amount, e.value.quota, e.value.tenant) == (3 * GiB, 2 * GiB, "user")
        assert isinstance(e.value, CapacityExceeded)
        with pool.lease("2GiB"):
            with pytest.raises(AcquireTimeout):
                pool.acquire(1, timeout=0.2)
    finally:
        pool.close()


def test_a_tokens_tenant_is_its_own_or_its_name():
    doc = {
        "tokens": [
            {"name": "team-a", "token": "a" * 16},
            {"name": "ops", "token": "b" * 16, "tenant": "infra"},
            {"name": "no tenant", "token": "c" * 16},  # not a tenant name: none
            {"name": "shared", "token": "d" * 16, "tenant": ""},
        ]
    }
    assert [p.tenant for p in parse_tokens(doc, "t")] == ["team-a", "infra", "", ""]
    bad = {"tokens": [{"name": "x", "token": "e" * 16, "tenant": "a/b"}]}
    with pytest.raises(TokenConfigError, match=r"tokens\[0\]\.tenant must be .*'a/b'"):
        parse_tokens(bad, "t")


def test_quotas_take_what_their_schema_allows(admin, gpu):
    """Integer-valued floats are JSON Schema integers (schemathesis sent 143349.0 and was
    refused); "none" and " 0 " remove; null removes."""
    r = admin.put(
        f"/v1/pools/{gpu}",
        json={"capacity": "10GiB", "quotas": {"a": 143349.0, "b": "1GiB", "c": 5, "d": None}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["quotas"] == {"a": 143349, "b": GiB, "c": 5}
    r = admin.put(
        f"/v1/pools/{gpu}", json={"capacity": "10GiB", "quotas": {"a": "none", "b": " 0 "}}
    )
    assert r.status_code == 200, r.text
    assert r.json()["quotas"] == {"c": 5}


def test_a_request_the_resident_leases_leave_no_room_for_is_413_at_once(
    broker_srv, redis_srv, admin, user, gpu
):
    """A service's models hold 8 of the pool's 10 GiB as resident leases (taken straight on
    Redis): a remote holder's 3 GiB can never be granted next to them. 413 ``room_exceeded``
    at once (a long poll of 5 s and a queue are not waited), the SDK's RoomExceeded; 2 GiB is
    granted."""
    from gpulock import Pool as CorePool
    from gpulock_client import RoomExceeded

    assert admin.put(f"/v1/pools/{gpu}", json={"capacity": "10GiB"}).status_code == 200
    core = CorePool.from_url(redis_srv.url, gpu)
    models = [core.acquire("4GiB", resident=True) for _ in range(2)]
    try:
        r = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "3GiB", "wait": 5})
        assert r.status_code == 413, r.text
        d = r.json()["detail"]
        assert (d["error"], d["amount"], d["room"], d["capacity"], d["resident"]) == (
            "room_exceeded",
            3 * GiB,
            2 * GiB,
            10 * GiB,
            8 * GiB,
        ), d
        with Pool(broker_srv.url, gpu, token=USER_TOKEN) as sdk:
            with pytest.raises(RoomExceeded) as e:
                sdk.acquire("3GiB", timeout=5)
            assert (e.value.room, e.value.resident) == (2 * GiB, 8 * GiB)
            sdk.acquire("2GiB", timeout=5).release()
    finally:
        for lz in models:
            lz.release()
        core.close()
