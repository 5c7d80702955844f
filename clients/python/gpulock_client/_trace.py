"""The SDK's OpenTelemetry spans (names in :mod:`gpulock_common.tracing`; no-ops without
OpenTelemetry or without a configured SDK):

* every HTTP call to the broker carries the current context's W3C ``traceparent``
  (:func:`request_headers`, used where the sync and async shells send a request), so the
  broker's request spans are children of the caller's;
* ``acquire`` is a client-kind :data:`~gpulock_common.tracing.ACQUIRE` span
  (:func:`acquire_span`): pool, amount, priority, device, the position on entry (the first
  queue position the broker reported; 0: granted at once), the wait in seconds, the outcome
  (``granted``, ``timeout``, ``cancelled``, ``refused`` with the error's class), the lease id and
  fencing token; the long polls' request spans on the broker are its children;
* a granted lease is a :data:`~gpulock_common.tracing.HOLD` span from the grant to its release
  (:func:`hold_start`, :func:`hold_end`), renewals (:func:`renewed`) and the loss of the lease
  (:func:`lost`) events on it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Union

from gpulock_common import tracing
from gpulock_common.options import AcquireOptions
from gpulock_common.sizes import parse_size

from .errors import AcquireTimeout

__all__ = ["AcquireTrace", "acquire_span", "hold_end", "hold_start", "lost", "renewed"]


def request_headers() -> Dict[str, str]:
    """The headers every request to the broker adds: the current span's ``traceparent`` (and
    ``tracestate``); empty without one."""
    headers: Dict[str, str] = {}
    tracing.inject(headers)
    return headers


class AcquireTrace:
    """What an acquire's span learns while it runs: the position on entry (``on_queued``
    wraps the caller's callback) and the grant (:meth:`granted`)."""

    def __init__(self, span: Any, clock: Callable[[], float], on_queued: Optional[Callable]):
        self.span, self._clock, self._user = span, clock, on_queued
        self.start = clock()
        self.position: Optional[int] = None
        self.on_queued = self._queued if span is not None else on_queued

    def _queued(self, position: int) -> Any:
        if self.position is None:
            self.position = position
            self.span.set_attribute(tracing.POSITION, position)
        tracing.event(self.span, tracing.EVENT_QUEUED, {tracing.POSITION: position})
        return self._user(position) if self._user is not None else None

    def granted(self, state: Any) -> None:
        """The grant (``state``: the new lease's LeaseState): the outcome and the lease on the
        span."""
        if self.span is None:
            return
        self.span.set_attributes(
            {
                tracing.OUTCOME: "granted",
                tracing.POSITION: self.position or 0,
                tracing.WAIT: self._clock() - self.start,
                tracing.LEASE_ID: state.lease_id,
                tracing.FENCING_TOKEN: state.token,
                tracing.DEVICE: state.device,
            }
        )


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
    """The :data:`~gpulock_common.tracing.ACQUIRE` span (client kind) around an acquire, current
    for its block so its requests carry it; an error leaving the block sets the outcome
    (``timeout``, ``cancelled`` for an interruption, else ``refused``) and is recorded."""
    attrs = (
        {
            tracing.POOL: pool,
            tracing.AMOUNT: _bytes(amount),
            tracing.PRIORITY: options.priority,
            tracing.DEVICE: options.device,
        }
        if tracing.recording()
        else None
    )
    with tracing.span(tracing.ACQUIRE, attrs, kind="client") as sp:
        tr = AcquireTrace(sp, clock, on_queued)
        try:
            yield tr
        except BaseException as e:
            if sp is not None:
                outcome = "cancelled" if not isinstance(e, Exception) else "refused"
                if isinstance(e, AcquireTimeout):
                    outcome = "timeout"
                sp.set_attributes({tracing.OUTCOME: outcome, tracing.WAIT: clock() - tr.start})
                if outcome == "refused":
                    sp.set_attribute(tracing.ERROR_CODE, type(e).__name__)
            raise


def hold_start(state: Any) -> None:
    """Start the lease's :data:`~gpulock_common.tracing.HOLD` span (``state``: the lease's
    LeaseState, just granted); it ends at :func:`hold_end`."""
    state.hold_span = tracing.start(
        tracing.HOLD,
        {
            tracing.POOL: state.pool,
            tracing.AMOUNT: state.amount,
            tracing.LEASE_ID: state.lease_id,
            tracing.FENCING_TOKEN: state.token,
            tracing.DEVICE: state.device,
        },
    )


def renewed(state: Any) -> None:
    """A renewal of the lease: an event on its hold span."""
    tracing.event(getattr(state, "hold_span", None), tracing.EVENT_RENEW)


def lost(state: Any, reason: str) -> None:
    """The lease was lost: an event on its hold span."""
    tracing.event(getattr(state, "hold_span", None), tracing.EVENT_LOST, {"reason": reason})


def hold_end(state: Any) -> None:
    """The lease was released (or its release gave up): its hold span ends."""
    tracing.end(getattr(state, "hold_span", None))
