"""Asyncio helpers that never lose a cancellation.

Before Python 3.12, ``asyncio.wait_for`` returns the awaited result instead of raising
``CancelledError`` when the caller is cancelled in the loop iteration the awaited operation
completes in (CPython gh-86296; 3.12 rebuilt ``wait_for`` on ``asyncio.timeout``). redis-py's
asyncio client sends every command through ``wait_for`` when a socket timeout is set (redis-py
8 sets one by default, gpulock always does), so a task cancelled while a command is sent can run
on as if nothing happened: a background loop cancelled once keeps looping, and whoever awaits
it to stop waits forever (how often: docs/RELIABILITY.md, "Lost cancellations").

- :func:`wait_for`: ``asyncio.wait_for`` without that fault (``asyncio.timeout`` on 3.11).
- :func:`stop_tasks`: cancel tasks and wait until they ended, cancelling again a task that a
  library below let run on.
- :func:`pending_cancels`: the current task's cancellation requests (a caller can notice one
  that a library lost: it is still counted).
- :func:`logged`: await a user callback's awaitable, its exception logged, not raised.

No I/O; standard library only.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import sys
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

#: seconds :func:`stop_tasks` waits after a cancel before cancelling again (a task still
#: running then had its cancellation lost; one that honours it ends within a loop iteration,
#: or after its own cleanup, which a second cancel interrupts only after this long)
RESEND_S = 0.5


def pending_cancels() -> int:
    """How many cancellations of the current task are pending (``Task.cancelling()``: a
    cancellation a library swallowed is still counted); 0 outside a task and on Python 3.10,
    which does not count them."""
    try:
        task = asyncio.current_task()
    except RuntimeError:
        return 0
    fn = getattr(task, "cancelling", None)
    return int(fn()) if fn is not None else 0


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """``await aw`` for at most ``timeout`` seconds (None: no bound), as ``asyncio.wait_for``,
    but a cancellation of the caller always raises ``CancelledError``, also when ``aw``
    completes in the same loop iteration (its result is then dropped, as when it is cancelled).

    Raises: ``TimeoutError`` (``asyncio.TimeoutError``) after ``timeout``; what ``aw`` raises;
    ``CancelledError``. On Python 3.10 this is ``asyncio.wait_for`` itself."""
    if timeout is None:
        return await aw
    if sys.version_info >= (3, 11):
        # the awaited coroutine runs in this task: a cancellation reaches it directly
        async with asyncio.timeout(timeout):
            return await aw
    return await asyncio.wait_for(aw, timeout)  # pragma: no cover - Python 3.10


async def logged(aw: Awaitable[Any], what: str, log: logging.Logger) -> None:
    """Await ``aw`` (a user callback's coroutine, run as a task of its own); an exception from
    it is logged on ``log`` naming ``what`` (e.g. "on_yield"), not raised: a user callback must
    not end the loop's work. A cancellation propagates."""
    try:
        await aw
    except Exception:  # noqa: BLE001 - see above
        log.exception("%s: %s callback raised", log.name, what)


def plain_or_coroutine(
    callback: Callable[[Any], Any],
    spawn: Callable[[Awaitable[None]], Any],
    what: str,
    log: logging.Logger,
) -> Callable[[Any], None]:
    """A lease callback of an asyncio client (``what``: "on_yield"), which may be a plain
    function or a coroutine function: the wrapper calls it, and hands the coroutine it
    returned, wrapped by :func:`logged`, to ``spawn`` to run as a task of its own.

    Raises:
        TypeError: ``callback`` is not callable (checked now: it may run much later).
    """
    if not callable(callback):
        raise TypeError(f"{what} takes a callable, got {callback!r:.80}")

    def call(lease: Any) -> None:
        r = callback(lease)
        if inspect.isawaitable(r):
            spawn(logged(r, what, log))

    return call


async def stop_tasks(tasks: Iterable[asyncio.Future[Any]], *, resend_s: float = RESEND_S) -> None:
    """Cancel ``tasks`` and return once every one has ended; a task still running ``resend_s``
    seconds after a cancel is cancelled again, until it ends (its cancellation was lost below
    it: see the module's note). Their results and errors are retrieved and dropped. A
    cancellation of the caller propagates (the tasks stay cancelled)."""
    ts = list(tasks)
    left = {t for t in ts if not t.done()}
    while left:
        for t in left:
            t.cancel()
        _, left = await asyncio.wait(left, timeout=resend_s)
    for t in ts:
        if not t.cancelled():
            t.exception()  # retrieved: no "exception was never retrieved" at exit
