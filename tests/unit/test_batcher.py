"""The batcher's I/O-free parts: the closing decision, the room the pool would grant, the OOM
split plan and the split runner (with torch's OOM injected in a batch function, on CPU)."""

from __future__ import annotations

import pytest

from gpulock.protocol.replies import PoolStatus, WaiterInfo
from gpulock.errors import InvalidArgument
from gpulock.fastapi._batcher import (
    FULL,
    IDLE,
    JOIN,
    ROOM,
    TIMEOUT,
    WAIT,
    BatchPolicy,
    decide,
    room_now,
    run_with_splits,
    split_plan,
)
from gpulock.fastapi._errors import CudaOOM

P = BatchPolicy(max_size=4, max_wait_s=0.005)


def _d(**kw):
    base = {"size": 1, "waited_s": 0.0, "next_bytes": None, "room": None, "idle": False}
    return decide(P, **{**base, **kw})


def test_decide_closes_full_first():
    assert _d(size=4, next_bytes=1, room=100, idle=True) == FULL
    assert _d(size=3, next_bytes=1, room=100) == JOIN


def test_decide_room_closes_only_a_non_empty_batch():
    assert _d(size=2, next_bytes=101, room=100) == ROOM
    assert _d(size=2, next_bytes=100, room=100) == JOIN  # exactly fits
    assert _d(size=0, next_bytes=10**12, room=0) == JOIN  # a first request always joins
    assert _d(size=2, next_bytes=10**12, room=None) == JOIN  # no read yet: no bound


def test_decide_waits_until_the_wait_is_up_or_the_worker_is_idle():
    assert _d(size=0) == WAIT
    assert _d(size=2, waited_s=0.001) == WAIT
    assert _d(size=2, waited_s=0.005) == TIMEOUT
    assert _d(size=2, waited_s=0.001, idle=True) == IDLE
    # a waiting request joins before the wait or idleness closes the batch
    assert _d(size=2, waited_s=1.0, next_bytes=1, room=10, idle=True) == JOIN


def test_decide_keeps_growing_behind_a_batch_that_waits():
    assert _d(size=2, waited_s=1.0, ahead=True) == WAIT
    assert _d(size=2, next_bytes=1, room=10, ahead=True) == JOIN
    assert _d(size=4, ahead=True) == FULL
    assert _d(size=2, next_bytes=11, room=10, ahead=True) == ROOM


def _st(capacity, used, waiters=(), count=None):
    ws = [WaiterInfo(i + 1, f"w{i}", a, 0.0, 5.0, {}) for i, a in enumerate(waiters)]
    return PoolStatus(
        "p",
        capacity,
        used,
        1,
        0,
        0,
        0,
        len(ws) if count is None else count,
        0,
        0,
        0,
        [],
        ws,
    )


def test_room_now_is_free_less_the_queue_ahead():
    assert room_now(None) is None
    assert room_now(_st(100, 30)) == 70
    assert room_now(_st(100, 30, waiters=(20, 10))) == 40
    assert room_now(_st(100, 90, waiters=(50,))) == 0
    assert room_now(_st(100, 30, waiters=(1,), count=5)) == 0  # the queue is not all listed
    assert room_now(_st(100, 130)) == 0  # capacity lowered below what is leased


def test_split_plan_halves_and_is_bounded():
    assert split_plan(5, 0, 3) == [(0, 2), (2, 5)]
    assert split_plan(2, 0, 3) == [(0, 1), (1, 2)]
    assert split_plan(1, 0, 3) is None
    assert split_plan(8, 3, 3) is None
    assert BatchPolicy(32, 0.0).split_levels == 5
    assert BatchPolicy(1, 0.0).split_levels == 0
    assert BatchPolicy(32, 0.0, max_splits=1).split_levels == 1


@pytest.mark.parametrize(
    "kw", [{"max_size": 0}, {"max_size": 1.5}, {"max_wait_s": -1}, {"max_splits": -1}]
)
def test_policy_refuses_bad_values(kw):
    with pytest.raises(InvalidArgument):
        BatchPolicy(**{"max_size": 4, "max_wait_s": 0.0, **kw})


def _oom_if(bad):
    import torch

    calls: list[list] = []

    def fn(items):
        calls.append(list(items))
        if any(i in bad for i in items):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [i * 10 for i in items]

    return fn, calls


def test_one_oversized_request_fails_alone_and_the_others_keep_order():
    fn, calls = _oom_if({3})
    splits = []
    out = run_with_splits(fn, list(range(8)), levels=3, on_split=lambda: splits.append(1))
    assert [o for i, o in enumerate(out) if i != 3] == [0, 10, 20, 40, 50, 60, 70]
    assert isinstance(out[3], CudaOOM) and "out of memory" in str(out[3])
    # 8 → 4+4 → (2+2) → (1+1): three levels down to the request alone
    assert calls[0] == list(range(8)) and [3] in calls and len(splits) == 3
    assert len(calls) == 1 + 2 + 2 + 2


def test_split_levels_bound_the_retries():
    fn, calls = _oom_if({0})
    out = run_with_splits(fn, list(range(8)), levels=1)
    assert all(isinstance(o, CudaOOM) for o in out[:4]) and out[4:] == [40, 50, 60, 70]
    assert len(calls) == 3
    fn, calls = _oom_if({0})
    out = run_with_splits(fn, list(range(4)), levels=0)
    assert all(isinstance(o, CudaOOM) for o in out) and len(calls) == 1


def test_other_errors_and_wrong_lengths_fail_the_batch():
    def boom(items):
        raise ValueError("bad")

    with pytest.raises(ValueError):
        run_with_splits(boom, [1, 2], levels=2)
    with pytest.raises(TypeError, match="returned 1 results for 2"):
        run_with_splits(lambda items: [1], [1, 2], levels=2)


def test_a_split_stops_when_the_lease_is_lost():
    from gpulock.errors import LeaseLost

    fn, calls = _oom_if({1})

    def lost():
        raise LeaseLost("l1", "expired")

    with pytest.raises(LeaseLost):
        run_with_splits(fn, [0, 1], levels=2, on_split=lost)
    assert len(calls) == 1
