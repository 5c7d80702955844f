"""gpulock.estimates.wait: the wait rule's properties (never negative, None without a rate,
monotone in the bytes ahead, the amount, the position, the count ahead, the out-of-order share
and the free bytes), its two terms, the stretch, the tail helper, and the rate's wire form."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulock.errors import InvalidArgument
from gpulock.estimates import DrainRate, wait_seconds, wait_seconds_at_tail
from gpulock.estimates.wait import MAX_OUT_OF_ORDER

sizes = st.integers(min_value=0, max_value=2**50)
amounts = st.integers(min_value=1, max_value=2**50)
positions = st.integers(min_value=1, max_value=100_000)
frees = st.integers(min_value=-(2**40), max_value=2**50)
shares = st.floats(min_value=0, max_value=1)
rates = st.builds(
    DrainRate,
    bytes_per_s=st.floats(min_value=1e-3, max_value=1e15),
    grants_per_s=st.floats(min_value=1e-6, max_value=1e6),
    out_of_order=shares,
)


def est(ahead: int, amount: int, free: int, pos: int, rate: DrainRate | None) -> float | None:
    return wait_seconds(ahead_bytes=ahead, amount=amount, free_bytes=free, position=pos, rate=rate)


@given(sizes, amounts, frees, positions)
def test_none_without_a_rate(ahead: int, amount: int, free: int, pos: int) -> None:
    assert est(ahead, amount, free, pos, None) is None


@given(sizes, amounts, frees, positions, rates)
def test_non_negative_and_finite(
    ahead: int, amount: int, free: int, pos: int, r: DrainRate
) -> None:
    s = est(ahead, amount, free, pos, r)
    assert s is not None and 0 <= s < float("inf")


@given(sizes, sizes, amounts, frees, positions, rates)
def test_monotone_in_ahead_bytes(
    a: int, extra: int, amount: int, free: int, pos: int, r: DrainRate
) -> None:
    assert est(a, amount, free, pos, r) <= est(a + extra, amount, free, pos, r)  # type: ignore[operator]


@given(sizes, amounts, sizes, frees, positions, rates)
def test_monotone_in_amount(
    ahead: int, amount: int, extra: int, free: int, pos: int, r: DrainRate
) -> None:
    assert est(ahead, amount, free, pos, r) <= est(ahead, amount + extra, free, pos, r)  # type: ignore[operator]


@given(sizes, amounts, frees, positions, positions, rates)
def test_monotone_in_position(
    ahead: int, amount: int, free: int, pos: int, extra: int, r: DrainRate
) -> None:
    assert est(ahead, amount, free, pos, r) <= est(ahead, amount, free, pos + extra, r)  # type: ignore[operator]


@given(sizes, amounts, frees, sizes, positions, rates)
def test_more_free_bytes_never_wait_longer(
    ahead: int, amount: int, free: int, extra: int, pos: int, r: DrainRate
) -> None:
    assert est(ahead, amount, free + extra, pos, r) <= est(ahead, amount, free, pos, r)  # type: ignore[operator]


@given(sizes, amounts, frees, positions, st.data(), rates)
def test_monotone_in_the_count_ahead(
    ahead: int, amount: int, free: int, pos: int, data: st.DataObject, r: DrainRate
) -> None:
    lo = data.draw(st.integers(min_value=0, max_value=pos - 1))
    hi = data.draw(st.integers(min_value=lo, max_value=pos - 1))

    def at(n: int) -> float | None:
        return wait_seconds(
            ahead_bytes=ahead, amount=amount, free_bytes=free, position=pos, rate=r, ahead_count=n
        )

    assert at(lo) <= at(hi)  # type: ignore[operator]
    assert at(pos - 1) == est(ahead, amount, free, pos, r)  # every one before it: the position


@given(sizes, amounts, frees, positions, rates, shares, shares)
def test_monotone_in_the_out_of_order_share(
    ahead: int, amount: int, free: int, pos: int, r: DrainRate, s1: float, s2: float
) -> None:
    lo, hi = sorted((s1, s2))
    a = DrainRate(r.bytes_per_s, r.grants_per_s, out_of_order=lo)
    b = DrainRate(r.bytes_per_s, r.grants_per_s, out_of_order=hi)
    assert est(ahead, amount, free, pos, a) <= est(ahead, amount, free, pos, b)  # type: ignore[operator]
    assert 1.0 <= a.stretch <= b.stretch <= 1.0 / (1.0 - MAX_OUT_OF_ORDER)
    in_order = DrainRate(r.bytes_per_s, r.grants_per_s)
    assert est(ahead, amount, free, pos, b) == pytest.approx(
        est(ahead, amount, free, pos, in_order) * b.stretch  # type: ignore[operator]
    )


def test_the_stretch() -> None:
    assert DrainRate(1.0, 1.0).stretch == 1.0
    assert DrainRate(1.0, 1.0, out_of_order=0.2).stretch == pytest.approx(1.25)
    assert DrainRate(1.0, 1.0, out_of_order=0.9).stretch == pytest.approx(1.5)  # capped
    r = DrainRate(bytes_per_s=100.0, grants_per_s=2.0, out_of_order=0.2)
    # only the waiter itself is ahead of it (it passes the two before it): 1 place at 2/s
    assert wait_seconds(
        ahead_bytes=0, amount=10, free_bytes=100, position=3, rate=r, ahead_count=0
    ) == pytest.approx(0.5 * 1.25)
    tail = wait_seconds_at_tail(
        queued_bytes=100, queue_length=5, amount=100, free_bytes=0, rate=r, ahead_count=1
    )
    assert tail == pytest.approx(2.0 * 1.25)  # max(200 / 100, 2 / 2)


@given(sizes, amounts, frees, positions, rates)
def test_tail_is_the_next_position_behind_every_queued_byte(
    queued: int, amount: int, free: int, qlen: int, r: DrainRate
) -> None:
    tail = wait_seconds_at_tail(
        queued_bytes=queued, queue_length=qlen, amount=amount, free_bytes=free, rate=r
    )
    assert tail == est(queued, amount, free, qlen + 1, r)


@given(sizes, amounts, frees, positions, rates, st.floats(min_value=0, max_value=1e6))
def test_the_grace_period_comes_first(
    ahead: int, amount: int, free: int, pos: int, r: DrainRate, grace: float
) -> None:
    s = wait_seconds(
        ahead_bytes=ahead, amount=amount, free_bytes=free, position=pos, rate=r, grace_left=grace
    )
    base = est(ahead, amount, free, pos, r)
    assert s is not None and base is not None and s == pytest.approx(base + grace)


def test_the_two_terms() -> None:
    r = DrainRate(bytes_per_s=100.0, grants_per_s=2.0)
    # bytes: 300 ahead + 100 own - 50 free = 350 bytes at 100 B/s; grants: 3 places at 2/s
    assert est(300, 100, 50, 3, r) == pytest.approx(3.5)
    # it would fit now but waits (pinned device, quota, grace): 3 grants at 2/s
    assert est(0, 100, 1000, 3, r) == pytest.approx(1.5)
    # position below 1 counts as 1
    assert est(0, 1, 10, 0, r) == pytest.approx(0.5)
    # the tail of an empty queue is position 1
    tail = wait_seconds_at_tail(queued_bytes=0, queue_length=0, amount=1000, free_bytes=0, rate=r)
    assert tail == pytest.approx(10.0)
    assert (
        wait_seconds_at_tail(queued_bytes=0, queue_length=0, amount=1, free_bytes=0, rate=None)
        is None
    )


def test_wire_form() -> None:
    assert DrainRate.from_wire(0, 0) is None
    assert DrainRate.from_wire(5, 0) is None
    assert DrainRate.from_wire(0, 5) is None
    assert DrainRate.from_wire(-1, 5) is None
    assert DrainRate.from_wire(2048, 1500) == DrainRate(bytes_per_s=2048.0, grants_per_s=1.5)
    assert DrainRate.from_wire(2048, 1500, 250).out_of_order == 0.25  # type: ignore[union-attr]
    assert DrainRate.from_wire(2048, 1500, 5000).out_of_order == 1.0  # type: ignore[union-attr]
    assert DrainRate.from_wire(2048, 1500, -3).out_of_order == 0.0  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1"])
def test_rate_must_be_positive_and_finite(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        DrainRate(bytes_per_s=bad, grants_per_s=1.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        DrainRate(bytes_per_s=1.0, grants_per_s=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0"])
def test_out_of_order_share_is_a_share(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        DrainRate(bytes_per_s=1.0, grants_per_s=1.0, out_of_order=bad)  # type: ignore[arg-type]


def test_queue_place_is_the_position() -> None:
    import pickle

    from gpulock_common.queue import QueuePlace

    p = QueuePlace(3, estimated_wait=1.5, queue_length=7)
    assert p == 3 and isinstance(p, int) and p + 1 == 4 and f"{p}" == "3"
    assert (p.position, p.estimated_wait, p.queue_length) == (3, 1.5, 7)
    assert type(p.position) is int
    q = pickle.loads(pickle.dumps(p))
    assert (q, q.estimated_wait, q.queue_length) == (3, 1.5, 7)
    assert QueuePlace(2).estimated_wait is None and QueuePlace(2).queue_length is None
    with pytest.raises(AttributeError):
        p.foo = 1  # type: ignore[attr-defined]
    assert repr(p) == "QueuePlace(3, estimated_wait=1.5, queue_length=7)"


def test_decode_acquire_carries_the_estimate() -> None:
    from gpulock.protocol import replies

    rate = DrainRate(bytes_per_s=100.0, grants_per_s=2.0)
    # queued at 3: 300 bytes ahead, 100 of its own, 4096 - 4046 used - 0 held back = 50 free
    q = replies.decode_acquire(
        "t", [0, 3, 250, 5, 4000, 9, 4096, 4046, 0, 0, 0, 300, 100, 100, 2000]
    )
    assert isinstance(q, replies.NotGranted) and q.queued
    assert (q.ahead_bytes, q.drain) == (300, rate)
    assert q.estimated_wait == pytest.approx(3.5)
    assert q.place == 3 and q.place.estimated_wait == q.estimated_wait and q.place.queue_length == 5
    g = replies.decode_acquire(
        "t", [0, 3, 250, 5, 4000, 9, 4096, 4046, 0, 1500, 0, 300, 100, 100, 2000]
    )
    assert isinstance(g, replies.NotGranted) and g.estimated_wait == pytest.approx(5.0)
    # not queued (try): every queued byte ahead, at the tail (position 6)
    n = replies.decode_acquire(
        "t", [2, 0, -1, 5, 4000, 9, 4096, 4096, 0, 0, 0, 500, 100, 100, 2000]
    )
    assert isinstance(n, replies.NotGranted) and not n.queued
    assert n.estimated_wait == pytest.approx(6.0)  # max(600 / 100, 6 / 2)
    # unmeasured (0, 0), and a reply of an older server: no estimate
    u = replies.decode_acquire("t", [0, 1, -1, 1, 4000, 9, 10, 10, 0, 0, 0, 0, 5, 0, 0])
    old = replies.decode_acquire("t", [0, 1, -1, 1, 4000, 9, 10, 10])
    assert isinstance(u, replies.NotGranted) and isinstance(old, replies.NotGranted)
    assert (u.drain, u.estimated_wait, old.drain, old.estimated_wait) == (None, None, None, None)
    # the script's count ahead and out-of-order share: 1 place of 3, stretched by 1.25
    c = replies.decode_acquire(
        "t", [0, 3, 250, 5, 4000, 9, 4096, 4046, 0, 0, 0, 0, 10, 100, 2000, 0, 200]
    )
    assert isinstance(c, replies.NotGranted) and c.drain is not None
    assert (c.drain.out_of_order, c.estimated_wait) == (0.2, pytest.approx(0.5 * 1.25))
    # code 3 keeps its resident bytes in place
    r = replies.decode_acquire("t", [3, 0, -1, 0, 4000, 9, 10, 2, 0, 0, 8, 0, 5, 100, 2000])
    assert isinstance(r, replies.NotGranted) and r.resident == 8


def test_decode_renew_carries_the_estimate() -> None:
    from gpulock.protocol import replies

    queue = [4096, 4046, 0, 7, 100, 2000]  # capacity, used, held_back, queue_len, rate
    rep = replies.decode_renew([9_000, 4, [], [[b"q", 3, 300, 100], [b"x"]], queue], ["a", "b"])
    graced = replies.decode_renew([9_000, 4, [], [[b"q", 3, 300, 100]], queue + [2_000]], ["a"])
    assert graced.waiters[0].estimated_wait == pytest.approx(5.5)  # 2 s of grace first
    q, gone = rep.waiters
    assert isinstance(q, replies.Queued) and gone is None
    assert (q.position, q.queue_length) == (3, 7)
    assert q.estimated_wait == pytest.approx(3.5)
    assert q.place == 3 and q.place.estimated_wait == q.estimated_wait
    # the script's count ahead (it passes both before it) and share: 1 place, stretched 1.25
    passing = replies.decode_renew([9_000, 4, [], [[b"q", 3, 0, 10, 0]], queue + [0, 200]], ["a"])
    assert passing.waiters[0].estimated_wait == pytest.approx(0.5 * 1.25)
    old = replies.decode_renew([9_000, 4, [], [[b"q", 2]]], ["a"])
    assert old.waiters == [replies.Queued(2)]


def test_decode_status_carries_the_estimates() -> None:
    from gpulock.protocol import replies

    now = 10_000
    # the script counts each waiter's bytes and waiters ahead (lib.lua ahead_of): 0 and 100
    w1 = [b"t1", 100, now, now + 1, b"", 0, b"", -1, b"", 0, 0, 0]
    w2 = [b"t2", 300, now, now + 1, b"", 0, b"", -1, b"", 0, 100, 1]
    waiters = [w1, w2]
    head = [1, now, 1000, 950, 1, 1, 10, 0, 2, 0, 0, 0, [], waiters]
    tail = [0, 0, 0, 0, 0, b"", b"fifo", 2000, [], [], b"bestfit", 0, 0]
    st = replies.decode_status("p", head + tail + [100, 2000])
    assert st is not None and st.drain == DrainRate(bytes_per_s=100.0, grants_per_s=2.0)
    assert [w.ahead_bytes for w in st.waiters] == [0, 100]
    # 50 free: max(50 / 100, 1 / 2) = 0.5; max(350 / 100, 2 / 2) = 3.5
    assert [w.estimated_wait for w in st.waiters] == [pytest.approx(0.5), pytest.approx(3.5)]
    # at the tail: 400 queued + 100 - 50 free = 450 bytes; 3 places
    assert st.estimated_wait_for(100) == pytest.approx(4.5)
    old = replies.decode_status("p", head + tail)
    assert old is not None and old.drain is None
    assert [w.estimated_wait for w in old.waiters] == [None, None]
    # the waiter the script counts nothing ahead of (it passes t1), and a share out of order
    w2[10:12] = [0, 0]
    st = replies.decode_status("p", head + tail + [100, 2000, 500])
    assert st is not None and st.drain is not None and st.drain.out_of_order == 0.5
    # 300 - 50 free = 250 bytes at 100 B/s, 1 place at 2/s; stretched by 1 / (1 - 1/3), the
    # share capped at MAX_OUT_OF_ORDER
    assert st.waiters[1].estimated_wait == pytest.approx(3.75)
