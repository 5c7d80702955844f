"""Coalescing of one pool object's script calls (asyncio): many concurrent calls, few
connections, few round trips.

A call runs at once, on its own connection, while fewer than ``max_inflight`` calls or
batches are in flight: an uncontended acquire or release costs what it did before (a counter
and a check). Calls made while all slots are busy queue here, in call order, and go out
together, as one pipeline (``transaction=False``: independent script calls, each with its own
reply or error), as soon as a slot frees. So 10,000 waiters that enqueue at once take about
10,000 / ``max_batch`` round trips on at most ``max_inflight`` connections, and a waiter that
is waiting holds no connection and sends nothing (its refresh is in the pool's one batched
heartbeat).

Errors are the caller's, as with a direct call: a reply error (NOSCRIPT, a gpulock error) is
raised to the call it belongs to; a connection error or timeout of a batch is raised to every
call in it (each retries by its own rules: every gpulock script is idempotent). A call
cancelled while it waits here is never sent; one cancelled while its batch is in flight is
sent, and its reply dropped, as a direct call's would be.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._script_calls import AsyncScripts
    from ._scripts import Script

#: Most script calls in one pipeline: big enough that a burst takes few round trips, small enough
#: that several batches overlap (the client encodes one while Redis runs another).
DEFAULT_MAX_BATCH = 512


class Batcher:
    """Sends the first try of one pool object's script calls, with at most ``max_inflight``
    calls or pipelines at a time (≥ 1). Lives in one event loop. Used as the ``first`` of
    the pool's :class:`~gpulock._script_calls.AsyncScripts`, which spells each command and
    sends a lone call on its lane."""

    def __init__(self, max_inflight: int, max_batch: int = DEFAULT_MAX_BATCH):
        self.max_inflight = max(1, int(max_inflight))
        self.max_batch = max(1, int(max_batch))
        self.inflight = 0
        self.pending: deque[tuple[AsyncScripts, Script, Sequence[Any], asyncio.Future[Any]]] = (
            deque()
        )
        self.batches = 0  # pipelines sent (for tests and benchmarks)
        self.batched_calls = 0  # calls that went out in a pipeline

    async def first(self, scripts: AsyncScripts, sc: Script, args: Sequence[Any]) -> Any:
        """The reply of ``sc`` with ``args``. Raises what redis-py raises for that call
        (an error reply as ResponseError, ConnectionError, TimeoutError, ...)."""
        if self.inflight < self.max_inflight and not self.pending:
            self.inflight += 1
            try:
                return await scripts.send(sc, args)
            finally:
                self.inflight -= 1
                if self.pending:
                    self._flush()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending.append((scripts, sc, args, fut))
        return await fut

    def _flush(self) -> None:
        while self.pending and self.inflight < self.max_inflight:
            batch: list[tuple[AsyncScripts, Script, Sequence[Any], asyncio.Future[Any]]] = []
            while self.pending and len(batch) < self.max_batch:
                item = self.pending.popleft()
                if not item[3].done():  # a call cancelled while it waited is not sent
                    batch.append(item)
            if batch:
                self.inflight += 1
                asyncio.get_running_loop().create_task(self._send(batch))

    async def _send(
        self, batch: list[tuple[AsyncScripts, Script, Sequence[Any], asyncio.Future[Any]]]
    ) -> None:
        try:
            scripts = batch[0][0]
            if scripts.lane is not None:
                await scripts.lane.give_back_idle()  # the pipeline takes one from the pool
            async with scripts.client.pipeline(transaction=False) as p:
                for _, sc, args, _ in batch:
                    p.execute_command(*scripts.words(sc, args))
                replies = await p.execute(raise_on_error=False)
        except BaseException as e:  # noqa: BLE001 - every call of the batch gets the error
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(e)
            if not isinstance(e, Exception):
                raise
        else:
            self.batches += 1
            self.batched_calls += len(batch)
            for (*_, fut), r in zip(batch, replies):
                if fut.done():
                    continue
                if isinstance(r, Exception):
                    fut.set_exception(r)
                else:
                    fut.set_result(r)
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
