"""The steps a flow (``gpulock/protocol/flow.py``) yields to its driver (``_sync.py``, ``_async.py``),
and the pool view the flows read. No I/O.

The steps and what a driver returns for them:

* :class:`Eval` — the script's reply (EVALSHA with NOSCRIPT reload, connection errors retried
  on :func:`~gpulock.protocol.retry.retrying` for ``bound`` seconds, errors translated); with
  ``bound=0`` one try, and redis-py's own error raised.
* :class:`Subscribe` — None once the pool's hand-off subscription is confirmed (or known to
  fail: the acquire then reports Redis itself).
* :class:`Checkpoint` — None; raises a cancellation of the caller that its client lost.
* :class:`MakeLease` — the shell's lease object for a grant (tracked by the heartbeat).
* :class:`Join` — a handle of the waiter queued (or joined) for a ticket in the runtime.
* :class:`Wait` — the waiter's :class:`~gpulock.protocol.replies.Grant`, or :class:`TimedOut`;
  raises the waiter's failure.
* :class:`Leave` — True when the ticket is still in use locally after leaving the waiter.
* :class:`Withdraw` — None: the request was withdrawn (``cancel.lua``), quietly.
* :class:`SyncedRenew` — ``(renew reply, replicas that acknowledged)``: see
  :func:`gpulock.transport.script_calls.synced_renew`.
* :class:`GiveBack` — None: the lease was released, quietly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator, Protocol, TypeVar

if TYPE_CHECKING:
    from gpulock.protocol.request import AcquireRequest
    from gpulock.protocol.replies import Grant
    from gpulock.runtime.runtime import Runtime


# ---- steps ----------------------------------------------------------------------------------
class Step:
    """What a flow asks its driver to do next (the module docstring lists the replies).
    Steps are slotted, not frozen: one is made for each call on the hot path, and a frozen
    dataclass costs several times as much to make; no one changes a step once made."""

    __slots__ = ()


@dataclass(slots=True)
class Eval(Step):
    """Run script ``script`` with ``args`` on the pool's keys. ``bound``: seconds of retrying
    connection errors (None: the pool's ``backend_timeout``; 0: one try, untranslated)."""

    script: str
    args: list[str]
    bound: float | None = None


@dataclass(slots=True)
class Subscribe(Step):
    """Make sure the runtime's hand-off subscription is confirmed before a queueing acquire
    is sent, so that no grant published after it can be missed."""


@dataclass(slots=True)
class Checkpoint(Step):
    """After the acquire call: raise the caller's cancellation if it landed while the call
    was in flight and the client lost it (redis-py's asyncio client can)."""


SUBSCRIBE = Subscribe()
CHECKPOINT = Checkpoint()


@dataclass(slots=True)
class MakeLease(Step):
    """Make the lease object for ``grant`` (its local state: :func:`lease_state`)."""

    grant: Grant
    req: AcquireRequest
    valid_until: float  # local monotonic seconds


@dataclass(slots=True)
class Join(Step):
    """Queue a waiter for ``ticket`` in the runtime (:meth:`~gpulock.runtime.runtime.Runtime.queue_waiter`
    with these fields, in order), or join the one this process has for it."""

    ticket: str
    argv: list[str]  # the acquire's ARGV, to queue it again
    waiter_ttl_ms: int
    position: int
    on_queued: Callable[[int], Any] | None
    retry_after_ms: int  # to the nearest lease expiry (-1: none), for the reap timer
    deadline: float | None = None  # local time the acquire gives up (None: never)

    def queue_in(self, rt: Runtime) -> Any:
        """The runtime's waiter for this step (``rt.queue_waiter`` with its fields)."""
        return rt.queue_waiter(
            self.ticket,
            self.argv,
            self.waiter_ttl_ms,
            self.position,
            self.on_queued,
            self.retry_after_ms,
            self.deadline,
        )


@dataclass(slots=True)
class Wait(Step):
    """Wait up to ``timeout`` seconds (None: forever) for the grant of the joined waiter."""

    handle: Any  # what Join returned
    timeout: float | None


@dataclass(slots=True)
class TimedOut:
    """:class:`Wait`'s reply when the timeout passed; ``position``: the waiter's place now
    (None when the driver does not know it; the place when queued counts then)."""

    position: int | None = None


@dataclass(slots=True)
class Leave(Step):
    """Leave the joined waiter. ``withdrawing``: the request is to be withdrawn after this
    (the driver then answers whether the ticket is still in use locally; else anything)."""

    handle: Any
    withdrawing: bool


@dataclass(slots=True)
class Withdraw(Step):
    """Withdraw ``ticket`` (leave the queue, give back a grant that raced in), never raising.
    ``background``: Redis did not answer the acquire; do not make the caller wait for it."""

    ticket: str
    background: bool


@dataclass(slots=True)
class SyncedRenew(Step):
    """A ``renew`` of ``args`` followed by the replicas' acknowledgement (WAIT), its
    connection errors retried for ``bound`` seconds (0: one try)."""

    args: list[str | int]
    bound: float = 0.0


@dataclass(slots=True)
class GiveBack(Step):
    """Release ``lease`` (the shell's lease object), never raising."""

    lease: Any


_T = TypeVar("_T")
#: A flow: yields steps, is sent their replies (untyped: each step's reply is documented
#: there), and returns a ``_T``.
Flow = Generator[Step, Any, _T]


class PoolView(Protocol):
    """What the flows read (and ``configure`` sets) of a pool object; meanings and units:
    :class:`gpulock.AsyncPool`."""

    name: str
    capacity: int | None
    max_waiters: int
    max_ttl: float
    backend_timeout: float
    sync_replicas: int
    sync_timeout: float
    clock: Callable[[], float]
