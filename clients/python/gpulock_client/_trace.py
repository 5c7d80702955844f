"""The SDK's OpenTelemetry spans: the same ``gpulock.acquire`` and ``gpulock.lease`` spans as the
core's (:mod:`gpulock_common.traces`; no-ops without OpenTelemetry or without a configured SDK):

* every HTTP call to the broker carries the current context's W3C ``traceparent``
  (:func:`request_headers`, used where the sync and async shells send a request), so the
  broker's request spans are children of the caller's;
* ``acquire`` is a client-kind ``gpulock.acquire`` span (:func:`acquire_span`), current while
  its requests are sent (the long polls' request spans on the broker are its children);
* a granted lease is a ``gpulock.lease`` span from the grant to its release or loss, with its
  renewal and resize events (:mod:`gpulock_common.traces`: the lease state calls its hooks).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Union

from gpulock_common import tracing
from gpulock_common.options import AcquireOptions
from gpulock_common.sizes import parse_size
from gpulock_common.traces import AcquireSpan

__all__ = ["AcquireTrace", "acquire_span", "request_headers"]


def request_headers() -> Dict[str, str]:
    """The headers every request to the broker adds: the current span's ``traceparent`` (and
    ``tracestate``); empty without one."""
    headers: Dict[str, str] = {}
    tracing.inject(headers)
    return headers


class AcquireTrace:
    """An acquire's span as its shell sees it: ``on_queued`` (the caller's callback, with the
    span's :meth:`~gpulock_common.traces.AcquireSpan.queued` first while traced),
    ``on_granted_place`` (the span's ``queued`` alone, for the place a 201 reports of a
    request no ``queued`` answer placed; None while not traced: the caller's callback is for
    a request still waiting, never called after the grant) and :meth:`granted`."""

    __slots__ = ("span", "on_queued", "on_granted_place", "_clock")

    def __init__(
        self, span: Optional[AcquireSpan], clock: Callable[[], float], on_queued: Optional[Callable]
    ):
        self.span, self._clock = span, clock
        self.on_queued = on_queued if span is None else span.watching(on_queued)
        self.on_granted_place = None if span is None else span.queued

    def granted(self, state: Any) -> None:
        """The grant (``state``: the new lease's LeaseState): the outcome and the lease on the
        acquire span, and the lease's span starts."""
        if self.span is not None:
            self.span.granted(state, self._clock())


def _bytes(amount: Union[int, str]) -> Optional[int]:
    try:
        return parse_size(amount)
    except Exception:  # the acquire's own check names a bad amount
        return None


@contextmanager
def acquire_span(
    pool: str,
    amount: Union[int, str],
    options: AcquireOptions,
    clock: Callable[[], float],
    on_queued: Optional[Callable] = None,
) -> Iterator[AcquireTrace]:
    """The ``gpulock.acquire`` span (client kind) around an acquire, current for its block so
    its requests carry it; an error leaving the block sets its outcome and wire code
    (:meth:`~gpulock_common.traces.AcquireSpan.failed`), a normal exit ends it."""
    sp = (
        AcquireSpan.begin(
            pool, _bytes(amount), options.priority, "", options.device, clock(), kind="client"
        )
        if tracing.recording()
        else None
    )
    if sp is None:
        yield AcquireTrace(None, clock, on_queued)
        return
    with tracing.use(sp.span):
        try:
            yield AcquireTrace(sp, clock, on_queued)
        except BaseException as e:
            sp.failed(e, clock())
            raise
    sp.end()
