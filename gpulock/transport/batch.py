"""Coalescing of one pool object's script calls (asyncio): many concurrent calls, few
connections, few round trips.

A call made while nothing is in flight goes at once, on its own (an uncontended acquire or
release costs a counter and a check). A call made while others are in flight waits for the
end of the current loop iteration, and goes out with every other call made in it as one
pipeline (on the client's lane, :mod:`gpulock.transport.lane`: the commands in one write, the replies
read in order), while fewer than ``max_inflight`` batches are in flight; beyond that it waits
for one to come back. So concurrent callers share round trips as soon as they overlap, without
waiting for one another's replies, which takes fewer round trips, fewer system calls on both
sides and less server CPU per call than a connection per call (measured: docs/BENCHMARKS.md,
section 9).
10,000 waiters that enqueue at once take about 10,000 / ``max_batch`` round trips on at most
``max_inflight`` connections, and a waiter that is waiting holds no connection and sends
nothing (its refresh is in the pool's one batched heartbeat).

Errors are the caller's, as with a direct call: a reply error (a missing script, a gpulock
error) is raised to the call it belongs to; a connection error or timeout of a batch is raised
to every call in it (each retries by its own rules: every gpulock script is idempotent). A call
cancelled while it waits here is never sent. One cancelled while its batch is in flight runs on
the server all the same, so its cancellation waits for the batch's reply before it goes on:
the caller withdraws its request next (``cancel.lua``), and that withdrawal must not reach
Redis before the call it withdraws (Redis reads a big batch in parts and serves other
connections in between).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpulock.transport.script_calls import AsyncScripts
    from gpulock.transport.scripts import Script


class _Call:
    """A call waiting here or in a batch in flight: its future, and whether it was sent."""

    __slots__ = ("scripts", "sc", "args", "fut", "sent")

    def __init__(self, scripts: AsyncScripts, sc: Script, args: Sequence[Any], fut: Any):
        self.scripts, self.sc, self.args, self.fut = scripts, sc, args, fut
        self.sent = False


#: Most script calls in one pipeline: big enough that a burst takes few round trips, small enough
#: that several batches overlap (the client encodes one while Redis runs another).
DEFAULT_MAX_BATCH = 512


class Batcher:
    """Sends the first try of one pool object's script calls, with at most ``max_inflight``
    calls or pipelines at a time (≥ 1). Lives in one event loop. Used as the ``first`` of
    the pool's :class:`~gpulock.transport.script_calls.AsyncScripts`, which spells each command and
    sends a lone call on its lane."""

    def __init__(self, max_inflight: int, max_batch: int = DEFAULT_MAX_BATCH):
        self.max_inflight = max(1, int(max_inflight))
        self.max_batch = max(1, int(max_batch))
        self.inflight = 0
        self.pending: deque[_Call] = deque()
        self.batches = 0  # pipelines sent (for tests and benchmarks)
        self.batched_calls = 0  # calls that went out in a pipeline
        self._tick = False  # a flush at the end of this loop iteration is scheduled

    async def first(self, scripts: AsyncScripts, sc: Script, args: Sequence[Any]) -> Any:
        """The reply of ``sc`` with ``args``. Raises what redis-py raises for that call
        (an error reply as ResponseError, ConnectionError, TimeoutError, ...)."""
        if not self.inflight and not self.pending:
            self.inflight += 1
            try:
                return await scripts.send(sc, args)
            finally:
                self.inflight -= 1
                if self.pending:
                    self._flush()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        call = _Call(scripts, sc, args, fut)
        self.pending.append(call)
        if not self._tick:
            self._tick = True
            loop.call_soon(self._flush_tick)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if fut.done() or not call.sent:
                fut.cancel()  # not sent yet: it never will be
                raise
        # Cancelled while its batch is in flight: the call runs on the server in any case, so
        # the caller's withdrawal (another call, perhaps on another connection) must not
        # overtake it. Let its reply land first (a big batch is read in several parts, and
        # Redis serves other connections in between), then let the cancellation go on.
        try:
            await fut
        except BaseException:  # noqa: BLE001 - the cancellation is what the caller gets
            pass
        raise asyncio.CancelledError()

    def _flush_tick(self) -> None:
        self._tick = False
        self._flush()

    def _flush(self) -> None:
        while self.pending and self.inflight < self.max_inflight:
            batch: list[_Call] = []
            while self.pending and len(batch) < self.max_batch:
                item = self.pending.popleft()
                if not item.fut.done():  # a call cancelled while it waited is not sent
                    item.sent = True  # see first()
                    batch.append(item)
            if batch:
                self.inflight += 1
                asyncio.get_running_loop().create_task(self._send(batch))

    async def _send(self, batch: list[_Call]) -> None:
        if len(batch) == 1:  # alone: on the lane, as a direct call
            call = batch[0]
            fut = call.fut
            try:
                r = await call.scripts.send(call.sc, call.args)
            except BaseException as e:  # noqa: BLE001 - the call's own error
                if not fut.done():
                    fut.set_exception(e)
                if not isinstance(e, Exception):
                    raise
            else:
                if not fut.done():
                    fut.set_result(r)
            finally:
                self.inflight -= 1
                self._flush()
            return
        try:
            replies = await batch[0].scripts.send_many([(c.sc, c.args) for c in batch])
        except BaseException as e:  # noqa: BLE001 - every call of the batch gets the error
            for c in batch:
                if not c.fut.done():
                    c.fut.set_exception(e)
            if not isinstance(e, Exception):
                raise
        else:
            self.batches += 1
            self.batched_calls += len(batch)
            for c, r in zip(batch, replies):
                if c.fut.done():
                    continue
                if isinstance(r, Exception):
                    c.fut.set_exception(r)
                else:
                    c.fut.set_result(r)
        finally:
            self.inflight -= 1
            self._flush()


def inflight_for(redis: Any, reserved: int = 2, most: int = 16) -> int:
    """The ``max_inflight`` for a pool object on ``redis``: the client's connection cap less
    ``reserved`` (the hand-off subscription and the heartbeat keep a connection free), at
    most ``most`` (a client with no cap, or redis-py's default of 100, still gets a bounded
    number), at least 1."""
    cap = getattr(getattr(redis, "connection_pool", None), "max_connections", None) or most
    return max(1, min(int(cap), most) - reserved)
