"""Priorities (docs/SEMANTICS.md, "Priorities"): order by effective priority then arrival,
aging on the server clock, a request ahead of a blocked head granted at once, bad values
refused with nothing written, records of earlier versions read as priority 0, and the scripts'
decisions equal to a pure-Python model's on random histories (both script forms)."""

from __future__ import annotations

import asyncio

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.pools import (
    is_lease_field,
    RAW_FORMS,
    _s,
    assert_empty,
    check_consistent,
    raw,
    raw_acquire,
    raw_configure,
    server_ms,
    snapshot,
)
from support.priority_model import AGING_US, QueueModel, end_one
from support.waiting import async_wait_until, wait_until

from gpulock import InvalidArgument
from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys

pytestmark = pytest.mark.timeout(120)


def _queue(c: redis.Redis, pool: str) -> list[str]:
    return [_s(t) for t in c.zrange(pool_keys(pool)[3], 0, -1)]


def _tickets(c: redis.Redis, pool: str) -> set[str]:
    """Tickets that hold a lease now (the tickets hash less the leases' own fields)."""
    return {_s(t) for t in c.hkeys(pool_keys(pool)[6]) if not is_lease_field(_s(t))}


async def _queue_in_order(pool, specs, granted):
    """One acquire per (name, amount, priority), each started after the previous one queued;
    ``granted`` gets (name, lease) in grant order. Returns the tasks."""
    tasks = []
    for name, amount, prio in specs:
        queued = asyncio.Event()

        async def one(name=name, amount=amount, prio=prio, queued=queued):
            lease = await pool.acquire(amount, priority=prio, on_queued=lambda p: queued.set())
            granted.append((name, lease))
            return lease

        tasks.append(asyncio.create_task(one()))
        await asyncio.wait_for(queued.wait(), 10)
    return tasks


async def test_higher_priority_is_granted_first_fifo_within_a_priority(
    make_apool, rclient, pool_name
):
    pool = make_apool(capacity=1)
    holder = await pool.acquire(1)
    granted: list = []
    specs = [("a0", 1, 0), ("b5", 1, 5), ("c0", 1, 0), ("d5", 1, 5), ("e-3", 1, -3), ("f9", 1, 9)]
    tasks = await _queue_in_order(pool, specs, granted)
    st_ = await pool.status()
    # every arrival came within the same few seconds: the priorities decide (each level is a
    # second of waiting; the test checks the exact rule on recorded times below)
    by_ticket = {w.request_id: w for w in st_.waiters}
    assert sorted(w.priority for w in st_.waiters) == sorted(p for _, _, p in specs)
    assert [w.position for w in st_.waiters] == list(range(1, 7))
    assert len(by_ticket) == 6
    await holder.release()
    for k in range(6):
        await async_wait_until(lambda k=k: len(granted) > k, timeout=10)
        await granted[k][1].release()
    await asyncio.gather(*tasks)
    assert [n for n, _ in granted] == ["f9", "b5", "d5", "a0", "c0", "e-3"]
    assert_empty(rclient, pool_name)


async def test_a_request_ahead_of_a_blocked_head_that_fits_is_granted_at_once(
    make_apool, rclient, pool_name
):
    """The head (8 of 10 bytes, 4 free) blocks FIFO; a 2-byte request of higher priority
    would be ahead of it and fits: granted now, also with timeout=0. A priority-0 one queues
    behind the head (no backfill within a priority)."""
    pool = make_apool(capacity=10)
    blocker = await pool.acquire(6)
    granted: list = []
    tasks = await _queue_in_order(pool, [("head", 8, 0)], granted)
    urgent = await pool.acquire(2, priority=1, timeout=5)
    tried = await pool.acquire(2, priority=2, timeout=0)
    assert (await pool.status()).used == 10
    await tried.release()
    with pytest.raises(Exception) as e:  # AcquireTimeout: behind the head, never granted
        await pool.acquire(2, timeout=0)
    assert type(e.value).__name__ == "AcquireTimeout"
    tail = await _queue_in_order(pool, [("tail", 2, 0)], granted)
    st_ = await pool.status()
    assert [w.amount for w in st_.waiters] == [8, 2]
    await urgent.release()
    await blocker.release()
    await async_wait_until(lambda: len(granted) == 2, timeout=10)
    assert [n for n, _ in granted] == ["head", "tail"]
    for _, lease in granted:
        await lease.release()
    await asyncio.gather(*tasks, *tail)
    assert_empty(rclient, pool_name)


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_aging_a_waiter_gains_a_level_per_second_on_the_server_clock(rclient, pool_name, form):
    """A waits at priority 0; a later request passes it only if its priority exceeds A's by
    more than the seconds between their arrivals. The expectation is computed from the
    arrival times the server recorded (so a slow machine changes which case happens, never
    the verdict); the wait on the server clock makes the interesting case the likely one."""
    call = RAW_FORMS[form]
    raw_configure(rclient, pool_name, 1)
    assert raw_acquire(rclient, pool_name, 1)[0] == 1  # the blocker
    a = new_id()
    r = call(rclient, pool_name, "acquire", a, new_id(), 1, 60000, 600000, "wait", "{}", "t", 0)
    t_a = int(r[4])
    wait_until(lambda: server_ms(rclient) >= t_a + 1500, timeout=10)
    later = {}
    for prio in (1, 2):
        t = new_id()
        r = call(
            rclient, pool_name, "acquire", t, new_id(), 1, 60000, 600000, "wait", "{}", "t", prio
        )
        assert r[0] == 0
        later[t] = (prio, int(r[4]))
    order = _queue(rclient, pool_name)
    for t, (prio, t_x) in later.items():
        # effective priorities at any instant: A 0 + waited, X prio + waited; X is ahead iff
        # it arrived less than prio seconds after A
        ahead = (t_x - t_a) * 1000 < prio * AGING_US
        assert (order.index(t) < order.index(a)) == ahead, (prio, t_x - t_a, order)
    # positions are exact ranks, reported by a refresh
    for i, t in enumerate(order):
        r = call(rclient, pool_name, "acquire", t, new_id(), 1, 60000, 600000, "wait", "{}", "t", 0)
        assert r[:2] == [0, i + 1]
    check_consistent(rclient, pool_name)


@pytest.mark.parametrize("form", list(RAW_FORMS))
@pytest.mark.parametrize("bad", ["101", "-101", "1.5", "x", "", " 1", "+1", "99999999999"])
def test_a_bad_priority_is_refused_naming_it_and_nothing_is_written(rclient, pool_name, form, bad):
    call = RAW_FORMS[form]
    raw_configure(rclient, pool_name, 1)
    assert raw_acquire(rclient, pool_name, 1)[0] == 1
    before = snapshot(rclient)
    with pytest.raises(redis.ResponseError) as e:
        call(
            rclient,
            pool_name,
            "acquire",
            new_id(),
            new_id(),
            1,
            60000,
            5000,
            "wait",
            "{}",
            "t",
            bad,
        )
    assert str(e.value).startswith("GPULOCK_BADARG priority must be"), e.value
    assert snapshot(rclient) == before


@pytest.mark.parametrize("bad", [101, -101, 1.5, "x", True, None, "1e3", "--5", "-+5"])
async def test_a_bad_priority_is_refused_by_the_client(make_apool, bad):
    pool = make_apool(capacity=1)
    with pytest.raises(InvalidArgument, match="priority must be an integer in \\[-100, 100\\]"):
        await pool.acquire(1, priority=bad)


class _Index:
    """An integer type of another library (numpy's int64 behaves so)."""

    def __init__(self, v: int):
        self.v = v

    def __index__(self) -> int:
        return self.v


def test_sync_pool_takes_priority_too(make_pool, rclient, pool_name):
    pool = make_pool(capacity=3)
    lease3 = pool.acquire(1, priority=_Index(7), timeout=0)
    lease3.release()
    lease = pool.acquire(1, priority=-100)
    lease2 = pool.acquire(1, priority=100, timeout=0)
    assert pool.status().used == 2
    lease.release()
    lease2.release()
    assert_empty(rclient, pool_name)


def test_a_waiter_record_of_an_earlier_version_reads_as_priority_zero(rclient, pool_name):
    """During a rolling upgrade a waiter queued by a version before priorities has a record
    without the field: status lists it at priority 0 and a release grants it."""
    raw_configure(rclient, pool_name, 1)
    r = raw_acquire(rclient, pool_name, 1)
    k = pool_keys(pool_name)
    old, lid = "old-ticket", new_id()
    rclient.zadd(k[3], {old: 5})  # an arrival sequence number, as those versions scored
    rclient.hset(k[4], old, f'1|60000|{int(server_ms(rclient))}|{lid}|test|{{"host":"h"}}')
    rclient.zadd(k[5], {old: int(server_ms(rclient)) + 600000})
    st_ = raw(rclient, pool_name, "status", 10)
    (w,) = st_[13]
    assert _s(w[0]) == old and w[5] == 0 and _s(w[4]) == '{"host":"h"}'
    raw(rclient, pool_name, "release", _s(r[1]), r[2])
    assert _tickets(rclient, pool_name) == {old}
    check_consistent(rclient, pool_name)


_acq = st.tuples(
    st.just("acq"),
    st.sampled_from([1, 1, 2, 3, 4, 6, 8, 10]),
    st.integers(-2, 2),
    st.sampled_from(["wait", "wait", "try"]),
    st.sampled_from(["", "a", "a", "b"]),
)
# A resize of a known request's lease (index, change of its amount, mode): a shrink, the same
# amount, a growth (granted, queued, refused by the deadlock rule, withdrawn by a later
# smaller resize, never fitting), or a lease that is not held (lost).
_resize = st.tuples(
    st.just("resize"),
    st.integers(0, 50),
    st.sampled_from([-3, -1, 0, 1, 1, 2, 2, 3, 5]),
    st.sampled_from(["wait", "wait", "wait", "try"]),
)
_op = st.one_of(
    _acq,
    _acq,
    st.tuples(st.just("rel"), st.integers(0, 50)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    _resize,
    _resize,
)
# With quotas: also change a tenant's quota mid-history (0 removes it).
_op_q = st.one_of(
    _acq,
    _acq,
    st.tuples(st.just("rel"), st.integers(0, 50)),
    st.tuples(st.just("cancel"), st.integers(0, 50)),
    st.tuples(st.just("quota"), st.sampled_from(["a", "b"]), st.sampled_from([0, 2, 3, 5, 8])),
    _resize,
)

_RESIZE_ERRORS = {
    "GPULOCK_LOST": "lost",
    "GPULOCK_CAPACITY": "capacity",
    "GPULOCK_QUOTA": "quota",
    "GPULOCK_CONFLICT": "conflict",
    "GPULOCK_RESIZE_REFUSED": "deadlock",
}


def _held(c: redis.Redis, pool: str) -> dict[str, int]:
    """Ticket -> amount of every lease, read on the holder records."""
    out = {}
    for rec in c.hvals(pool_keys(pool)[2]):
        f = _s(rec).split("|")
        out[f[4]] = int(f[0])
    return out


def _resize_one(c, pool, call, model, t, lid, amount, prio, mode) -> None:
    """resize.lua on ticket ``t``'s lease ``lid`` and the model alike: the same outcome (and
    position when queued)."""
    g = f"grow:{lid}"
    args = [g, lid, amount, "", 600000, mode, "", "m", prio]
    try:
        r = call(c, pool, "resize", *args)
    except redis.ResponseError as e:
        got = _RESIZE_ERRORS[str(e).split(" ", 1)[0]]
        assert model.resize(t, g, amount, prio, int(server_ms(c)), mode) == got, (t, amount, e)
        return
    now = int(r[5]) if r[0] == 1 else int(r[4])
    want = model.resize(t, g, amount, prio, now, mode)
    got = {1: "granted", 0: "queued", 2: "refused"}[int(r[0])]
    assert got == want, (t, amount, mode, r)
    if got == "granted":
        assert int(r[4]) == amount
    if got == "queued":
        assert int(r[1]) == model.order().index(g) + 1


@pytest.mark.parametrize("form", list(RAW_FORMS))
@pytest.mark.parametrize(
    "policy",
    [
        ("fifo", 2000, ""),
        ("backfill", 600000, ""),
        ("backfill", 4, ""),
        ("fifo", 2000, "a=4 b=6"),
        ("backfill", 600000, "a=3"),
    ],
    ids=["fifo", "bf", "bf4ms", "fifo-quota", "bf-quota"],
)
def test_scripts_decide_as_the_model_on_random_histories(redis_proc, form, policy):
    """Random mixes of acquires (amounts 1-10 of a capacity of 10, priorities -2..2, wait or
    try, tenants none, a or b), releases, cancels and resizes of the leases (shrinks, growths
    granted, queued at the lease's place, refused by the deadlock rule or granted ahead of
    a blocked head on a stuck device, withdrawn by a later resize), under FIFO, backfill with
    a window that stays open and backfill with a 4 ms window (so it closes during the
    history, at times the model reads from the replies), and with tenant quotas that the
    history also changes: after every call the grants, each lease's amount and stored place,
    the queue's order, the bytes used and each tenant's bytes equal the model's
    (tests/support/priority_model.py), and no tenant holds more than its quota unless the
    quota was lowered under it."""
    c = redis.Redis.from_url(redis_proc.url)
    call = RAW_FORMS[form]
    n = 0

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(_op_q if policy[2] else _op, min_size=8, max_size=40))
    def run(ops):
        nonlocal n
        n += 1
        pool = f"pm{n}"
        raw(c, pool, "configure", 10, 1000, "set", 0, 0, policy[0], policy[1], policy[2])
        model = QueueModel(10, policy=policy[0], backfill_ms=policy[1])
        for item in policy[2].split():
            model.quotas[item.split("=")[0]] = int(item.split("=")[1])
        lowered: set[str] = set()  # tenants whose quota went below what they held
        lids: dict[str, str] = {}
        prios: dict[str, int] = {}
        known: list[str] = []
        for op in ops:
            if op[0] == "acq":
                _, amount, prio, mode, tenant = op
                t, lid = new_id(), new_id()
                lids[t], prios[t] = lid, prio
                args = [t, lid, amount, 60000, 600000, mode, "{}", "m", prio, tenant]
                try:
                    r = call(c, pool, "acquire", *args)
                except redis.ResponseError as e:
                    assert str(e).startswith(f"GPULOCK_QUOTA {amount} "), e
                    assert model.acquire(t, amount, prio, server_ms(c), mode, tenant) == "quota"
                    continue
                now = int(r[5]) if r[0] == 1 else int(r[4])
                want = model.acquire(t, amount, prio, now, mode, tenant)
                got = {1: "granted", 0: "queued", 2: "refused"}[int(r[0])]
                assert got == want, (op, r)
                if got == "queued":
                    assert int(r[1]) == model.order().index(t) + 1
                if got != "refused":
                    known.append(t)
            elif op[0] == "quota":
                _, tenant, q = op
                if q and model.tenant_used(tenant) > q:
                    lowered.add(tenant)
                raw(c, pool, "configure", 10, 1000, "set", 0, 0, "", "", f"{tenant}={q}")
                # the window is open for the whole history (600 s) or there is none (FIFO)
                model.set_quota(tenant, q, int(server_ms(c)))
            elif op[0] == "resize":
                held = [x for x in known if x in model.held]
                if known:
                    _, i, change, mode = op
                    # mostly a lease held; one in five any request (lost when not held)
                    t = held[i % len(held)] if held and i % 5 else known[i % len(known)]
                    amount = max(1, model.held.get(t, 1) + change)
                    _resize_one(c, pool, call, model, t, lids[t], amount, prios[t], mode)
            elif known:
                t = known[op[1] % len(known)]
                end_one(c, pool, call, model, op[0], t)
            assert _queue(c, pool) == model.order()
            assert _tickets(c, pool) == set(model.held)
            assert _held(c, pool) == model.held
            # each lease's place (lua/lib.lua lease_place) where one is stored: the model's
            for t in model.held:
                v = c.hget(pool_keys(pool)[6], f"place:{lids[t]}")
                if v is not None:
                    assert int(v) == model.places[t], (t, v)
            assert check_consistent(c, pool)["used"] == model.used
            # read on the raw keys: status.lua hands off too (a backfill window may be open)
            cfg = c.hmget(pool_keys(pool)[0], "tused:a", "tused:b")
            for tn, v in zip(("a", "b"), cfg):
                got_used = int(v or 0)
                assert got_used == model.tenant_used(tn)
                q = model.quotas.get(tn, 0)
                if q and tn not in lowered:
                    assert got_used <= q, (tn, got_used, q)
                if not q:
                    lowered.discard(tn)
                elif got_used <= q:
                    lowered.discard(tn)
        c.delete(*pool_keys(pool)[:7])

    try:
        run()
    finally:
        c.close()


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_backfill_passes_a_blocked_head_only_within_its_window(rclient, pool_name, form):
    """Capacity 10, 6 held; the head wants 8. Under backfill with a 1.5 s window a 1-byte
    request is granted past it; once the head has waited 1.5 s on the server clock, a 1-byte
    request queues although it fits, and the head is granted first when the bytes free. Each
    decision is checked against the model at the times the server reported."""
    call = RAW_FORMS[form]
    raw(rclient, pool_name, "configure", 10, 1000, "set", 0, 0, "backfill", 1500)
    model = QueueModel(10, policy="backfill", backfill_ms=1500)

    def acq(t, amount):
        r = call(
            rclient, pool_name, "acquire", t, new_id(), amount, 60000, 600000, "wait", "{}", "t", 0
        )
        got = {1: "granted", 0: "queued"}[int(r[0])]
        assert got == model.acquire(t, amount, 0, int(r[5] if r[0] == 1 else r[4]), "wait")
        return got, int(r[5] if r[0] == 1 else r[4])

    assert acq("blocker", 6)[0] == "granted"
    _, t_head = acq("head", 8)
    got_b, t_b = acq("early", 1)
    assert got_b == ("granted" if t_b - t_head < 1500 else "queued")
    wait_until(lambda: server_ms(rclient) >= t_head + 1500, timeout=10)
    assert acq("late", 1)[0] == "queued"  # fits (3 free or 4), but the window is closed
    k = pool_keys(pool_name)
    lid = _s(rclient.hget(k[6], "blocker"))
    token = int(_s(rclient.hget(k[2], lid)).split("|")[1])
    r = call(rclient, pool_name, "release", lid, token)
    assert int(r[3]) == len(model.release("blocker", int(r[1])))
    assert "head" in _tickets(rclient, pool_name)
    assert _tickets(rclient, pool_name) == set(model.held)
    assert _queue(rclient, pool_name) == model.order()
    check_consistent(rclient, pool_name)


async def test_the_queue_policy_is_set_shown_and_validated(make_apool, rclient, pool_name):
    pool = make_apool(capacity=10)
    out = await pool.configure(10)
    assert (out["policy"], out["backfill_window"]) == ("fifo", 2.0)
    out = await pool.configure(10, policy="backfill", backfill_window=0.5)
    assert (out["policy"], out["backfill_window"]) == ("backfill", 0.5)
    st_ = await pool.status()
    assert (st_.policy, st_.backfill_window) == ("backfill", 0.5)
    out = await pool.configure(10, max_waiters=50)  # other settings leave the policy alone
    assert (out["policy"], out["backfill_window"]) == ("backfill", 0.5)
    before = snapshot(rclient)
    for kw, msg in (
        ({"policy": "lifo"}, "policy must be 'fifo' or 'backfill'"),
        ({"backfill_window": 0}, "backfill_window"),
        ({"backfill_window": -1}, "backfill_window"),
        ({"backfill_window": "soon"}, "backfill_window"),
    ):
        with pytest.raises(InvalidArgument, match=msg):
            await pool.configure(10, **kw)
    assert snapshot(rclient) == before


@pytest.mark.parametrize("form", list(RAW_FORMS))
@pytest.mark.parametrize(
    "args, msg",
    [
        (["lifo", ""], "policy must be 'fifo' or 'backfill'"),
        (["backfill", "0"], "backfill_ms must be in"),
        (["backfill", "x"], "backfill_ms must be a decimal integer"),
    ],
)
def test_configure_refuses_a_bad_policy_with_nothing_written(rclient, pool_name, form, args, msg):
    raw_configure(rclient, pool_name, 10)
    before = snapshot(rclient)
    with pytest.raises(redis.ResponseError, match=msg):
        RAW_FORMS[form](rclient, pool_name, "configure", 10, 1000, "set", 0, 0, *args)
    assert snapshot(rclient) == before
