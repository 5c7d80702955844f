"""A streamed body under the request's lease: a route's generator produces its chunks while
the lease is held, and the lease goes back when the stream ends.

A :class:`LeasedStream` is both the guarded call's work (the job runner drives it with
:meth:`LeasedStream.run` once the lease is granted) and the response the handler returns (its
ASGI ``__call__`` sends the chunks). The sequence::

    granted ── open the body and produce its first chunk (executor) ── the handler returns the
    response ── send a chunk ── produce the next (ensure_valid, then next() in the executor) ──
    ... ── the end: the last chunk sent ── close the body ── release

* A sync body (a generator, or a plain function returning an iterable) runs in the limiter's
  bounded executor, one ``next()`` per chunk, each right after ``lease.ensure_valid()``;
  ``current_lease()`` is the lease there. An async generator is awaited on the event loop
  (after ``ensure_valid()`` on the loop): it must offload its GPU work itself (e.g.
  ``await loop.run_in_executor(...)``), or it stalls every request of the worker.
* An error before or in the first chunk is answered as a guarded call's error is (503, 500,
  ...: nothing was sent yet). One after it ends the stream: server-sent events with an
  ``event: error`` event carrying OpenAI's error object (:func:`gpulock.http.sse.error_body`,
  ``code`` the reason, e.g. ``lease_lost``) and no ``[DONE]``; a plain stream with that object
  as one JSON line, ``{"error": {...}}\\n``.
* A client that hangs up: the chunk in progress finishes in its thread (its GPU work cannot
  be stopped), no new chunk starts, the body is closed (its ``finally`` runs, in the executor
  for a sync body), then the lease goes back.
* A yield request (preemption: only a route declared ``preemptible=True`` has leases the pool
  asks): no new chunk starts after the one in progress; the stream ends with an error event
  ``preempted`` (503) and the body is closed, then the lease goes back.
* Neither ``inference_timeout`` nor ``X-Request-ID`` replays apply past the first chunk: a
  stream runs until its body ends, and a retry starts a new one. A stream holds one of the
  worker's ``executor_threads`` from its grant to its end. A response nobody sends (the
  handler gave up: 504, 499) or whose sending does not begin within ``inference_timeout``
  seconds is closed and its lease released.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import logging
import typing
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from gpulock_common.wire import answer_for, served

from gpulock.http.sse import SSE_DONE, error_body, sse_event
from gpulock._async import AsyncLease
from gpulock.errors import InvalidArgument, LeaseLost
from ._errors import CudaFatal, CudaOOM, GpuLockHTTPException
from ._metrics import metrics

if typing.TYPE_CHECKING:
    from starlette.types import Receive, Scope, Send

log = logging.getLogger("gpulock.fastapi")

T = TypeVar("T")

#: ``step(fn, check)``: run ``fn()`` in the executor under the lease and return its result,
#: after ``lease.ensure_valid()`` when ``check``; the thread always finishes (a cancelled
#: caller does not end it).
Step = Callable[[Callable[[], Any], bool], Awaitable[Any]]

#: The media type that selects server-sent events (``"sse"`` is its short name).
SSE_MEDIA_TYPE = "text/event-stream"

_END = object()  # a body's end

#: What ends a preemptible route's stream whose lease the pool asked back (a yield request).
PREEMPTED = GpuLockHTTPException(
    503,
    "the GPU lease was asked back for a higher-priority request: the stream ended early; retry",
    "preempted",
)


class StreamLease:
    """What a streaming body reaches its lease through: give the generator (or the function
    that returns the iterable) a parameter annotated ``StreamLease`` and it receives one.
    ``StreamLease(current_lease(), loop)`` gives a plain guarded call's thread the same handle
    (``loop``: the limiter's event loop, taken in the handler), without the stream's stop.

    Attributes:
        lease: the request's :class:`~gpulock.AsyncLease` (``amount`` in bytes, ``id``,
            ``ensure_valid()``, ...); None when the limiter is disabled (``enabled=False``).
    """

    __slots__ = ("_loop", "_stopped", "lease")

    def __init__(
        self,
        lease: AsyncLease | None,
        loop: asyncio.AbstractEventLoop,
        stopped: asyncio.Event | None = None,
    ):
        self.lease = lease
        self._loop = loop
        self._stopped = stopped  # set (on ``loop``) when the stream ends: no chunk is wanted

    @property
    def yield_requested(self) -> bool:
        """Whether the pool asked for the lease back for a higher-priority request (only a
        preemptible route's lease is ever asked): a stream ends at its next chunk boundary; a
        body that checks it before each chunk may end on its own terms first."""
        return self.lease is not None and self.lease.yield_requested

    def ensure_valid(self) -> None:
        """Raise LeaseLost if the lease is no longer valid (the stream checks it before each
        chunk; call it before each further CUDA call inside one)."""
        if self.lease is not None:
            self.lease.ensure_valid()

    def run(self, aw: Awaitable[T], timeout: float | None = None) -> T:
        """Run the awaitable ``aw`` (a call of the lease's, e.g. ``stream.lease.resize(n)``) on
        the limiter's event loop and return its result, from a sync body's executor thread,
        waiting at most ``timeout`` seconds (None: no bound). An async body awaits it itself.
        When the stream ends meanwhile (the client hung up), ``aw`` is cancelled at once (a
        growth waiting in the pool's queue leaves it, the lease keeps its amount) and the body
        is closed after it returns, so a hang-up is not held up by a wait in ``aw``.

        Raises: what ``aw`` raises; TimeoutError after ``timeout``;
        ``concurrent.futures.CancelledError`` when the stream ended first (``aw`` cancelled);
        RuntimeError on the event loop's own thread (it would wait for itself)."""
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is self._loop:
            if inspect.iscoroutine(aw):
                aw.close()
            raise RuntimeError("StreamLease.run() is for a sync body's thread: await it instead")

        stopped = self._stopped
        ctx = contextvars.copy_context()  # this thread's: ``aw``'s spans are the call's children

        async def awaited() -> T:
            task = ctx.run(asyncio.ensure_future, aw)
            if stopped is None:
                return await task
            if not stopped.is_set():
                ended = asyncio.ensure_future(stopped.wait())
                try:
                    await asyncio.wait((task, ended), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    ended.cancel()
            if not task.done():  # the stream ended first: nobody wants the result
                task.cancel()
                await asyncio.wait((task,))
            return task.result()  # its result, its error, or CancelledError

        return asyncio.run_coroutine_threadsafe(awaited(), self._loop).result(timeout)


def lease_param(fn: Callable[..., Any]) -> str | None:
    """The name of ``fn``'s parameter annotated :class:`StreamLease` (a string annotation
    ``"StreamLease"`` counts), or None."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    for p in inspect.signature(fn).parameters.values():
        ann = hints.get(p.name, p.annotation)
        if ann is StreamLease or ann == "StreamLease":
            return p.name
    return None


def stream_kind(media_type: str) -> tuple[bool, str]:
    """``(sse, the response's media type)`` of a stream's ``media_type``: ``"sse"`` or
    ``"text/event-stream"`` select server-sent events; any other media type a plain stream.

    Raises: InvalidArgument naming the value when it is not ``"sse"`` nor a one-line media
    type (``type/subtype``)."""
    if media_type in ("sse", SSE_MEDIA_TYPE):
        return True, SSE_MEDIA_TYPE
    if (
        not isinstance(media_type, str)
        or "/" not in media_type
        or media_type != media_type.strip()
        or any(c in media_type for c in "\r\n")
    ):
        raise InvalidArgument(
            f"a stream's media type is 'sse' or a media type such as 'text/plain'; "
            f"got {media_type!r:.80}"
        )
    return False, media_type


def stream_error(exc: BaseException) -> tuple[int, str, str]:
    """``(status, reason, message)`` of an error that ended a stream after its first chunk:
    gpulock's errors as the error table answers them (:func:`gpulock_common.wire.served`: a
    lost lease is 503 ``lease_lost``), a CUDA OOM 503 ``cuda_oom``, a sticky CUDA error 500
    ``cuda_error``, a :class:`GpuLockHTTPException` the body raised its own status, reason and
    detail (a route's way to end a stream with a code of its own), anything else 500
    ``internal_error`` (its text is not sent: it is logged)."""
    if isinstance(exc, GpuLockHTTPException):
        return exc.status_code, exc.reason, str(exc.detail)
    if isinstance(exc, LeaseLost):
        status, reason = served(exc)
        return status, reason, f"the GPU lease was lost mid-stream ({exc.reason}); retry"
    if isinstance(exc, CudaOOM):
        return 503, "cuda_oom", "the GPU ran out of memory mid-stream; retry later"
    if isinstance(exc, CudaFatal):
        return 500, "cuda_error", f"CUDA error; this worker restarts: {exc}"
    if answer_for(exc) is not None:
        status, reason = served(exc)
        return status, reason, f"the stream failed: {exc}"
    return 500, "internal_error", "the stream failed with an internal error"


async def _hang_up(receive: Receive) -> None:
    """Return once the client closed the connection (the ASGI ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _anext(it: Any) -> Any:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return _END


class LeasedStream(StreamingResponse):
    """A response whose chunks ``source(stream_lease)`` produces under the request's lease
    (the module docstring). ``source`` is called in the executor and returns an iterable (a
    sync generator's body runs in the executor) or an async iterable (awaited on the loop).

    Chunks: with server-sent events, bytes pass as they are (events you framed yourself),
    anything else is one ``data:`` event (:func:`gpulock.http.sse.sse_event`), and a stream
    that ends ends with ``data: [DONE]``; a plain stream passes bytes as they are, encodes a
    str as UTF-8 and anything else as one JSON line.

    Args:
        source: called once, in the executor, with the stream's :class:`StreamLease`.
        media_type: ``"sse"`` (or ``"text/event-stream"``), or a plain stream's media type.
        route: the route's name (metrics, logs).

    Raises: InvalidArgument for a bad ``media_type``.
    """

    def __init__(
        self,
        source: Callable[[StreamLease], Any],
        media_type: str,
        *,
        route: str,
    ):
        sse, media = stream_kind(media_type)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"} if sse else None
        super().__init__((), media_type=media, headers=headers)
        self.sse, self.route = sse, route
        self._source = source
        self._it: Any = None
        self._async = False
        self._exhausted = False
        self._first: Any = _END
        self._step: Step | None = None
        self._handle: StreamLease | None = None
        self._inflight: asyncio.Future[Any] | None = None
        self._started = asyncio.Event()
        self._stop = asyncio.Event()
        self._error: BaseException | None = None
        self._ctx: contextvars.Context | None = None  # the job's, for an async body's steps

    # ---- the job's side: while the lease is held -------------------------------------------
    async def run(
        self,
        lease: AsyncLease | None,
        step: Step,
        ready: Callable[[LeasedStream], bool],
        start_timeout: float,
    ) -> None:
        """The guarded work: open the body and produce its first chunk (under ``lease``, by
        ``step``), hand the response out (``ready(self)``: False when nobody will send it, then
        the stream ends at once), wait until it ends (the last chunk sent, the client gone, an
        error, or no send begun within ``start_timeout`` seconds), let the chunk in progress
        finish, close the body. The caller releases the lease after it returns.

        Raises: what opening the body or producing its first chunk raised (nothing was sent:
        the caller answers it as HTTP); an error that ended the stream later (after closing
        the body), for the caller to count."""
        self._step = step
        self._ctx = contextvars.copy_context()  # the job's: its call span current
        self._handle = StreamLease(lease, asyncio.get_running_loop(), self._stop)
        try:
            await self._open()
            self._first = await self._pull()
        except BaseException:
            self._stop.set()
            await self._finish()
            raise
        try:
            if not ready(self):
                self._stop.set()
            else:
                try:
                    await asyncio.wait_for(self._started.wait(), start_timeout)
                except asyncio.TimeoutError:
                    log.warning(
                        "gpulock: route %s's stream was not sent within %gs; closing it",
                        self.route,
                        start_timeout,
                    )
                    self._stop.set()
            await self._stop.wait()
        finally:
            self._stop.set()
            await asyncio.shield(self._finish())
        if self._error is not None:
            raise self._error

    async def _open(self) -> None:
        assert self._step is not None and self._handle is not None
        handle = self._handle
        it = await self._step(lambda: self._source(handle), True)
        if hasattr(it, "__anext__") or hasattr(it, "__aiter__"):
            self._async = True
            self._it = it.__aiter__()
        else:
            self._it = iter(it)

    def _begin(self) -> asyncio.Future[Any]:
        """Start making the body's next chunk (the lease is checked first: raises LeaseLost)
        and return its future: the chunk, or _END. The work goes on (and :meth:`_finish` waits
        for it) when nobody awaits it any more."""
        assert self._step is not None and self._handle is not None
        if self._async:
            self._handle.ensure_valid()
            ctx = self._ctx.copy() if self._ctx is not None else contextvars.copy_context()
            fut = ctx.run(asyncio.ensure_future, _anext(self._it))
        else:
            fut = asyncio.ensure_future(self._step(functools.partial(next, self._it, _END), True))
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved
        self._inflight = fut
        return fut

    def _took(self, item: Any) -> Any:
        if item is _END:
            self._exhausted = True
        return item

    async def _pull(self) -> Any:
        """The body's next chunk, or _END (see :meth:`_begin`)."""
        return self._took(await asyncio.shield(self._begin()))

    async def _finish(self) -> None:
        """Wait for the chunk in progress, then close the body (its ``finally`` runs)."""
        if self._inflight is not None and not self._inflight.done():
            await asyncio.wait((self._inflight,))
        it, self._it = self._it, None
        if it is None or self._exhausted:
            return
        try:
            if self._async:
                if hasattr(it, "aclose"):
                    await it.aclose()
            elif hasattr(it, "close"):
                assert self._step is not None
                await self._step(it.close, False)
        except Exception:
            log.exception("gpulock: route %s: closing the stream's body raised", self.route)

    # ---- the HTTP side: sending ------------------------------------------------------------
    def _chunk(self, item: Any) -> bytes:
        if isinstance(item, bytes):
            return item
        if self.sse:
            return sse_event(item)
        if isinstance(item, str):
            return item.encode()
        return (json.dumps(item, separators=(",", ":"), ensure_ascii=False) + "\n").encode()

    def _error_chunk(self, exc: BaseException) -> bytes:
        status, reason, message = stream_error(exc)
        if reason == "internal_error":
            log.error("gpulock: route %s's stream failed", self.route, exc_info=exc)
        body = error_body(status, message, reason)
        if self.sse:
            return sse_event(body, event="error")
        return (json.dumps(body, separators=(",", ":")) + "\n").encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._started.set()
        gone = asyncio.ensure_future(_hang_up(receive))
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            item, tail = self._first, b""
            self._first = None
            while not self._stop.is_set():
                if item is _END:
                    tail = SSE_DONE if self.sse else b""
                    break
                try:
                    body = self._chunk(item)
                except Exception as e:  # a chunk that does not encode: the stream's error
                    self._error = e
                    tail = self._error_chunk(e)
                    break
                await send({"type": "http.response.body", "body": body, "more_body": True})
                if gone.done():
                    break
                if self._handle is not None and self._handle.yield_requested:
                    tail = self._error_chunk(PREEMPTED)  # a chunk boundary: no new chunk
                    break
                try:
                    making = self._begin()
                    # a hang-up is noticed while the chunk is being made: the stream stops
                    # (what the chunk awaits through StreamLease.run is cancelled), and the
                    # chunk is let finish before the body is closed (_finish)
                    await asyncio.wait((making, gone), return_when=asyncio.FIRST_COMPLETED)
                    if not making.done():
                        break
                    item = self._took(making.result())
                except Exception as e:
                    self._error = e
                    tail = self._error_chunk(e)
                    break
                if gone.done():
                    break
            if gone.done():
                metrics().disconnected.labels(self.route, "streaming").inc()
            else:
                await send({"type": "http.response.body", "body": tail, "more_body": False})
        except OSError:  # the client is gone (an ASGI server that raises on send says so)
            metrics().disconnected.labels(self.route, "streaming").inc()
            return
        finally:
            gone.cancel()
            self._stop.set()
        if self.background is not None:  # FastAPI's BackgroundTasks, after the body
            await self.background()
