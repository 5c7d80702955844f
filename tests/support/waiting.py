"""Poll a condition until it holds: the one wait of the tests (sync and async)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable


def wait_until(
    pred: Callable[[], Any],
    timeout: float = 5.0,
    what: str = "the condition",
    *,
    interval: float = 0.005,
) -> Any:
    """Call ``pred`` every ``interval`` seconds until it returns a truthy value; return that
    value. ``pred`` is called once more after ``timeout`` seconds have passed, then
    AssertionError is raised naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def async_wait_until(
    pred: Callable[[], Any],
    timeout: float = 5.0,
    what: str = "the condition",
    *,
    interval: float = 0.005,
) -> Any:
    """:func:`wait_until` for a coroutine: the event loop runs between the calls of ``pred``
    (which is a plain function)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)
