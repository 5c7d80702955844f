"""The asyncio driver's steps that reach the runtime (:mod:`gpulock.protocol.steps`): waiting
for a grant, subscribing, joining and leaving the waiters, withdrawing, the ``sync_replicas``
renewal. :class:`gpulock.AsyncPool` carries out the others (script calls, lease objects) and
hands these to :func:`carry_out`."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Callable

from gpulock_common.aio import pending_cancels

from gpulock.protocol import flow
from gpulock.runtime.runtime import Runtime


async def carry_out(
    rt: Runtime,
    step: flow.Step,
    cancels_before: int,
    cancel: Callable[[str, list[str]], Coroutine[Any, Any, None]],
) -> Any:
    """Carry out ``step`` for a flow of the pool object of ``rt`` and return its reply (the
    replies: :mod:`gpulock.protocol.steps`). ``cancels_before``: the caller task's pending
    cancellations when its flow began; ``cancel(script, args)``: the pool object's best-effort
    withdrawal call. Raises AssertionError for a step it does not know."""
    if isinstance(step, flow.Wait):
        # asyncio.wait, not wait_for: before Python 3.12, wait_for returns the result when
        # the task is cancelled in the loop iteration the grant lands in, swallowing the
        # cancellation (the caller would run its GPU work in a cancelled request). wait
        # raises CancelledError then, and the flow releases the grant.
        done, _ = await asyncio.wait((step.handle.future,), timeout=step.timeout)
        if done:
            return step.handle.future.result()
        w = rt.waiters.get(step.handle.ticket)
        return flow.TimedOut(w.position if w else step.handle.position)
    if isinstance(step, flow.Subscribe):
        if step.yields:
            return await rt.subscribe_quietly()
        return await rt.ensure_subscribed()
    if isinstance(step, flow.Checkpoint):
        if pending_cancels() > cancels_before:
            # The task was cancelled while the call was in flight, and the client lost the
            # cancellation (redis-py's asyncio client does, with a socket timeout, when it
            # lands while a command is sent or read): honour it; the flow withdraws.
            raise asyncio.CancelledError()
        return None
    if isinstance(step, flow.Join):
        return step.queue_in(rt)
    if isinstance(step, flow.Leave):
        if step.withdrawing:
            return rt.leave(step.handle)
        rt.leave_waiter(step.handle)
        return False
    if isinstance(step, flow.Withdraw):
        # Even if cancelled again meanwhile; when Redis did not answer, the caller does not
        # wait for a second bound: what the acquire may have left expires on its own.
        task = rt.spawn(cancel(*step.call))
        if not step.background:
            try:
                await asyncio.shield(task)
            except BaseException:  # noqa: BLE001 - never mask the error being raised
                pass
        return None
    if isinstance(step, flow.SyncedRenew):
        return await rt.renew_synced(step.args, step.bound)
    raise AssertionError(f"unknown step {step!r}")
