"""Devices and placement (docs/SEMANTICS.md, "Devices and placement") through the Python API and
the raw scripts: a pool of several devices places each lease on one (best fit by default,
spread as an option, a pinned device when asked), never over a device's capacity; the lease,
status and hand-offs say which device; bad devices and device specs are refused naming the
value with nothing written; and the scripts' decisions equal the model's on random histories
(tests/support/priority_model.py), both script forms."""

from __future__ import annotations

import asyncio

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.pools import (
    RAW_FORMS,
    _s,
    assert_empty,
    check_consistent,
    raw,
    server_ms,
    snapshot,
    ticket_grants,
)
from support.priority_model import QueueModel, end_one
from support.waiting import async_wait_until

from gpulock import CapacityExceeded, InvalidArgument
from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys

pytestmark = pytest.mark.timeout(120)


async def test_best_fit_takes_the_fullest_device_that_fits(make_apool, rclient, pool_name):
    pool = make_apool()
    out = await pool.configure(10, devices=3)
    assert (out["capacity"], out["devices"], out["placement"]) == (30, [10, 10, 10], "bestfit")
    a = await pool.acquire(6, timeout=0)
    b = await pool.acquire(5, timeout=0)  # device 0 has 4 free: the next empty one, by index
    c = await pool.acquire(4, timeout=0)  # fits device 0 exactly (the least free that fits)
    d = await pool.acquire(5, timeout=0)  # 0 is full; device 1 has 5 free
    assert [x.device for x in (a, b, c, d)] == [0, 1, 0, 1]
    st = await pool.status()
    assert [(x.index, x.capacity, x.used) for x in st.devices] == [
        (0, 10, 10),
        (1, 10, 10),
        (2, 10, 0),
    ]
    assert sorted((x.amount, x.device) for x in st.leases) == [(4, 0), (5, 1), (5, 1), (6, 0)]
    check_consistent(rclient, pool_name)
    for x in (a, b, c, d):
        await x.release()
    assert [x.used for x in (await pool.status()).devices] == [0, 0, 0]
    assert_empty(rclient, pool_name)


async def test_spread_takes_the_emptiest_device(make_apool, rclient, pool_name):
    pool = make_apool()
    await pool.configure(devices=[10, 20, 20], placement="spread")
    leases = [await pool.acquire(4, timeout=0) for _ in range(4)]
    # free 10/20/20 -> 1 (ties: lowest index) -> 2 -> 1 (16 vs 16: 1) -> 2
    assert [x.device for x in leases] == [1, 2, 1, 2]
    assert (await pool.status()).placement == "spread"
    for x in leases:
        await x.release()
    assert_empty(rclient, pool_name)


async def test_a_pinned_request_waits_for_its_device_and_is_handed_it(
    make_apool, rclient, pool_name
):
    pool = make_apool()
    await pool.configure(10, devices=2)
    a = await pool.acquire(8, device=1, timeout=0)
    assert a.device == 1
    queued = asyncio.Event()
    task = asyncio.create_task(pool.acquire(5, device=1, on_queued=lambda p: queued.set()))
    await asyncio.wait_for(queued.wait(), 10)
    st = await pool.status()
    assert [w.device for w in st.waiters] == [1]
    await a.release()
    b = await asyncio.wait_for(task, 10)
    assert b.device == 1
    await b.release()
    assert_empty(rclient, pool_name)


def test_the_sync_pool_places_and_pins_too(make_pool, rclient, pool_name):
    pool = make_pool()
    pool.configure(devices=["1KiB", "2KiB"])
    with pool.lease(1024) as a, pool.lease(512, device=1) as b:
        assert (a.device, b.device) == (0, 1)
        check_consistent(rclient, pool_name)
    assert_empty(rclient, pool_name)


async def test_a_request_no_device_can_hold_is_refused_at_once(make_apool, rclient, pool_name):
    pool = make_apool()
    await pool.configure(devices=[10, 20])
    before = snapshot(rclient)
    with pytest.raises(CapacityExceeded, match="capacity of the pool's largest device, 20 bytes"):
        await pool.acquire(21, timeout=5)  # 30 bytes in all, but no device has 21
    with pytest.raises(CapacityExceeded, match="capacity of device 0, 10 bytes") as e:
        await pool.acquire(11, device=0, timeout=5)
    assert (e.value.amount, e.value.capacity) == (11, 10)
    with pytest.raises(InvalidArgument, match="device 2 is not a device of the pool: it has 2"):
        await pool.acquire(1, device=2, timeout=5)
    for bad in (-1, 64, "1", 1.0, True):
        with pytest.raises(InvalidArgument, match="device"):
            await pool.acquire(1, device=bad, timeout=5)
    assert snapshot(rclient) == before


async def test_a_pool_of_one_device_is_device_0(make_apool, rclient, pool_name):
    pool = make_apool()
    await pool.configure(10)
    a = await pool.acquire(4, device=0, timeout=0)
    assert a.device == 0
    st = await pool.status()
    assert [(x.index, x.capacity, x.used) for x in st.devices] == [(0, 10, 4)]
    assert st.leases[0].device == 0
    with pytest.raises(InvalidArgument, match="it has 1"):
        await pool.acquire(1, device=1, timeout=0)
    await a.release()
    assert_empty(rclient, pool_name)


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"devices": 0, "capacity": 10}, "devices must be 1 to 64"),
        ({"devices": 65, "capacity": 10}, "devices must be 1 to 64"),
        ({"devices": 2}, "needs capacity"),
        ({"devices": [10, "lots"]}, "capacity of device 1"),
        ({"devices": [10, 10], "capacity": 30}, "not the sum"),
        ({"devices": "2"}, "count or a list"),
        ({"devices": 2, "capacity": 10, "placement": "random"}, "placement must be"),
    ],
)
async def test_bad_device_specs_are_refused_naming_the_value(make_apool, rclient, kw, msg):
    pool = make_apool()
    before = snapshot(rclient)
    with pytest.raises(InvalidArgument, match=msg):
        await pool.configure(**kw)
    assert snapshot(rclient) == before


async def test_the_device_count_changes_only_on_an_idle_pool(make_apool, rclient, pool_name):
    pool = make_apool()
    await pool.configure(10, devices=2)
    a = await pool.acquire(3, timeout=0)
    before = snapshot(rclient)
    with pytest.raises(InvalidArgument, match="changes only when it has none"):
        await pool.configure(10, devices=3)
    with pytest.raises(InvalidArgument, match="give each one a capacity"):
        await pool.configure(40)
    assert snapshot(rclient) == before
    # the same count with other capacities is a change of capacity: allowed, leases kept
    out = await pool.configure(devices=[4, 6])
    assert out["devices"] == [4, 6] and out["used"] == 3
    check_consistent(rclient, pool_name)
    await a.release()
    out = await pool.configure(devices=[7])  # idle: back to one device
    assert out["devices"] == [7] and out["capacity"] == 7
    check_consistent(rclient, pool_name)
    assert (await pool.acquire(7, timeout=0)).device == 0


@pytest.mark.parametrize("form", list(RAW_FORMS))
@pytest.mark.parametrize(
    "spec, msg",
    [
        (("6", "3 3", "fast"), "placement must be"),
        (("6", "3 x", ""), "capacity of device 1"),
        (("7", "3 3", ""), "must be the sum"),
        (("6", " ".join(["1"] * 65), ""), "at most 64"),
    ],
)
def test_configure_refuses_bad_devices_with_nothing_written(rclient, pool_name, form, spec, msg):
    call = RAW_FORMS[form]
    before = snapshot(rclient)
    with pytest.raises(redis.ResponseError, match=msg):
        call(
            rclient, pool_name, "configure", spec[0], 100, "set", 0, 0, "", "", "", spec[1], spec[2]
        )
    assert snapshot(rclient) == before


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_a_bad_device_argument_is_refused_with_nothing_written(rclient, pool_name, form):
    call = RAW_FORMS[form]
    call(rclient, pool_name, "configure", 6, 100, "set", 0, 0, "", "", "", "3 3", "")
    before = snapshot(rclient)
    for bad, msg in (
        ("x", "device must be a device index"),
        ("-1", "device must be"),
        ("2", "not a device"),
    ):
        with pytest.raises(redis.ResponseError, match=msg):
            call(
                rclient,
                pool_name,
                "acquire",
                new_id(),
                new_id(),
                1,
                1000,
                1000,
                "wait",
                "",
                "c",
                0,
                "",
                bad,
            )
    assert snapshot(rclient) == before


def test_records_without_a_device_read_as_before(rclient, pool_name):
    """A lease or waiter record of an earlier version (no device field) on a pool of one
    device is released and handed off as before."""
    k = pool_keys(pool_name)
    raw(rclient, pool_name, "configure", 10, 100, "set")
    now = int(server_ms(rclient))
    lid, wlid = new_id(), new_id()
    rclient.hset(k[0], "used", 8)
    rclient.hset(k[2], lid, f"8|1|{now}|60000|t1||{{}}")  # tenant-era record, meta {}
    rclient.zadd(k[1], {lid: now + 60000})
    rclient.hset(k[6], "t1", lid)
    rclient.hset(k[4], "t2", f"5|60000|{now}|{wlid}|c|0||")  # tenant-era waiter
    rclient.zadd(k[3], {"t2": 1})
    rclient.zadd(k[5], {"t2": now + 60000})
    r = raw(rclient, pool_name, "release", lid, 1)
    assert (r[0], r[3]) == (1, 1)  # released, and the waiter handed the bytes
    assert _s(rclient.hget(k[6], "t2")) == wlid
    check_consistent(rclient, pool_name)


# ---- the scripts against the model -------------------------------------------------------------
_acq = st.tuples(
    st.just("acq"),
    st.integers(1, 4),
    st.integers(-1, 1),
    st.sampled_from(["wait", "wait", "try"]),
    st.sampled_from([None, None, 0, 1, 2]),
)
_op = st.one_of(
    _acq,
    _acq,
    st.tuples(st.just("rel"), st.integers(0, 50)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
)


@pytest.mark.parametrize("form", list(RAW_FORMS))
@pytest.mark.parametrize(
    "policy",
    [("fifo", "bestfit"), ("fifo", "spread"), ("backfill", "bestfit"), ("backfill", "spread")],
    ids=["fifo-bestfit", "fifo-spread", "bf-bestfit", "bf-spread"],
)
def test_scripts_place_as_the_model_on_random_histories(redis_proc, form, policy):
    """Random mixes of acquires (1-4 bytes on devices of 4, 3 and 3 bytes, priorities -1..1,
    wait or try, pinned to a device or not), releases and cancels: after every call each
    grant and its device, the queue's order and each device's bytes equal the model's, and
    no device holds more than its capacity."""
    c = redis.Redis.from_url(redis_proc.url)
    call = RAW_FORMS[form]
    n = 0
    dcap = [4, 3, 3]

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(_op, min_size=8, max_size=40))
    def run(ops):
        nonlocal n
        n += 1
        pool = f"dm{n}"
        raw(c, pool, "configure", 10, 1000, "set", 0, 0, policy[0], 600000, "", "4 3 3", policy[1])
        model = QueueModel(10, policy=policy[0], backfill_ms=600000, dcap=dcap, placement=policy[1])
        known: list[str] = []
        for op in ops:
            if op[0] == "acq":
                _, amount, prio, mode, pin = op
                t = new_id()
                args = [
                    t,
                    new_id(),
                    amount,
                    60000,
                    600000,
                    mode,
                    "{}",
                    "m",
                    prio,
                    "",
                    "" if pin is None else pin,
                ]
                if amount > model.largest(pin):
                    with pytest.raises(redis.ResponseError, match="GPULOCK_CAPACITY"):
                        call(c, pool, "acquire", *args)
                    continue
                r = call(c, pool, "acquire", *args)
                now = int(r[5]) if r[0] == 1 else int(r[4])
                want = model.acquire(t, amount, prio, now, mode, "", pin)
                got = {1: "granted", 0: "queued", 2: "refused"}[int(r[0])]
                assert got == want, (op, r)
                if got == "granted":
                    assert int(r[9]) == model.dev_of[t], (op, r)
                if got != "refused":
                    known.append(t)
            elif known:
                t = known[op[1] % len(known)]
                end_one(c, pool, call, model, op[0], t)
            assert [_s(x) for x in c.zrange(pool_keys(pool)[3], 0, -1)] == model.order()
            held = {_s(a): _s(b) for a, b in c.hgetall(pool_keys(pool)[6]).items()}
            places = {t: int(v) for t, v in held.items() if t.startswith("place:")}
            held = ticket_grants(held)
            assert set(held) == set(model.held)
            # each lease's place (lua/lib.lua lease_place) where one is stored: the model's
            for t, lid in held.items():
                if f"place:{lid}" in places:
                    assert places[f"place:{lid}"] == model.places[t], (t, places)
            for t, lid in held.items():  # each lease on the model's device
                assert int(_s(c.hget(pool_keys(pool)[2], lid)).split("|")[6]) == model.dev_of[t]
            check_consistent(c, pool)
            dused = [
                int(v or 0) for v in c.hmget(pool_keys(pool)[0], "dused:0", "dused:1", "dused:2")
            ]
            assert dused == [model.dused(i) for i in range(3)]
            assert all(u <= cap for u, cap in zip(dused, dcap)), dused
        c.delete(*pool_keys(pool)[:7])

    try:
        run()
    finally:
        c.close()


async def test_hand_offs_place_waiters_on_the_device_freed(make_apool, rclient, pool_name):
    """Two devices full; a waiter of any device is handed the one a release frees."""
    pool = make_apool()
    await pool.configure(10, devices=2)
    a = await pool.acquire(10, timeout=0)
    b = await pool.acquire(10, timeout=0)
    assert (a.device, b.device) == (0, 1)
    task = asyncio.create_task(pool.acquire(6))
    await async_wait_until(lambda: rclient.zcard(pool_keys(pool_name)[3]) == 1, 10)
    await b.release()
    c = await asyncio.wait_for(task, 10)
    assert c.device == 1
    await a.release()
    await c.release()
    assert_empty(rclient, pool_name)


async def test_a_request_id_reused_for_another_device_is_a_conflict(make_apool, rclient, pool_name):
    pool = make_apool()
    await pool.configure(10, devices=2)
    rid = new_id()
    lease = await pool.acquire(4, device=1, request_id=rid)
    with pytest.raises(InvalidArgument, match="another amount, tenant or device"):
        await pool.acquire(4, device=0, request_id=rid)
    again = await pool.acquire(4, request_id=rid)  # no device: its grant, wherever it is
    assert again.device == 1 and again.id == lease.id
    blocker = await pool.acquire(10, device=0)
    queued = asyncio.create_task(pool.acquire(8, device=0, request_id="q1"))
    await async_wait_until(lambda: rclient.zcard(pool_keys(pool_name)[3]) == 1, 10)
    # queued for device 0: another pin is a conflict (none is the same request's retry)
    with pytest.raises(InvalidArgument, match="another amount, tenant or device"):
        await pool.acquire(8, device=1, request_id="q1", timeout=0)
    await blocker.release()
    got = await asyncio.wait_for(queued, 10)
    assert got.device == 0
    await got.release()
    await lease.release()
    assert_empty(rclient, pool_name)


def test_the_devices_may_not_sum_past_what_a_pool_holds():
    from gpulock.protocol.args import encode_devices

    with pytest.raises(InvalidArgument, match="sum to"):
        encode_devices([2**52, 2**52, 2**52], None)
