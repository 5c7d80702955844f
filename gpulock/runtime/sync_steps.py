"""The blocking driver's waiting steps (:mod:`gpulock.protocol.steps`): subscribing, joining
the waiters, waiting for a grant on the caller's thread and leaving. :class:`gpulock.Pool`
carries out the others and hands these to :func:`carry_out` with its background (the loop
thread, the runtime in it, the hand-off subscription its waiting threads read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpulock.errors import PoolClosed
from gpulock.protocol import flow
from gpulock.runtime.loop_thread import LoopThread
from gpulock.runtime.runtime import Runtime, Waiter
from gpulock.runtime.sync_listener import ThreadSubscription, ThreadWait


@dataclass
class ThreadPlace:
    """A sync acquire's place in the runtime: the waiter, and the thread's wait for it."""

    waiter: Waiter
    wait: ThreadWait


def carry_out(
    pool: str, step: flow.Step, portal: LoopThread, rt: Runtime, sub: ThreadSubscription
) -> Any:
    """Carry out ``step`` of an acquire's flow of pool ``pool`` (its name, for errors) on the
    caller's thread and return its reply; ``portal``, ``rt``, ``sub``: the background the
    acquire began with. Raises PoolClosed (close() stopped the loop thread during a wait),
    the waiter's error, or AssertionError for a step it does not know."""
    if isinstance(step, flow.Subscribe):
        if step.yields:  # the runtime's listener, in the loop thread
            portal.call(rt.subscribe_quietly())
        else:
            sub.ensure_subscribed()
        return None
    if isinstance(step, flow.Join):
        # On this thread, not the loop thread's: waking that one would take the GIL from
        # this one. The thread then reads the subscription itself while it waits, or is
        # woken by the call that completes the waiter's future (a watcher).
        wait = portal.watch(ThreadWait(sub, step.ticket))
        joined = step.queue_in(rt)
        # A watcher, never a wait on the future itself: another acquire with the same
        # request id may share it, and giving up here must not cancel it.
        joined.future.watch(wait)
        return ThreadPlace(joined, wait)
    if isinstance(step, flow.Wait):
        h: ThreadPlace = step.handle
        if not sub.wait(h.wait, step.timeout):
            return flow.TimedOut(None)  # the place now is the loop thread's to know
        if h.wait.got is not None:
            return h.wait.got  # read by this thread itself
        f = h.waiter.future
        if h.wait.closed or f.cancelled():
            raise PoolClosed(pool)  # close() stopped the loop thread under us
        err = f.exception()
        if err is not None:
            raise err
        return f.result()
    if isinstance(step, flow.Leave):
        h = step.handle
        # The grant this thread read itself goes to any other acquire on the same waiter.
        if not step.withdrawing:
            rt.leave_waiter(h.waiter, h.wait.got)
            return False
        return rt.leave(h.waiter, h.wait.got)
    raise AssertionError(f"unknown step {step!r}")
