"""The Retry-After policy (gpulock.retry_after): whole seconds in [1, cap], at least the grace
left, at most half a kept place; the broker's estimate, else the script's time to expiry."""

import math

from gpulock import retry_after as ra


def test_clamp_rounds_up_to_whole_seconds_within_one_and_the_cap():
    assert [ra.clamp(s, 5) for s in (0.0, 0.2, 1.0, 1.01, 4.5, 5.0, 99.0)] == [1, 1, 1, 2, 5, 5, 5]


def test_the_brokers_hint_without_an_estimate_is_the_old_rule():
    # the broker's formula before it read the server's estimate: 1 when no lease, else
    # ceil(ms / 1000), then clamped to [1, cap]; it stays the answer while no rate is measured
    def old(ms: int, cap: int) -> int:
        r = 1 if ms < 0 else math.ceil(ms / 1000)
        return int(min(max(r, 1), cap))

    for cap in (1, 5, 120):
        for ms in (-1, 0, 1, 999, 1000, 1001, 4999, 5000, 5001, 60_000, 10**9):
            got = ra.retry_after(ra.estimate_or_hint(None, ms / 1000), cap=cap)
            assert got == old(ms, cap), (ms, cap)
    assert ra.estimate_or_hint(None, None) == 0.0


def test_the_estimate_wins_over_the_hint():
    assert ra.estimate_or_hint(2.5, 30.0) == 2.5
    assert ra.estimate_or_hint(0.0, 30.0) == 0.0  # a measured "now" is no missing estimate
    assert ra.estimate_or_hint(-0.1, None) == 0.0
    assert ra.retry_after(ra.estimate_or_hint(2.5, 30.0), cap=5) == 3


def test_grace_and_kept_place():
    assert ra.retry_after(2.0, cap=120, grace_left=30.2) == 31  # at least the grace left
    assert ra.retry_after(200.0, cap=120, grace_left=30.2) == 120  # capped
    assert ra.retry_after(40.0, cap=120, keep_place=30) == 15  # half the kept place
    assert ra.retry_after(40.0, cap=120, grace_left=20.0, keep_place=30) == 20  # grace wins


def test_queue_seconds_and_grant_rate():
    assert ra.queue_seconds(8, 4.0) == 2.0
    assert ra.queue_seconds(4, 4.0, local=3, local_rate=1.0) == 4.0
    assert ra.queue_seconds(4, 4.0, local=2) == 1.5  # no local rate: the pool's
    assert ra.queue_seconds(3, None) == 3.0  # one second per place
    assert ra.queue_seconds(3, None, server_hint=1.2) == 1.2
    assert ra.grant_rate(4.0, leases=0, resident=0, mean_hold=None) == 4.0
    assert ra.grant_rate(0.0, leases=4, resident=0, mean_hold=2.0) == 2.0  # Little's law
    assert ra.grant_rate(None, leases=3, resident=3, mean_hold=2.0) == 0.5  # at least one
    assert ra.grant_rate(None, leases=0, resident=0, mean_hold=2.0) is None


def test_queue_seconds_takes_the_servers_estimate_for_the_pools_part():
    # the pool's part is the server's estimate when given, whatever the position and rate
    assert ra.queue_seconds(7, 2.0, pool_wait=1.25) == 1.25
    assert ra.queue_seconds(7, None, pool_wait=1.25, server_hint=0.1) == 1.25
    # the local part as before: the worker's own rate, else the pool's, else one s a place
    assert ra.queue_seconds(3, 2.0, local=2, local_rate=4.0, pool_wait=1.0) == 1.5
    assert ra.queue_seconds(3, 2.0, local=2, local_rate=0.0, pool_wait=1.0) == 2.0
    assert ra.queue_seconds(3, None, local=2, pool_wait=1.0) == 3.0
    assert ra.queue_seconds(3, None, pool_wait=-0.5) == 0.0  # never below 0
    # without it: unchanged
    assert ra.queue_seconds(4, 2.0) == 2.0 and ra.queue_seconds(4, None) == 4.0
