"""The wait estimate where grants pass waiters, against a real server (docs/SEMANTICS.md,
"Wait estimate"): the bytes ahead of a waiter leave out the waiters it passes under backfill
(while the head's window is open) and those of other tenants at their quota, the same in
acquire's reply and status's listing (lib.lua ahead_of, the one place they are counted); and
the drain rate's out-of-order share counts the queued grants that passed an earlier arrival.

No timing bound: every check is on state the server replies (waits poll it, 60 s bounds)."""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import pytest
from gpulock_common.options import AcquireOptions

from gpulock.protocol.replies import NotGranted
from gpulock.runtime.remote import RemoteHolders

pytestmark = pytest.mark.timeout(300)


async def _until(pred: Callable[[], Awaitable[bool]], what: str, timeout: float = 60) -> None:
    """Poll the coroutine ``pred`` until it is true; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not await pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def _all_waited(pool, seconds: float) -> Callable[[], Awaitable[bool]]:
    """Whether every listed waiter of ``pool`` has waited ``seconds`` (server clock)."""

    async def pred() -> bool:
        st = await pool.status()
        return bool(st.waiters) and all(w.waited >= seconds for w in st.waiters)

    return pred


async def _enqueue(rh: RemoteHolders, amount: int, rid: str, **kw) -> NotGranted:
    res = await rh.enqueue(amount, AcquireOptions(request_id=rid, **kw))
    assert isinstance(res, NotGranted) and res.queued, res
    return res


async def test_backfill_counts_only_the_waiters_it_cannot_pass(make_apool):
    pool = make_apool(capacity=1000)
    await pool.configure(1000, policy="backfill", backfill_window=600)
    holder = await pool.acquire(600)  # 400 free: none of the waiters below fits
    rh = RemoteHolders(pool)
    big = await _enqueue(rh, 800, "big")
    small = await _enqueue(rh, 500, "small")  # passes the 800 when 500 are free
    bigger = await _enqueue(rh, 900, "bigger")  # passes neither
    assert (big.ahead_bytes, small.ahead_bytes, bigger.ahead_bytes) == (0, 0, 1300)
    probe = await rh.enqueue(500, AcquireOptions(request_id="probe"), queue=False)
    assert isinstance(probe, NotGranted) and not probe.queued
    assert probe.ahead_bytes == 500  # at the tail: only the waiter of 500 is ahead of it
    st = await pool.status()
    assert [w.ahead_bytes for w in st.waiters] == [0, 0, 1300]  # status counts them alike
    for rid in ("big", "small", "bigger"):
        await rh.cancel(rid)
    await holder.release()


async def test_backfill_window_closed_counts_every_waiter(make_apool):
    pool = make_apool(capacity=1000)
    await pool.configure(1000, policy="backfill", backfill_window=0.2)
    holder = await pool.acquire(600)
    rh = RemoteHolders(pool)
    await _enqueue(rh, 800, "big")

    await _until(_all_waited(pool, 0.3), "the head's backfill window to close")
    small = await _enqueue(rh, 500, "small")  # nothing passes the head now
    assert small.ahead_bytes == 800
    st = await pool.status()
    assert [w.ahead_bytes for w in st.waiters] == [0, 800]
    for rid in ("big", "small"):
        await rh.cancel(rid)
    await holder.release()


async def test_a_tenant_at_its_quota_is_not_ahead_of_the_others(make_apool):
    pool = make_apool(capacity=1000)
    await pool.configure(1000, quotas={"a": 500})
    held_a = await pool.acquire(500, tenant="a")  # a at its quota
    held_b = await pool.acquire(500, tenant="b")  # the pool full
    rh = RemoteHolders(pool)
    a1 = await _enqueue(rh, 300, "a1", tenant="a")
    b1 = await _enqueue(rh, 300, "b1", tenant="b")  # a's waiter is not ahead of it
    a2 = await _enqueue(rh, 200, "a2", tenant="a")  # its own tenant's waiter is
    none = await _enqueue(rh, 100, "n1")  # no tenant: a's waiters are not ahead of it
    assert (a1.ahead_bytes, b1.ahead_bytes, a2.ahead_bytes, none.ahead_bytes) == (0, 0, 600, 300)
    st = await pool.status()
    assert [w.ahead_bytes for w in st.waiters] == [0, 0, 600, 300]
    for rid in ("a1", "b1", "a2", "n1"):
        await rh.cancel(rid)
    await held_a.release()
    await held_b.release()


async def test_out_of_order_share_counts_a_waiter_passed_by_priority(make_apool):
    pool = make_apool(capacity=1000)
    holder = await pool.acquire(1000)
    rh = RemoteHolders(pool)
    await _enqueue(rh, 1000, "low")
    # so that the next one arrives at a later server ms
    await _until(_all_waited(pool, 0.01), "the server clock to pass the first arrival")
    high = await _enqueue(rh, 1000, "high", priority=5)
    assert high.position == 1
    # the rate is reported after 200 ms of busy time
    await _until(_all_waited(pool, 0.25), "250 ms of queue")
    await holder.release()  # hands off to "high", which passes "low"
    grant = await rh.wait("high", 60)
    assert grant is not None
    drain = (await pool.status()).drain
    assert drain is not None
    assert drain.out_of_order == 1.0  # its one queued grant passed "low"
    assert drain.stretch == pytest.approx(1.5)  # capped: MAX_OUT_OF_ORDER
    low = await _enqueue(rh, 1000, "low")  # still queued (refreshed), now at the head
    assert low.position == 1 and low.drain == drain
    await rh.cancel("low")
    await rh.cancel("high")


async def test_fifo_grants_in_order_have_no_out_of_order_share(make_apool):
    pool = make_apool(capacity=1000)
    holder = await pool.acquire(1000)
    rh = RemoteHolders(pool)
    for k in range(3):
        await _enqueue(rh, 1000, f"w{k}")
    await _until(_all_waited(pool, 0.25), "250 ms of queue")
    await holder.release()
    for k in range(3):
        assert await rh.wait(f"w{k}", 60) is not None
        await rh.cancel(f"w{k}")  # releases its grant: the next one is handed it
    drain = (await pool.status()).drain
    assert drain is not None and drain.out_of_order == 0 and drain.stretch == 1.0


@pytest.mark.parametrize("policy", ["fifo", "backfill"])
async def test_status_counts_as_acquire_did_near_the_head_and_beyond(make_apool, policy):
    """Status's listed waiters get the bytes ahead acquire replied to each when it queued
    (lib.lua ahead_of, one walk): exact for the first 33 places, then extrapolated alike."""
    pool = make_apool(capacity=10_000)
    await pool.configure(10_000, policy=policy, backfill_window=600)
    holder = await pool.acquire(10_000)
    rh = RemoteHolders(pool)
    amounts = [(k * 37) % 50 + 1 for k in range(40)]  # sizes in no order, some repeated
    replied = [(await _enqueue(rh, a, f"r{k}")).ahead_bytes for k, a in enumerate(amounts)]
    if policy == "fifo":
        assert replied[:33] == [sum(amounts[:k]) for k in range(33)]
    else:
        want = [sum(x for x in amounts[:k] if x <= a) for k, a in enumerate(amounts[:33])]
        assert replied[:33] == want
    st = await pool.status()
    assert [w.ahead_bytes for w in st.waiters] == replied
    for k in range(len(amounts)):
        await rh.cancel(f"r{k}")
    await holder.release()
