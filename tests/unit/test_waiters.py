"""A waiter's future (gpulock.runtime.waiters.WaiterFuture): its watchers run inside the call that
completes it, not a loop iteration later; no Redis."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from gpulock.runtime.waiters import WaiterFuture


async def test_watchers_run_inside_the_call_that_completes_the_future():
    f = WaiterFuture(loop=asyncio.get_running_loop())
    seen: list[object] = []
    f.watch(lambda fut: seen.append(("a", fut.result())))
    f.watch(lambda fut: seen.append(("b", fut.result())))
    f.set_result("grant")
    assert seen == [("a", "grant"), ("b", "grant")]  # before any loop iteration
    f.watch(lambda fut: seen.append(("late", fut.result())))  # already done: called at once
    assert seen[-1] == ("late", "grant")
    assert await f == "grant"  # still an asyncio future


async def test_watchers_see_an_exception_and_a_cancellation():
    loop = asyncio.get_running_loop()
    failed, cancelled = WaiterFuture(loop=loop), WaiterFuture(loop=loop)
    seen: list[str] = []
    failed.watch(lambda fut: seen.append(type(fut.exception()).__name__))
    cancelled.watch(lambda fut: seen.append("cancelled" if fut.cancelled() else "?"))
    failed.set_exception(ValueError("no"))
    assert cancelled.cancel()
    assert not cancelled.cancel()  # a second cancel is refused and tells nobody
    assert seen == ["ValueError", "cancelled"]


async def test_a_raising_watcher_is_logged_and_the_others_still_run(caplog):
    f = WaiterFuture(loop=asyncio.get_running_loop())
    seen: list[int] = []

    def bad(_fut: WaiterFuture) -> None:
        raise RuntimeError("watcher bug")

    f.watch(bad)
    f.watch(lambda fut: seen.append(1))
    with caplog.at_level(logging.ERROR, logger="gpulock"):
        f.set_result(None)
    assert seen == [1]
    assert "watcher raised" in caplog.text


async def test_an_exception_nobody_waits_for_is_not_logged_as_never_retrieved():
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    gc.collect()  # what earlier tests in this process left (unclosed clients) is not ours
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    error = RuntimeError("the pool closed")
    try:
        f = WaiterFuture(loop=loop)
        f.set_exception(error)
        del f
        gc.collect()
    finally:
        loop.set_exception_handler(old)
    assert not [ctx for ctx in reported if ctx.get("exception") is error], reported


@pytest.mark.parametrize("how", ["result", "exception"])
async def test_completing_twice_still_raises(how):
    f = WaiterFuture(loop=asyncio.get_running_loop())
    f.set_result(1)
    with pytest.raises(asyncio.InvalidStateError):
        if how == "result":
            f.set_result(2)
        else:
            f.set_exception(RuntimeError())
