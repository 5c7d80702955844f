"""An asyncio event loop on a daemon thread, driven from other threads: the blocking
:class:`~gpulock.Pool` runs its background work (heartbeat, waiters' refresh, reap timer) on
one, per pool object."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from typing import Any, Callable, Coroutine, Protocol, TypeVar

_T = TypeVar("_T")


class _Cancellable(Protocol):
    def cancel(self) -> Any: ...


_C = TypeVar("_C", bound=_Cancellable)


class LoopThread:
    """An event loop on a daemon thread; coroutines are submitted from other threads.

    After :meth:`stop` nothing waits on it forever: a submission raises ``closed()``, and the
    futures of submissions the stopped loop never ran are cancelled."""

    def __init__(
        self, name: str, closed: Callable[[], BaseException] = lambda: RuntimeError("loop stopped")
    ):
        self.loop = asyncio.new_event_loop()
        self.closed = closed
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False
        self._pending: weakref.WeakSet[_Cancellable] = weakref.WeakSet()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            # Closed here, in its own thread, once stopped: an event loop left open is closed
            # by its finalizer at interpreter exit, when its self-pipe's socket may be gone
            # already ("Exception ignored in BaseEventLoop.__del__ ... Invalid file
            # descriptor: -1" on the stderr of `gpulock run`, which depends on the order the
            # interpreter tears modules down in).
            self.loop.close()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        with self._lock:
            if self._stopped:
                coro.close()
                raise self.closed()
            f = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._pending.add(f)
            return f

    def call(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        return self.submit(coro).result(timeout)

    def watch(self, f: _C) -> _C:
        """Cancel ``f`` in :meth:`stop` (a future or wake the loop thread is to complete; done
        ones ignore it); returns it."""
        with self._lock:
            if self._stopped:
                raise self.closed()
            self._pending.add(f)
            return f

    def soon(self, fn: Callable[..., object], *args: Any) -> None:
        with self._lock:
            if not self._stopped:
                self.loop.call_soon_threadsafe(fn, *args)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)
        for f in list(self._pending):
            f.cancel()  # a caller blocked on it gets CancelledError instead of waiting forever
