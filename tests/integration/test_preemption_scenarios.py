"""Preemption's ask (docs/SEMANTICS.md, "Preemption"; lua/lib.lua ask_yield) in set scenarios
on the raw scripts: two preemptors in turn, a waiter that leaves after asking (cancelled, or
reaped for not refreshing), a pinned head, a head held back by its tenant's quota, resident
and not-preemptible leases. The grace is long (600 s): holders release, nothing is taken."""

from __future__ import annotations

import pytest
import redis
from support import preempt_raw as pr
from support.pools import RAW_FORMS, _s, assert_empty, check_consistent, raw, server_ms
from support.waiting import wait_until

from gpulock.protocol.args import new_id
from gpulock.protocol.keys import pool_keys

pytestmark = pytest.mark.timeout(120)

GRACE = 600_000


def _setup(c: redis.Redis, pool: str, cap: int, devices: str = "", quotas: str = "") -> None:
    raw(c, pool, "configure", cap, 1000, "set", 0, 0, "", "", quotas, devices, "", f"1 {GRACE}")


def _hold(c, pool, amount, prio, call, **kw) -> str:
    """A lease granted now; its id. Waits for the server clock to pass the previous grant's
    millisecond, so grants are ordered by acquired_ms (the rule's "youngest")."""
    t0 = server_ms(c)
    wait_until(lambda: server_ms(c) >= int(t0) + 1, timeout=10)
    r = pr.acquire(c, pool, amount, prio, call=call, **kw)
    assert r[0] == 1, r
    return _s(r[1])


def _queue(c, pool, amount, prio, call, **kw) -> tuple[str, list]:
    t = new_id()
    r = pr.acquire(c, pool, amount, prio, ticket=t, call=call, **kw)
    assert r[0] == 0, r
    return t, r


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_two_preemptors_ask_in_turn_and_never_the_same_holder_twice(rclient, pool_name, form):
    """H1 (priority -10, 60 B) then H2 (-10, 40 B) hold all of 100 B; W1 (10, 60 B) then W2
    (10, 40 B) queue. The rule walks H2 (youngest) then H1 and drops H2, which H1 alone makes
    unnecessary: W1 asks exactly H1. W2 is not the head and asks none. H1's release grants W1;
    W2, the head now, asks H2 in that same call; H2's release grants W2. Two asks in all."""
    c, call = rclient, RAW_FORMS[form]
    _setup(c, pool_name, 100)
    h1 = _hold(c, pool_name, 60, -10, call)
    h2 = _hold(c, pool_name, 40, -10, call)
    w1, r1 = _queue(c, pool_name, 60, 10, call)
    assert set(pr.asked(c, pool_name)) == {h1}
    w2, _ = _queue(c, pool_name, 40, 10, call)
    marks = pr.asked(c, pool_name)
    assert set(marks) == {h1}
    r = pr.release(c, pool_name, h1, call=call)
    assert r[0] == 1 and int(r[3]) == 1
    assert pr.lease_of(c, pool_name, w1) is not None
    marks2 = pr.asked(c, pool_name)
    assert set(marks2) == {h2}
    assert marks2[h2][0] == int(r[1])
    r = pr.release(c, pool_name, h2, call=call)
    assert r[0] == 1 and int(r[3]) == 1
    assert pr.asked(c, pool_name) == {}
    for w in (w1, w2):
        lid = pr.lease_of(c, pool_name, w)
        assert lid is not None
        assert pr.release(c, pool_name, lid, call=call)[0] == 1
    n = pr.counters(c, pool_name)
    assert (n["y_asked"], n["y_done"], n["y_taken"]) == (2, 2, 0)
    assert_empty(c, pool_name)


def _leave_after_asking(c, pool, call, leave) -> None:
    """H1 (0, 60 B) then H2 (0, 40 B) fill 100 B; W (5, 50 B) asks H1 (H2 walked first, then
    dropped). ``leave(w)`` takes W out of the queue. H1's mark stays as it was; W2 (5, 50 B)
    queues at the head and asks none (H1's 60 B are coming); H1's release grants W2."""
    h1 = _hold(c, pool, 60, 0, call)
    h2 = _hold(c, pool, 40, 0, call)
    w, _ = _queue(c, pool, 50, 5, call, wttl_ms=100)
    marks = pr.asked(c, pool)
    assert set(marks) == {h1}
    leave(w)
    assert not c.zscore(pool_keys(pool)[3], w)
    w2, r2 = _queue(c, pool, 50, 5, call)
    assert int(r2[1]) == 1
    assert pr.asked(c, pool) == marks
    assert pr.counters(c, pool)["y_asked"] == 1
    r = pr.release(c, pool, h1, call=call)
    assert r[0] == 1 and int(r[3]) == 1
    assert pr.lease_of(c, pool, w2) is not None
    assert pr.asked(c, pool) == {}
    for lid in (h2, pr.lease_of(c, pool, w2)):
        assert pr.release(c, pool, lid, call=call)[0] == 1
    n = pr.counters(c, pool)
    assert (n["y_asked"], n["y_done"], n["y_taken"]) == (1, 1, 0)
    assert_empty(c, pool)


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_a_cancelled_waiters_ask_stands(rclient, pool_name, form):
    c, call = rclient, RAW_FORMS[form]
    _setup(c, pool_name, 100)

    def cancel(w):
        assert call(c, pool_name, "cancel", w)[0] == 1

    _leave_after_asking(c, pool_name, call, cancel)


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_a_reaped_waiters_ask_stands(rclient, pool_name, form):
    """W's waiter ttl is 100 ms and it never refreshes: once the server clock passes its
    expiry, the next call (W2's acquire) reaps it before W2 queues."""
    c, call = rclient, RAW_FORMS[form]
    _setup(c, pool_name, 100)

    def stop_refreshing(w):
        exp = c.zscore(pool_keys(pool_name)[5], w)
        wait_until(lambda: server_ms(c) > exp, timeout=30)
        reaped = int(c.hget(pool_keys(pool_name)[0], "reaped_waiters") or 0)
        pr.acquire(c, pool_name, 1, 0, mode="try", call=call)  # a call that reaps
        assert int(c.hget(pool_keys(pool_name)[0], "reaped_waiters")) == reaped + 1

    _leave_after_asking(c, pool_name, call, stop_refreshing)


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_a_pinned_head_asks_only_on_its_device_an_unpinned_one_where_fewest_do(
    rclient, pool_name, form
):
    """Devices of 100 B each. On device 0: A (0, 50 B), then B (0, 50 B); on device 1: C
    (0, 100 B), granted last (the youngest). W pinned to device 1 (5, 50 B) asks C only.
    With C's release W is granted on device 1; then W' for any device (5, 100 B) can only be
    helped on device 0 (W's lease, priority 5, is no candidate): it asks A and B. Once they
    leave W' is granted; W'' (5, 100 B) finds only leases of priority 5: it asks none."""
    c, call = rclient, RAW_FORMS[form]
    _setup(c, pool_name, 200, devices="100 100")
    a = _hold(c, pool_name, 50, 0, call, device="0")
    b = _hold(c, pool_name, 50, 0, call, device="0")
    cl = _hold(c, pool_name, 100, 0, call, device="1")
    w, _ = _queue(c, pool_name, 50, 5, call, device="1")
    assert set(pr.asked(c, pool_name)) == {cl}
    assert pr.release(c, pool_name, cl, call=call)[0] == 1
    assert pr.lease_of(c, pool_name, w) is not None
    w2, _ = _queue(c, pool_name, 100, 5, call)
    assert set(pr.asked(c, pool_name)) == {a, b}
    for lid in (a, b):
        assert pr.release(c, pool_name, lid, call=call)[0] == 1
    assert pr.lease_of(c, pool_name, w2) is not None
    _queue(c, pool_name, 100, 5, call)
    assert pr.asked(c, pool_name) == {}
    assert pr.counters(c, pool_name)["y_asked"] == 3
    check_consistent(c, pool_name)


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_a_two_device_head_for_any_device_asks_where_fewest_leases_are_asked(
    rclient, pool_name, form
):
    """Device 0: A (0, 50 B), B (0, 50 B); device 1: C (0, 100 B), the oldest. W for any
    device (5, 100 B) would need A and B on device 0, C alone on device 1: it asks C."""
    c, call = rclient, RAW_FORMS[form]
    _setup(c, pool_name, 200, devices="100 100")
    cl = _hold(c, pool_name, 100, 0, call, device="1")
    _hold(c, pool_name, 50, 0, call, device="0")
    _hold(c, pool_name, 50, 0, call, device="0")
    _queue(c, pool_name, 100, 5, call)
    assert set(pr.asked(c, pool_name)) == {cl}
    check_consistent(c, pool_name)


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_a_head_held_back_by_its_tenants_quota_asks_none(rclient, pool_name, form):
    """Tenant a's quota is 50 B and its lease holds 50; B (no tenant, 0, 50 B) fills the pool.
    W of tenant a (5, 30 B) heads the queue and asks none (freeing B would not grant it); once
    it leaves, V of no tenant (5, 30 B) asks one (B, the youngest)."""
    c, call = rclient, RAW_FORMS[form]
    _setup(c, pool_name, 100, quotas="a=50")
    _hold(c, pool_name, 50, 0, call, tenant="a")
    b = _hold(c, pool_name, 50, 0, call)
    w, r = _queue(c, pool_name, 30, 5, call, tenant="a")
    assert int(r[1]) == 1
    assert pr.asked(c, pool_name) == {}
    assert call(c, pool_name, "cancel", w)[0] == 1
    _queue(c, pool_name, 30, 5, call)
    assert set(pr.asked(c, pool_name)) == {b}
    check_consistent(c, pool_name)


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_resident_and_not_preemptible_leases_are_never_asked(rclient, pool_name, form):
    """R resident (0, 40 B), N not preemptible (0, 30 B), P (0, 30 B, the oldest) fill 100 B.
    W (10, 40 B) could be granted only with R or N gone: it asks none (P alone is not
    enough). W' (10, 30 B) asks P only."""
    c, call = rclient, RAW_FORMS[form]
    _setup(c, pool_name, 100)
    p = _hold(c, pool_name, 30, 0, call)
    _hold(c, pool_name, 40, 0, call, kind="resident")
    _hold(c, pool_name, 30, 0, call, preemptible="0")
    w, _ = _queue(c, pool_name, 40, 10, call)
    assert pr.asked(c, pool_name) == {}
    assert call(c, pool_name, "cancel", w)[0] == 1
    _queue(c, pool_name, 30, 10, call)
    assert set(pr.asked(c, pool_name)) == {p}
    assert pr.counters(c, pool_name)["y_asked"] == 1
    check_consistent(c, pool_name)


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_a_tie_between_devices_goes_to_the_lowest_index(rclient, pool_name, form):
    """Device 0: A (0, 100 B); device 1: B (0, 100 B), the older. W for any device (5, 100 B)
    needs one pick on either: it asks on device 0, the lower index."""
    c, call = rclient, RAW_FORMS[form]
    _setup(c, pool_name, 200, devices="100 100")
    _hold(c, pool_name, 100, 0, call, device="1")
    a = _hold(c, pool_name, 100, 0, call, device="0")
    _queue(c, pool_name, 100, 5, call)
    assert set(pr.asked(c, pool_name)) == {a}
    check_consistent(c, pool_name)


@pytest.mark.parametrize("form", list(RAW_FORMS))
def test_nothing_is_asked_in_the_grace_period_after_a_loss(rclient, pool_name, form):
    """A pool made again after a loss (grace '1') grants nothing until its grace period ends,
    so a head asks nobody then; a lease put back with its preemption field (reassert.lua's
    10th) may be asked once the period is over."""
    c, call = rclient, RAW_FORMS[form]
    raw(c, pool_name, "configure", 100, 1000, "set", 60_000, 1, "", "", "", "", "", f"1 {GRACE}")
    lid = new_id()
    r = call(c, pool_name, "reassert", 1, lid, 1, 100, 60_000, "", "{}", "", "", "", "0|m")
    assert r[3][0] > 0, r  # put back
    assert _s(c.hget(pool_keys(pool_name)[6], f"pr:{lid}")) == "0|m"
    _queue(c, pool_name, 50, 5, call, ttl_ms=60_000, wttl_ms=60_000)
    assert pr.asked(c, pool_name) == {}
    c.hset(pool_keys(pool_name)[0], "grace_until", "0")  # the period ends (as if it had run out)
    call(c, pool_name, "renew", 0, 0)  # a heartbeat (any process's) runs the ask
    assert set(pr.asked(c, pool_name)) == {lid}
    check_consistent(c, pool_name)
