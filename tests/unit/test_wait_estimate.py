"""gpulock.estimates.wait: the wait rule's properties (never negative, None without a rate,
monotone in the bytes ahead, the amount, the position and the free bytes), its two terms, the
tail helper, and the rate's wire form."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulock.errors import InvalidArgument
from gpulock.estimates import DrainRate, wait_seconds, wait_seconds_at_tail

sizes = st.integers(min_value=0, max_value=2**50)
amounts = st.integers(min_value=1, max_value=2**50)
positions = st.integers(min_value=1, max_value=100_000)
frees = st.integers(min_value=-(2**40), max_value=2**50)
rates = st.builds(
    DrainRate,
    bytes_per_s=st.floats(min_value=1e-3, max_value=1e15),
    grants_per_s=st.floats(min_value=1e-6, max_value=1e6),
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


@given(sizes, amounts, frees, positions, rates)
def test_tail_is_the_next_position_behind_every_queued_byte(
    queued: int, amount: int, free: int, qlen: int, r: DrainRate
) -> None:
    tail = wait_seconds_at_tail(
        queued_bytes=queued, queue_length=qlen, amount=amount, free_bytes=free, rate=r
    )
    assert tail == est(queued, amount, free, qlen + 1, r)


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


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "1"])
def test_rate_must_be_positive_and_finite(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        DrainRate(bytes_per_s=bad, grants_per_s=1.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        DrainRate(bytes_per_s=1.0, grants_per_s=bad)  # type: ignore[arg-type]


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
