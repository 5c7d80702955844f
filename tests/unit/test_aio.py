"""gpulock_common.aio: a cancellation is never lost. ``wait_for`` raises CancelledError when the
caller is cancelled in the loop iteration the awaited future completes in (Python 3.11's own
``asyncio.wait_for`` returns the result then: shown below, so the case is really the one that
goes wrong); ``stop_tasks`` ends a task that lost its first cancellation."""

from __future__ import annotations

import asyncio
import sys

import pytest
from gpulock_common.aio import pending_cancels, stop_tasks, wait_for

pytestmark = pytest.mark.timeout(30)


async def _cancel_as_it_completes(waiter) -> asyncio.Task:
    """A task awaiting ``waiter(fut)`` whose future completes in the very iteration the task
    is cancelled; returns the finished task."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    t = asyncio.ensure_future(waiter(fut))
    while not fut._callbacks:  # observed: the task (or wait_for's inner one) waits on it
        await asyncio.sleep(0)
    fut.set_result("granted")
    t.cancel()
    await asyncio.wait({t})
    return t


async def test_wait_for_keeps_a_cancellation_that_lands_as_the_result_does():
    t = await _cancel_as_it_completes(lambda f: wait_for(f, 10))
    assert t.cancelled()


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="fixed in Python 3.12")
async def test_asyncio_wait_for_loses_it_before_312():
    t = await _cancel_as_it_completes(lambda f: asyncio.wait_for(f, 10))
    assert not t.cancelled() and t.result() == "granted"


async def test_wait_for_passes_results_errors_and_times_out():
    async def value() -> int:
        await asyncio.sleep(0)
        return 7

    async def boom() -> None:
        raise KeyError("x")

    assert await wait_for(value(), 5) == 7
    assert await wait_for(value(), None) == 7
    with pytest.raises(KeyError):
        await wait_for(boom(), 5)
    ev = asyncio.Event()
    with pytest.raises(asyncio.TimeoutError):
        await wait_for(ev.wait(), 0.01)
    assert pending_cancels() == 0  # the timeout's own cancellation was taken back


def _swallower(state: dict):
    """A loop that loses its first cancellation (as a Redis call can), then honours the next."""

    async def run() -> None:
        try:
            state["running"] = True
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            state["swallowed"] = True  # lost: the loop goes on
        while True:
            await asyncio.sleep(0.01)

    return run()


async def test_stop_tasks_ends_a_task_that_lost_its_cancellation():
    state: dict = {}
    t = asyncio.ensure_future(_swallower(state))
    while not state.get("running"):
        await asyncio.sleep(0)
    t.cancel()
    done, _ = await asyncio.wait({t}, timeout=0.2)
    assert not done and state.get("swallowed"), "one cancel does not end it"
    await asyncio.wait_for(stop_tasks([t], resend_s=0.05), 10)
    assert t.cancelled()


async def test_stop_tasks_retrieves_errors_and_propagates_its_own_cancellation():
    async def fails() -> None:
        raise RuntimeError("x")

    f = asyncio.ensure_future(fails())
    await asyncio.sleep(0)
    await stop_tasks([f])  # its error is retrieved, not raised
    state: dict = {}
    slow = asyncio.ensure_future(_swallower(state))
    while not state.get("running"):
        await asyncio.sleep(0)
    stopper = asyncio.ensure_future(stop_tasks([slow], resend_s=5))
    while not state.get("swallowed"):
        await asyncio.sleep(0)
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    await stop_tasks([slow], resend_s=0.05)
