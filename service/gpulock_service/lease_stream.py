"""One lease for a whole generation, with ``gpulock.fastapi`` as it is today: the seam between
the generation routes and the integration (``routes/generation.py`` calls only
:func:`run_to_end` and :func:`open_stream`).

A generation is ``steps()``: an iterator whose every ``next()`` is blocking model work.
Both functions run it in **one guarded call**: one thread slot of the integration's bounded
executor, one lease of ``amount`` bytes from the pool's queue (503/413 and the rest as for any
guarded call), released after the thread returned. Between steps the thread checks the lease
(``current_lease().ensure_valid()``: a lease that may be lost ends the generation with
``LeaseLost``) and whether the caller asked it to stop (the client hung up).

* :func:`run_to_end` folds the steps in the thread and returns the fold (the non-stream
  answer; with ``X-Request-ID`` it is stored for retries like any guarded call's result).
* :func:`open_stream` hands each step's result to the event loop as it comes: it returns once
  the lease is granted and the first step is done (so a refusal is still an HTTP error), as an
  async iterator the response's body reads. Closing it (the body ends, or Starlette cancels it
  when the client hangs up) stops the thread at its next step, and the lease is released when
  the thread returns. An error after the first step (a lost lease, CUDA OOM, the
  ``inference_timeout``) ends the iterator with that error (a ``GpuLockHTTPException``).

This is the interim: gpulock.fastapi's streams under a lease replace :func:`open_stream` (and
this module) when they land; the routes keep ``steps`` as they are.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from gpulock.fastapi import GpuCall, current_lease

__all__ = ["LeaseStream", "open_stream", "run_to_end"]

T = TypeVar("T")
R = TypeVar("R")

_END = object()


def _drive(steps: Callable[[], Iterator[T]], stop: threading.Event) -> Iterator[T]:
    """In the executor thread, under the lease: the steps, until they end or ``stop`` is set;
    the lease checked before each. Raises LeaseLost when it may be lost."""
    lease = current_lease()
    it = steps()
    try:
        while not stop.is_set():
            if lease is not None:
                lease.ensure_valid()
            try:
                item = next(it)
            except StopIteration:
                return
            yield item
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


async def run_to_end(
    call: GpuCall,
    steps: Callable[[], Iterator[T]],
    fold: Callable[[Iterator[T]], R],
    *,
    amount: int,
    fingerprint: str,
) -> R:
    """``fold(steps)`` in one guarded call of ``amount`` bytes (``fingerprint``: the request's,
    for ``X-Request-ID``). A client that hangs up stops the steps at the next one (a request
    answered 503 or 504 with ``X-Request-ID`` goes on: its retry collects the result). Raises
    what a guarded call raises (``GpuLockHTTPException``)."""
    stop = threading.Event()
    try:
        return await call.calls.call(
            lambda: fold(_drive(steps, stop)),
            route=call.route,
            amount=amount,
            request=call.request,
            response=call.response,
            fingerprint_of=lambda: fingerprint,
            priority=call.priority,
        )
    except asyncio.CancelledError:
        stop.set()
        raise
    except Exception as e:
        if getattr(e, "status_code", None) == 499:  # the client hung up: nobody reads it
            stop.set()
        raise


class LeaseStream(Generic[T]):
    """The steps of a generation as they come, under its lease (:func:`open_stream`)."""

    def __init__(self, q: asyncio.Queue[Any], task: asyncio.Future[Any], stop: threading.Event):
        self._q = q
        self._task = task
        self._stop = stop
        self._first: Any = _END
        self._done = False

    async def _get(self) -> Any:
        """The next item, or ``_END`` once the call ended well; raises the call's error
        (``GpuLockHTTPException``) when it ended with one."""
        if self._done:
            return _END
        if self._q.empty():
            get = asyncio.ensure_future(self._q.get())
            try:
                await asyncio.wait({get, self._task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not get.done():
                    get.cancel()  # the item, if one comes, stays queued
            if get.done() and not get.cancelled():
                item = get.result()
            elif not self._q.empty():  # items are queued before the call ends
                item = self._q.get_nowait()
            else:  # the call ended first, with an error (504, 499): the thread may go on
                self._done = True
                self._stop.set()
                self._task.result()
                return _END
        else:
            item = self._q.get_nowait()
        if item is _END:  # the thread returned: the call's outcome follows
            self._done = True
            await asyncio.wait({self._task})  # never cancels it
            self._task.result()
        return item

    async def start(self) -> None:
        """Wait for the first step (the lease granted, its work done); raises the call's error
        (503, 413, ...) when it ends without one."""
        self._first = await self._get()

    def __aiter__(self) -> LeaseStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._first is not _END:
            item, self._first = self._first, _END
        else:
            item = await self._get()
        if item is _END:
            raise StopAsyncIteration
        return item

    def close(self) -> None:
        """Stop the steps at the next one (the lease is released when the thread returns)."""
        self._stop.set()


async def open_stream(
    call: GpuCall, steps: Callable[[], Iterator[T]], *, amount: int
) -> LeaseStream[T]:
    """Run ``steps`` in one guarded call of ``amount`` bytes and return its items as they
    come, once the first is there (see the module docstring). ``X-Request-ID`` does not make a
    stream idempotent (a stream is not stored for replay). Raises what a guarded call raises
    before its first step (``GpuLockHTTPException``: 503, 413, ...)."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue[Any] = asyncio.Queue()
    stop = threading.Event()

    def work() -> None:
        try:
            for item in _drive(steps, stop):
                loop.call_soon_threadsafe(q.put_nowait, item)
        finally:
            loop.call_soon_threadsafe(q.put_nowait, _END)

    task = asyncio.ensure_future(
        call.calls.call(
            work,
            route=call.route,
            amount=amount,
            request=call.request,
            response=call.response,
            request_id="",  # no idempotent replay of a stream
            priority=call.priority,
        )
    )
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
    stream: LeaseStream[T] = LeaseStream(q, task, stop)
    try:
        await stream.start()
    except BaseException as e:
        stop.set()
        if isinstance(e, asyncio.CancelledError):
            task.cancel()  # still queued: it leaves the queue; running: it goes on to its end
        raise
    return stream
