"""Carry out a step machine: the one driver loop of every step vocabulary.

gpulock writes each protocol as a generator without I/O (sans-I/O): it *yields* a step (what
to do: run a script, wait for a grant, send an HTTP request, sleep, ...), receives the step's
result as the value of its ``yield``, and *returns* its own result. A shell carries the steps
out: it writes only ``do_step``, the I/O of one step, and leaves the loop to :func:`drive`
(blocking) or :func:`adrive` (asyncio):

- each step's result is sent back into the generator;
- an exception ``do_step`` raises that is an instance of ``catch`` is thrown into the
  generator at its ``yield``, so the step machine decides (retry, withdraw, re-raise);
  ``into`` maps it first (gpulock's core translates redis-py's errors into gpulock's own),
  and when ``into`` returns None the exception propagates to the caller as raised. An
  exception outside ``catch`` propagates too (``catch=()``: none is thrown in; the SDK's steps
  receive a transport error as a *value*, which its ``do_step`` returns);
- the generator's return value is the driver's;
- on the way out (returned, raised, or cancelled) the generator is closed, so a ``finally``
  of a step machine left suspended runs at once (the SDK's acquire leaves its gate there).

Cancellation (:func:`adrive`): ``asyncio.CancelledError`` is a ``BaseException``, so it goes
into the generator with the default ``catch`` (gpulock's flows withdraw a queued acquire and
re-raise it), and propagates at once with ``catch=Exception`` (the pub/sub connection's life
ends there). Shapes: ``steps`` a ``Generator[step, result, T]``; ``do_step(step)`` the result
(:func:`adrive`: an awaitable of it). No I/O; standard library only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar, Union

S = TypeVar("S")
T = TypeVar("T")

#: the exception classes a driver throws into the step machine (``except`` accepts either form)
Catch = Union[type[BaseException], tuple[type[BaseException], ...]]


def _same(e: BaseException) -> BaseException | None:
    return e


def drive(
    steps: Generator[S, Any, T],
    do_step: Callable[[S], Any],
    *,
    catch: Catch = BaseException,
    into: Callable[[BaseException], BaseException | None] = _same,
) -> T:
    """Run ``steps`` to its return value, carrying out each step with ``do_step`` on the
    caller's thread (the module docstring says what goes in and what comes out).

    Raises: what the step machine raises; an exception of ``do_step`` outside ``catch``, or
    one that ``into`` returned None for."""
    reply: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                step = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                result: T = done.value
                return result
            reply, error = None, None
            try:
                reply = do_step(step)
            except catch as e:  # noqa: BLE001 - the step machine decides (and re-raises)
                error = into(e)
                if error is None:
                    raise
    finally:
        steps.close()


async def adrive(
    steps: Generator[S, Any, T],
    do_step: Callable[[S], Awaitable[Any]],
    *,
    catch: Catch = BaseException,
    into: Callable[[BaseException], BaseException | None] = _same,
) -> T:
    """As :func:`drive`, in the running event loop: each step's result is ``await
    do_step(step)``. A cancellation of the caller while a step runs raises
    ``CancelledError`` from ``do_step``: thrown into the step machine when ``catch`` covers
    it (the default), else propagated.

    Raises: as :func:`drive`."""
    reply: Any = None
    error: BaseException | None = None
    try:
        while True:
            try:
                step = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                result: T = done.value
                return result
            reply, error = None, None
            try:
                reply = await do_step(step)
            except catch as e:  # noqa: BLE001 - the step machine decides (and re-raises)
                error = into(e)
                if error is None:
                    raise
    finally:
        steps.close()
