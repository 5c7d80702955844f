"""Resident leases (docs/SEMANTICS.md, "Resident leases"), decided by the scripts for every
surface: a request that can never fit next to the resident leases held and queued is refused at
once, with nothing written (never queued at the head for its whole timeout); on a device and
within a tenant's quota too; a resident request that does not fit next to them is never queued;
a waiter that resident leases left no room for leaves the queue; resident leases that expired
but were not reaped yet do not count; the counters stay equal to the records throughout."""

from __future__ import annotations

import asyncio
import time

import pytest
from support.pools import (
    RAW_FORMS,
    assert_empty,
    check_consistent,
    raw,
    server_ms,
    snapshot,
    status_until,
)
from support.waiting import async_wait_until

from gpulock import (
    AcquireTimeout,
    CapacityExceeded,
    InvalidArgument,
    QuotaExceeded,
    RoomExceeded,
)
from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys

pytestmark = pytest.mark.timeout(60)


async def test_a_request_that_never_fits_next_to_the_resident_leases_is_refused_at_once(
    make_apool, make_pool, rclient, pool_name
):
    """Capacity 100, two resident leases of 30: 45 fits the capacity but never the 40 they
    leave. Refused at once (a timeout of 30 s is not waited), nothing written; 40 is granted;
    once a model is gone 45 fits."""
    pool = make_apool()
    await pool.configure(100)
    models = [await pool.acquire(30, resident=True) for _ in range(2)]
    st = await pool.status()
    assert (st.resident, st.resident_queued, st.used) == (60, 0, 60)
    before = snapshot(rclient)
    with pytest.raises(RoomExceeded) as e:
        await pool.acquire(45, timeout=30)
    assert (e.value.amount, e.value.room, e.value.capacity, e.value.resident) == (45, 40, 100, 60)
    assert e.value.device is None and isinstance(e.value, CapacityExceeded)
    assert "room the resident leases leave" in str(e.value), str(e.value)
    assert snapshot(rclient) == before
    with pytest.raises(RoomExceeded):  # the blocking Pool: the same decision
        make_pool().acquire(45, timeout=30)
    lease = await pool.acquire(40, timeout=0)
    check_consistent(rclient, pool_name)
    await lease.release()
    await models.pop().release()
    lease = await pool.acquire(45, timeout=0)
    await lease.release()
    await models.pop().release()
    st = await pool.status()
    assert (st.resident, st.resident_queued) == (0, 0)
    assert_empty(rclient, pool_name)
    check_consistent(rclient, pool_name)


async def test_queued_resident_requests_count_and_one_that_cannot_fit_is_not_queued(
    make_apool, rclient, pool_name, redis_proc
):
    """A worker whose resident lease is still queued: its bytes count. A resident request that
    does not fit next to the resident leases held and queued is answered at once, whatever
    its timeout, and is not queued (it could never be granted and would block the queue)."""
    pool = make_apool()
    await pool.configure(100)
    model = await pool.acquire(30, resident=True)
    short = await pool.acquire(70)  # the pool is full
    queued = asyncio.ensure_future(pool.acquire(30, resident=True))
    st = await status_until(redis_proc.url, pool_name, lambda s: s.waiter_count == 1)
    assert (st.resident, st.resident_queued) == (30, 30)
    check_consistent(rclient, pool_name)
    with pytest.raises(RoomExceeded) as e:
        await pool.acquire(45, timeout=30)
    assert (e.value.room, e.value.resident) == (40, 60)
    with pytest.raises(AcquireTimeout) as t:
        await pool.acquire(50, resident=True, timeout=None)
    assert "resident" in str(t.value) and t.value.position == 0, str(t.value)
    assert (await pool.status()).waiter_count == 1
    with pytest.raises(AcquireTimeout):  # timeout=0 alike
        await pool.acquire(50, resident=True, timeout=0)
    await short.release()
    second = await asyncio.wait_for(queued, 10)
    st = await pool.status()
    assert (st.resident, st.resident_queued, st.used) == (60, 0, 60)
    check_consistent(rclient, pool_name)
    for lz in (model, second):
        await lz.release()
    assert_empty(rclient, pool_name)
    check_consistent(rclient, pool_name)


async def test_a_waiter_the_resident_leases_leave_no_room_for_leaves_the_queue(
    make_apool, rclient, pool_name
):
    """A request queued while it could still fit (40 next to a model of 30 on 100) can never
    be granted once the capacity is lowered to 60: the hand-off drops it instead of letting
    it head the queue, and its acquire ends with RoomExceeded, long before its timeout."""
    pool = make_apool()
    await pool.configure(100)
    model = await pool.acquire(30, resident=True)
    short = await pool.acquire(50)
    waiter = asyncio.ensure_future(pool.acquire(40, timeout=20))
    await async_wait_until(lambda: rclient.zcard(pool_keys(pool_name).queue) == 1)
    await make_apool().configure(60)
    with pytest.raises(RoomExceeded) as e:
        await asyncio.wait_for(waiter, 15)
    assert (e.value.amount, e.value.room) == (40, 30)
    assert rclient.zcard(pool_keys(pool_name).queue) == 0
    check_consistent(rclient, pool_name)
    await short.release()
    await model.release()
    assert_empty(rclient, pool_name)


async def test_a_tenants_resident_leases_count_against_its_quota(make_apool, rclient, pool_name):
    pool = make_apool()
    await pool.configure(100, quotas={"a": 50})
    model = await pool.acquire(30, resident=True, tenant="a")
    assert (await pool.status()).tenants["a"].used == 30
    before = snapshot(rclient)
    with pytest.raises(QuotaExceeded) as e:
        await pool.acquire(25, tenant="a", timeout=30)
    assert (e.value.amount, e.value.quota, e.value.tenant, e.value.resident) == (25, 50, "a", 30)
    assert "resident leases of tenant 'a'" in str(e.value), str(e.value)
    assert snapshot(rclient) == before
    lease = await pool.acquire(20, tenant="a", timeout=0)
    other = await pool.acquire(25, tenant="b", timeout=0)  # another tenant: the pool's room
    check_consistent(rclient, pool_name)
    for lz in (lease, other, model):
        await lz.release()
    assert_empty(rclient, pool_name)
    check_consistent(rclient, pool_name)


async def test_on_a_pool_of_devices_the_room_is_per_device(make_apool, rclient, pool_name):
    """Two devices of 50, a model of 40 on each: 20 fits the pool's 20 left but no device's
    10; pinned or not it is refused, naming the device; 10 is granted."""
    pool = make_apool()
    await pool.configure(devices=[50, 50])
    models = [await pool.acquire(40, resident=True, device=i) for i in range(2)]
    with pytest.raises(RoomExceeded) as e:
        await pool.acquire(20, timeout=30)
    assert (e.value.room, e.value.capacity, e.value.resident, e.value.device) == (10, 50, 40, -1)
    with pytest.raises(RoomExceeded) as e:
        await pool.acquire(15, device=1, timeout=30)
    assert e.value.device == 1 and "device 1" in str(e.value), str(e.value)
    lease = await pool.acquire(10, device=0, timeout=0)
    check_consistent(rclient, pool_name)
    for lz in (lease, *models):
        await lz.release()
    assert_empty(rclient, pool_name)
    check_consistent(rclient, pool_name)


@pytest.mark.parametrize("form", sorted(RAW_FORMS))
async def test_an_expired_resident_lease_not_yet_reaped_does_not_count(
    form, make_apool, rclient, pool_name
):
    """A worker died: its model's lease expired, and nothing reaped it yet. The next request
    that fits only without it is granted (the refusal counts what the reap will free), and
    the counters follow the reap."""
    pool = make_apool()
    await pool.configure(100)
    model = await pool.acquire(30, resident=True)
    r = RAW_FORMS[form](
        rclient, pool_name, "acquire", new_id(), new_id(), 30, 100, 600_000, "wait", "{}",
        "test", 0, "", "", "resident",
    )  # fmt: skip
    assert int(r[0]) == 1
    expires = int(r[3])
    deadline = time.monotonic() + 10
    while server_ms(rclient) <= expires + 1:  # expired on the server's clock
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    lease = await pool.acquire(45, timeout=0)
    st = await pool.status()
    assert (st.resident, st.used) == (30, 75)
    check_consistent(rclient, pool_name)
    await lease.release()
    await model.release()
    assert_empty(rclient, pool_name)
    check_consistent(rclient, pool_name)


@pytest.mark.parametrize("form", sorted(RAW_FORMS))
def test_a_bad_kind_is_refused_naming_it_with_nothing_written(form, rclient, pool_name):
    raw(rclient, pool_name, "configure", 100, 1000, "set")
    before = snapshot(rclient)
    with pytest.raises(Exception) as e:
        RAW_FORMS[form](
            rclient, pool_name, "acquire", new_id(), new_id(), 30, 1000, 600_000, "wait", "{}",
            "test", 0, "", "", "model",
        )  # fmt: skip
    assert "GPULOCK_BADARG kind must be '' or 'resident', got 'model'" in str(e.value)
    assert snapshot(rclient) == before


async def test_resident_must_be_a_bool(make_apool):
    pool = make_apool()
    await pool.configure(100)
    with pytest.raises(InvalidArgument, match="resident must be True or False, got 'yes'"):
        await pool.acquire(10, resident="yes")
