"""The dashboard's view from a status and samples (gpulock/dashboard/view.py), without a server:
rates from the samples' server-clock instants, counters that restart, hidden holder fields."""

from __future__ import annotations

from gpulock.dashboard.view import pool_view
from gpulock.protocol.replies import LeaseInfo, PoolStatus, WaiterInfo
from gpulock.admin.samples import Sample


def sample(t_s: float, grants: int, rejected: int = 0, used: int = 0) -> Sample:
    return Sample(int(t_s * 1000), 100, used, 10, 1, 0, grants, rejected, 0)


def status(**kw) -> PoolStatus:
    lease = LeaseInfo("L1", 40, 7, 12.5, 3.0, 30.0, "req-secret", {"owner": "ab12", "job": "x"})
    waiter = WaiterInfo(1, "req-2", 70, 2.5, 9.0, {"owner": "cd34", "principal": "ops"})
    base = dict(
        pool="p", capacity=100, used=40, epoch=1, fence=7, max_waiters=10, lease_count=1,
        waiter_count=1, grants=9, reaped_leases=0, reaped_waiters=0, leases=[lease],
        waiters=[waiter],
    )  # fmt: skip
    base.update(kw)
    return PoolStatus(**base)


def test_grant_rate_is_over_the_newest_ten_seconds_of_samples():
    samples = [sample(t, g) for t, g in ((0, 0), (5, 50), (10, 60), (15, 80))]
    v = pool_view(status(), samples, {})
    assert v["grant_rate"] == (80 - 50) / 10  # the oldest sample within 10 s: t=5...
    samples = [sample(t, g) for t, g in ((0, 0), (6, 10), (16, 30))]
    assert pool_view(status(), samples, {})["grant_rate"] == 2.0  # ...else the one before last


def test_no_rate_without_two_samples_and_a_restarted_counter_counts_from_zero():
    assert pool_view(status(), [], {})["grant_rate"] is None
    assert pool_view(status(), [sample(0, 5)], {})["grant_rate"] is None
    assert pool_view(status(), [sample(0, 50), sample(1, 3)], {})["grant_rate"] == 0.0


def test_last_minute_counts_and_totals():
    samples = [sample(0, 0, 1), sample(30, 0, 4), sample(70, 0, 9), sample(100, 0, 12)]
    v = pool_view(status(), samples, {"rejected": 12, "oom": 2})
    assert v["rejected"] == 12 and v["oom"] == 2
    assert v["rejected_last_minute"] == 12 - 9  # samples at 70..100 s are within the minute
    assert v["history"]["t"] == [0, 30000, 70000, 100000]


def test_no_token_identity_no_lease_or_request_id():
    v = pool_view(status(), [], {})
    assert v["leases"] == [
        {
            "holder": {"job": "x"},
            "amount": 40,
            "token": 7,
            "expires_in": 12.5,
            "held_for": 3.0,
            "device": 0,
            "priority": None,
            "yield_in": None,
            "kept": False,
        }
    ]
    assert v["waiters"] == [
        {
            "position": 1,
            "holder": {"principal": "ops"},
            "amount": 70,
            "waited": 2.5,
            "priority": 0,
            "growth_token": None,  # a new request, not a lease's growth
            "estimated_wait_s": None,  # the pool's drain rate is not measured
        }
    ]
    text = repr(v)
    for secret in ("ab12", "cd34", "req-secret", "req-2", "L1"):
        assert secret not in text
    assert v["resident"] == 0 and v["free"] == 60


def test_the_queue_policy_and_each_waiters_priority():
    v = pool_view(status(), [], {})
    assert (v["policy"], v["backfill_window"]) == ("fifo", 2.0)
    waiter = WaiterInfo(1, "req-3", 70, 2.5, 9.0, {}, priority=-7)
    v = pool_view(status(policy="backfill", backfill_window=0.25, waiters=[waiter]), [], {})
    assert (v["policy"], v["backfill_window"]) == ("backfill", 0.25)
    assert [w["priority"] for w in v["waiters"]] == [-7]


def test_kept_bytes_and_each_leases_kept_mark():
    v = pool_view(status(), [], {})
    assert (v["kept_bytes"], v["kept_leases"], v["releases_kept"], v["kept_asked_back"]) == (
        0,
        0,
        0,
        0,
    )
    kept = LeaseInfo("L2", 40, 8, 12.5, 3.0, 30.0, "", {}, kept=True)
    st = status(leases=[kept], kept_bytes=40, kept_leases=1, releases_kept=5, kept_asked_back=2)
    v = pool_view(st, [], {})
    assert (v["kept_bytes"], v["kept_leases"], v["releases_kept"], v["kept_asked_back"]) == (
        40,
        1,
        5,
        2,
    )
    assert [lz["kept"] for lz in v["leases"]] == [True]
