"""The grant-rate estimate behind Retry-After (gpulock.fastapi.BusyRate): only intervals that
begin busy count, the first busy interval sets the rate, a counter reset restarts sampling."""

from __future__ import annotations

import math

import pytest

from gpulock.fastapi import BusyRate


def test_no_rate_before_a_busy_interval():
    r = BusyRate()
    assert r.rate is None
    r.sample(0.0, 0, busy=False)
    r.sample(1.0, 0, busy=False)
    r.sample(2.0, 0, busy=False)
    assert r.rate is None  # a quiet pool tells nothing about how fast a queue drains


def test_idle_time_does_not_dilute_the_first_burst():
    # A minute of idle samples, then a burst draining 4 grants per second: the first busy
    # interval must read 4/s, not 4/s blended with 60 s of zeros (the c08 CI failure).
    r = BusyRate(tau=10.0)
    for t in range(60):
        r.sample(float(t), 100, busy=False)
    r.sample(60.0, 102, busy=True)  # the burst began inside this interval: a first guess
    assert r.rate == pytest.approx(2.0)
    r.sample(61.0, 106, busy=True)  # a whole busy second: 4/s
    assert 2.0 < r.rate < 4.0 and r.rate == pytest.approx(2.0 + (1 - math.exp(-0.1)) * 2.0)


def test_busy_intervals_blend_with_the_time_constant():
    r = BusyRate(tau=10.0)
    r.sample(0.0, 0, busy=True)
    r.sample(1.0, 4, busy=True)
    r.sample(2.0, 4, busy=True)  # a busy second with no grant (long holds) does count
    assert r.rate == pytest.approx(4.0 + (1 - math.exp(-0.1)) * (0.0 - 4.0))


def test_an_interval_busy_at_its_start_counts_and_idle_ones_keep_the_last_rate():
    r = BusyRate()
    r.sample(0.0, 0, busy=False)
    r.sample(1.0, 0, busy=True)  # a burst began inside this interval, no grant yet: no guess
    assert r.rate is None
    r.sample(2.0, 3, busy=True)
    assert r.rate == pytest.approx(3.0)
    r.sample(3.0, 3, busy=False)  # began busy: counts, even with no grant in it
    r.sample(4.0, 3, busy=True)  # began idle: left out once a rate exists
    kept = r.rate
    assert kept == pytest.approx(3.0 * math.exp(-0.1))
    r.sample(5.0, 9, busy=True)
    assert r.rate > kept
    r.sample(6.0, 12, busy=False)  # drained inside this one: it began busy, so it counts
    kept = r.rate
    r.sample(30.0, 12, busy=False)
    assert r.rate == kept  # idle: the last busy rate is the best guess for the next burst


def test_counter_reset_restarts_sampling():
    r = BusyRate()
    r.sample(0.0, 50, busy=True)
    r.sample(1.0, 52, busy=True)
    assert r.rate == pytest.approx(2.0)
    r.sample(2.0, 0, busy=True)  # Redis restarted empty: the counter went back
    assert r.rate == pytest.approx(2.0)
    r.sample(3.0, 2, busy=True)
    assert r.rate < 2.0 + 1e-9 and r.rate > 0
