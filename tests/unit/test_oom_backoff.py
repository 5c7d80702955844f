"""The OOM back-off rule (gpulock.oom_backoff): bounds, the AIMD steps after k OOMs then m
successes (or seconds), episodes, the lease inflation and the state's encoding."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulock.errors import InvalidArgument
from gpulock.oom_backoff import BackoffRule, BucketState, PoolState, decode_bucket, decode_pool

RULE = BackoffRule()
MIN = 60_000  # one capacity_every_s of the default rule, in ms


def test_default_numbers_are_the_documented_rule():
    r = RULE
    assert (r.estimate_up, r.estimate_max, r.estimate_down, r.estimate_every) == (1.5, 4.0, 0.1, 50)
    assert (r.capacity_cut, r.capacity_floor, r.capacity_step) == (0.8, 0.5, 0.05)
    assert (r.capacity_every_s, r.episode_s) == (60.0, 5.0)


def test_bucket_oom_then_successes():
    b = RULE.bucket_oom(BucketState(), ok=7, now_ms=1_000_000)
    assert b == BucketState(1.5, 7, 1_000_000)
    assert RULE.scale(b, 7 + 49) == 1.5  # 49 clean calls: no step yet
    assert RULE.scale(b, 7 + 50) == pytest.approx(1.4)
    assert RULE.scale(b, 7 + 250) == 1.0  # five steps: back at the floor
    assert RULE.scale(b, 7 + 10_000) == 1.0  # never below it
    # the next OOM multiplies the scale it has now, not the one stored
    b2 = RULE.bucket_oom(b, ok=7 + 100, now_ms=1_000_000 + 6_000)
    assert b2.scale == pytest.approx(1.3 * 1.5) and b2.ok_at == 107


def test_oom_within_an_episode_changes_nothing():
    b = RULE.bucket_oom(BucketState(), ok=0, now_ms=10_000)
    assert RULE.bucket_oom(b, ok=3, now_ms=14_999) is b
    assert RULE.bucket_oom(b, ok=3, now_ms=15_000).scale == 2.25
    p = RULE.pool_oom(PoolState(), now_ms=10_000)
    assert RULE.pool_oom(p, now_ms=14_999) is p
    assert RULE.pool_oom(p, now_ms=15_000).factor == pytest.approx(0.64)


def test_pool_factor_cut_floor_and_recovery():
    p = PoolState()
    t = 1_000_000
    for k in range(1, 6):  # k OOMs, each in an episode of its own
        p = RULE.pool_oom(p, t)
        assert p.factor == pytest.approx(max(0.5, 0.8**k))
        t += 5_000
    assert p.factor == 0.5  # 0.8**4 = 0.41 < floor
    assert RULE.factor(p, p.at_ms + MIN - 1) == 0.5
    assert RULE.factor(p, p.at_ms + MIN) == pytest.approx(0.55)
    assert RULE.factor(p, p.at_ms + 9 * MIN) == pytest.approx(0.95)
    assert RULE.factor(p, p.at_ms + 10 * MIN) == 1.0
    assert RULE.factor(p, p.at_ms + 1000 * MIN) == 1.0


@given(
    events=st.lists(
        st.tuples(st.booleans(), st.integers(0, 120_000), st.integers(0, 500)), max_size=60
    )
)
def test_state_stays_in_bounds(events):
    """Any interleaving of OOMs, time and successes keeps scale in [1, max] and the factor in
    [floor, 1]."""
    b, p, ok, now = BucketState(), PoolState(), 0, 1_000_000
    for oom, dt, succ in events:
        now += dt
        ok += succ
        if oom:
            b, p = RULE.bucket_oom(b, ok, now), RULE.pool_oom(p, now)
        assert 1.0 <= RULE.scale(b, ok) <= RULE.estimate_max
        assert RULE.capacity_floor <= RULE.factor(p, now) <= 1.0


@given(k=st.integers(0, 12), m=st.integers(0, 2000))
def test_after_k_ooms_then_m_successes(k, m):
    b, ok, now = BucketState(), 0, 1_000_000
    for _ in range(k):
        b = RULE.bucket_oom(b, ok, now)
        now += 5_000
    peak = min(4.0, 1.5**k)
    assert RULE.scale(b, ok) == pytest.approx(peak)
    assert RULE.scale(b, ok + m) == pytest.approx(max(1.0, peak - (m // 50) * 0.1))


@given(k=st.integers(0, 12), seconds=st.integers(0, 3600))
def test_after_k_ooms_then_clean_seconds(k, seconds):
    p, now = PoolState(), 1_000_000
    for _ in range(k):
        p = RULE.pool_oom(p, now)
        now += 5_000
    low = max(0.5, 0.8**k)
    assert RULE.factor(p, p.at_ms) == pytest.approx(low)
    want = 1.0 if k == 0 else min(1.0, low + (seconds // 60) * 0.05)
    assert RULE.factor(p, p.at_ms + seconds * 1000) == pytest.approx(want)


@given(
    amount=st.integers(0, 2**40),
    factor=st.floats(0.5, 1.0),
    room=st.one_of(st.none(), st.integers(0, 2**41)),
)
def test_lease_amount(amount, factor, room):
    got = BackoffRule.lease_amount(amount, factor, room)
    assert got >= amount
    if factor >= 1.0:
        assert got == amount
    elif room is None or room >= math.ceil(amount / factor):
        assert got == math.ceil(amount / factor)
    else:
        assert got == max(amount, room)


def test_encoding_round_trips_and_garbage_is_no_backoff():
    b = BucketState(2.25, 40, 1_700_000_000_123)
    assert decode_bucket(b.encode()) == b and decode_bucket(b.encode().encode()) == b
    p = PoolState(0.64, 1_700_000_000_123)
    assert decode_pool(p.encode()) == p
    for raw in (None, b"", "x", "1 2", "a b c", "1 2 3 4"):
        assert decode_bucket(raw) == BucketState()
    for raw in (None, b"", "x", "a b", "1 2 3"):
        assert decode_pool(raw) == PoolState()
    assert decode_pool("7 2") == PoolState(1.0, 2)  # a factor above 1 is read as 1
    assert decode_bucket("0.5 1 2").scale == 1.0  # a scale below 1 is read as 1


@pytest.mark.parametrize(
    "kw",
    [
        {"estimate_up": 1.0},
        {"estimate_max": 0.5},
        {"estimate_down": 0},
        {"estimate_every": 0},
        {"capacity_cut": 1.0},
        {"capacity_floor": 0},
        {"capacity_step": -1},
        {"capacity_every_s": 0},
        {"episode_s": -1},
        {"capacity_cut": float("nan")},
    ],
)
def test_bad_numbers_are_refused_by_name(kw):
    (name,) = kw
    with pytest.raises(InvalidArgument, match=name):
        BackoffRule(**kw)
