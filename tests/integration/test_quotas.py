"""Tenant quotas (docs/SEMANTICS.md, "Tenant quotas") through the Python API and the raw
scripts: a request over its tenant's quota is refused at once with nothing written; a tenant at
its quota waits while other tenants pass it, its own waiters in their order; lowering a quota
keeps the leases; quotas are set, shown and removed; bad tenants and quota specs are refused
naming the value with nothing written. (The scripts' decisions on random histories are checked
against the model in test_priority.py.)"""

from __future__ import annotations

import asyncio

import pytest
import redis
from support.pools import RAW_FORMS, assert_empty, check_consistent, raw_configure, snapshot
from support.waiting import async_wait_until

from gpulock import AcquireTimeout, CapacityExceeded, InvalidArgument, QuotaExceeded
from gpulock.protocol.args import new_id

pytestmark = pytest.mark.timeout(120)


async def test_a_request_over_its_tenants_quota_is_refused_at_once(make_apool, rclient, pool_name):
    pool = make_apool()
    out = await pool.configure(100, quotas={"a": 10})
    assert out["quotas"] == {"a": 10}
    before = snapshot(rclient)
    with pytest.raises(QuotaExceeded) as e:
        await pool.acquire(11, tenant="a", timeout=5)
    assert (e.value.amount, e.value.quota, e.value.tenant) == (11, 10, "a")
    assert isinstance(e.value, CapacityExceeded)
    assert "quota of tenant 'a'" in str(e.value)
    assert snapshot(rclient) == before
    # another tenant, or none, is bound only by the capacity
    lease = await pool.acquire(50, tenant="b", timeout=0)
    await lease.release()
    lease = await pool.acquire(50, timeout=0)
    await lease.release()
    assert_empty(rclient, pool_name)


async def test_a_tenant_at_its_quota_waits_and_other_tenants_pass_it(
    make_apool, rclient, pool_name
):
    """a holds 6 of its 8; a's 4 and then a's 1 wait (the 1 would fit its quota but keeps its
    place behind a's 4); b's 4 arriving later is granted at once; when a's lease ends its
    waiters are granted in their order."""
    pool = make_apool()
    await pool.configure(100, quotas={"a": 8})
    held = await pool.acquire(6, tenant="a")
    granted: list[str] = []

    async def wait(name: str, amount: int, tenant: str):
        lease = await pool.acquire(amount, tenant=tenant, timeout=30)
        granted.append(name)
        return lease

    t4 = asyncio.ensure_future(wait("a4", 4, "a"))
    await async_wait_until(lambda: rclient.zcard(f"gpulock:{{{pool_name}}}:queue") == 1)
    t1 = asyncio.ensure_future(wait("a1", 1, "a"))
    await async_wait_until(lambda: rclient.zcard(f"gpulock:{{{pool_name}}}:queue") == 2)
    b = await pool.acquire(4, tenant="b", timeout=0)
    with pytest.raises(AcquireTimeout):
        await pool.acquire(1, tenant="a", timeout=0)  # behind a's own waiters
    st = await pool.status()
    assert {t: (u.used, u.quota) for t, u in st.tenants.items()} == {"a": (6, 8), "b": (4, 0)}
    assert [(w.amount, w.tenant) for w in st.waiters] == [(4, "a"), (1, "a")]
    assert sorted(li.tenant for li in st.leases) == ["a", "b"]
    check_consistent(rclient, pool_name)
    assert granted == []
    await held.release()
    leases = await asyncio.gather(t4, t1)
    assert granted == ["a4", "a1"]
    st = await pool.status()
    assert st.tenants["a"].used == 5
    for lease in (*leases, b):
        await lease.release()
    st = await pool.status()
    assert {t: u.used for t, u in st.tenants.items()} == {"a": 0}  # the quota stays listed
    assert_empty(rclient, pool_name)


async def test_lowering_a_quota_keeps_the_leases_and_removing_it_frees_the_waiters(
    make_apool, rclient, pool_name
):
    pool = make_apool()
    await pool.configure(100, quotas={"a": 10})
    held = await pool.acquire(8, tenant="a")
    out = await pool.configure(100, quotas={"a": 4, "c": "1KiB"})
    assert out["quotas"] == {"a": 4, "c": 1024}
    st = await pool.status()
    assert (st.tenants["a"].used, st.tenants["a"].quota) == (8, 4)  # over it, and kept
    waiter = asyncio.ensure_future(pool.acquire(2, tenant="a", timeout=30))
    await async_wait_until(lambda: rclient.zcard(f"gpulock:{{{pool_name}}}:queue") == 1)
    out = await pool.configure(100, quotas={"a": "none"})  # removes a's quota: the waiter fits
    assert out["quotas"] == {"c": 1024}
    lease = await asyncio.wait_for(waiter, 10)
    check_consistent(rclient, pool_name)
    await lease.release()
    await held.release()
    out = await pool.configure(100, max_waiters=50)  # other settings keep the quotas
    assert out["quotas"] == {"c": 1024}
    assert_empty(rclient, pool_name)


async def test_a_request_id_reused_with_another_tenant_is_a_conflict(make_apool, pool_name):
    pool = make_apool()
    await pool.configure(100, quotas={"a": 10})
    rid = new_id()
    lease = await pool.acquire(4, tenant="a", request_id=rid)
    with pytest.raises(InvalidArgument, match="another amount, tenant or device"):
        await pool.acquire(4, tenant="b", request_id=rid)
    await lease.release()


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"tenant": "a b"}, "tenant must be 1-64 characters"),
        ({"tenant": "x" * 65}, "tenant must be 1-64 characters"),
        ({"tenant": 7}, "tenant must be 1-64 characters"),
    ],
)
async def test_a_bad_tenant_is_refused_by_the_client(make_apool, rclient, kw, msg):
    pool = make_apool()
    await pool.configure(100)
    before = snapshot(rclient)
    with pytest.raises(InvalidArgument, match=msg):
        await pool.acquire(1, **kw)
    assert snapshot(rclient) == before


@pytest.mark.parametrize(
    "quotas, msg",
    [
        ({"a b": 4}, "tenant must be 1-64 characters"),
        ({"": 4}, "a tenant must be named"),
        ({"a": -1}, "quota of tenant 'a'"),
        ({"a": "lots"}, "quota of tenant 'a'"),
        ({"a": "0GiB"}, "0 or none removes it"),
        ({"a": True}, "quota of tenant 'a' must be a size"),
        (["a"], "quotas must be a mapping"),
    ],
)
async def test_bad_quotas_are_refused_naming_them_with_nothing_written(
    make_apool, rclient, quotas, msg
):
    pool = make_apool()
    await pool.configure(100, quotas={"z": 5})
    before = snapshot(rclient)
    with pytest.raises(InvalidArgument, match=msg):
        await pool.configure(100, quotas=quotas)
    assert snapshot(rclient) == before


@pytest.mark.parametrize("form", list(RAW_FORMS))
@pytest.mark.parametrize(
    "spec, msg",
    [
        ("a", "quotas must be '<tenant>=<bytes>' items"),
        ("a b=1", "quotas must be '<tenant>=<bytes>' items"),
        ("a=x", "quota of tenant a must be a decimal integer"),
        ("a=-1", "quota of tenant a must be"),
        ("a=1 b{=2", "tenant must be 1-64 characters"),
    ],
)
def test_configure_refuses_a_bad_quota_spec_with_nothing_written(
    rclient, pool_name, form, spec, msg
):
    raw_configure(rclient, pool_name, 10)
    before = snapshot(rclient)
    with pytest.raises(redis.ResponseError, match=msg):
        RAW_FORMS[form](rclient, pool_name, "configure", 10, 1000, "set", 0, 0, "", "", spec)
    assert snapshot(rclient) == before


async def test_sync_pool_takes_tenant_and_quotas(make_pool, rclient, pool_name):
    pool = make_pool()
    assert pool.configure(10, quotas={"a": 3})["quotas"] == {"a": 3}
    with pytest.raises(QuotaExceeded):
        pool.acquire(4, tenant="a")
    with pool.lease(3, tenant="a"):
        with pytest.raises(AcquireTimeout):
            pool.acquire(1, tenant="a", timeout=0)
        assert pool.status().tenants["a"].used == 3
    assert_empty(rclient, pool_name)
