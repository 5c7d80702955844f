"""gpulock_common.driver: ``drive`` and ``adrive`` carry out a step machine: each step's result
sent back, its error thrown in (mapped by ``into``, filtered by ``catch``), the generator's
return value returned, the generator closed on the way out; ``adrive`` also on cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import pytest

from gpulock_common.driver import adrive, drive


class Boom(Exception):
    pass


class Mapped(Exception):
    pass


def _adder(n: int) -> Generator[int, Any, int]:
    """Yields 1..n, returns the sum of what it was sent back."""
    total = 0
    for i in range(1, n + 1):
        total += yield i
    return total


def _retrying(log: list[str]) -> Generator[str, Any, str]:
    """Tries "call" until it answers; an error is handled (logged, tried again)."""
    while True:
        try:
            return (yield "call")
        except Boom as e:
            log.append(f"handled {e}")


def _no_handler(log: list[str]) -> Generator[str, Any, str]:
    try:
        yield "call"
        return "unreachable"
    finally:
        log.append("closed")


def _double(step: int) -> int:
    return step * 2


async def _adouble(step: int) -> int:
    await asyncio.sleep(0)
    return step * 2


# ---- drive ----------------------------------------------------------------------------------
def test_returns_the_generators_value_and_sends_each_result_back():
    seen: list[int] = []

    def do_step(step: int) -> int:
        seen.append(step)
        return step * 2

    assert drive(_adder(3), do_step) == 2 + 4 + 6
    assert seen == [1, 2, 3]
    assert drive(_adder(0), _double) == 0  # no step at all


def test_a_steps_error_is_thrown_in_and_the_generator_handles_it():
    log: list[str] = []
    answers = iter([Boom("one"), Boom("two"), "ok"])

    def do_step(step: str) -> str:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert drive(_retrying(log), do_step) == "ok"
    assert log == ["handled one", "handled two"]


def test_an_error_the_generator_does_not_handle_propagates_and_it_is_closed():
    log: list[str] = []

    def do_step(step: str) -> str:
        raise Boom("no")

    with pytest.raises(Boom, match="no"):
        drive(_no_handler(log), do_step)
    assert log == ["closed"]


def test_the_generators_own_error_propagates():
    def failing() -> Generator[int, Any, None]:
        yield 1
        raise Mapped("from the flow")

    with pytest.raises(Mapped, match="from the flow"):
        drive(failing(), _double)


def test_into_maps_what_goes_in_and_none_lets_it_propagate_as_raised():
    got: list[BaseException] = []

    def catcher() -> Generator[str, Any, str]:
        try:
            yield "call"
        except Mapped as e:
            got.append(e)
        return "handled"

    def do_step(step: str) -> str:
        raise Boom("raw")

    assert drive(catcher(), do_step, into=lambda e: Mapped(str(e))) == "handled"
    assert [str(e) for e in got] == ["raw"]

    log: list[str] = []
    with pytest.raises(Boom, match="raw"):  # the original, not thrown in
        drive(_no_handler(log), do_step, into=lambda e: None)
    assert log == ["closed"]


def test_catch_limits_what_is_thrown_in():
    log: list[str] = []

    def interrupted(step: str) -> str:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # not an Exception: not for the step machine
        drive(_retrying(log), interrupted, catch=Exception)
    assert log == []

    def failed(step: str) -> str:
        raise Boom("x")

    with pytest.raises(Boom):  # catch=(): nothing is thrown in (the SDK's shells)
        drive(_retrying(log), failed, catch=())
    assert log == []


# ---- adrive ---------------------------------------------------------------------------------
async def test_adrive_returns_the_value_and_sends_each_result_back():
    assert await adrive(_adder(3), _adouble) == 12


async def test_adrive_throws_a_steps_error_in_and_it_can_be_handled_or_propagate():
    log: list[str] = []
    answers = iter([Boom("one"), "ok"])

    async def do_step(step: str) -> str:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert await adrive(_retrying(log), do_step) == "ok"
    assert log == ["handled one"]

    async def failed(step: str) -> str:
        raise Boom("no")

    with pytest.raises(Boom):
        await adrive(_no_handler(log), failed)
    assert log == ["handled one", "closed"]

    with pytest.raises(Boom):  # into None: propagated as raised
        await adrive(_retrying(log), failed, into=lambda e: None)
    assert log == ["handled one", "closed"]


def _withdrawing(log: list[str]) -> Generator[str, Any, str]:
    """Waits; cancelled while waiting, it withdraws (another step) and re-raises."""
    try:
        return (yield "wait")
    except asyncio.CancelledError:
        log.append("cancelled")
        yield "withdraw"
        raise
    finally:
        log.append("closed")


async def test_a_cancellation_goes_into_the_generator_which_withdraws_and_re_raises():
    log: list[str] = []
    started = asyncio.Event()

    async def do_step(step: str) -> None:
        log.append(step)
        if step == "wait":
            started.set()
            await asyncio.sleep(3600)

    task = asyncio.ensure_future(adrive(_withdrawing(log), do_step))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["wait", "cancelled", "withdraw", "closed"]


async def test_with_catch_exception_a_cancellation_propagates_and_the_generator_is_closed():
    log: list[str] = []
    started = asyncio.Event()

    async def do_step(step: str) -> None:
        log.append(step)
        started.set()
        await asyncio.sleep(3600)

    task = asyncio.ensure_future(adrive(_withdrawing(log), do_step, catch=Exception))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["wait", "closed"]  # never thrown in: no withdraw step
