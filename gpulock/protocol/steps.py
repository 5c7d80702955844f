"""The contract between a flow (``gpulock/protocol/flow.py``) and its driver (``_sync.py``,
``_async.py``): the steps a flow yields, what it reads of the pool object (:class:`PoolView`)
and of its runtime (:class:`RuntimeView`), and the errors a driver sends in. No I/O, and
nothing of the layers above: the runtime (``gpulock.runtime.runtime.Runtime``) implements the
views structurally.

The steps and what a driver returns for them:

* :class:`Eval` — the script's reply (EVALSHA with NOSCRIPT reload, connection errors retried
  on :func:`~gpulock.transport.retry.retrying` for ``bound`` seconds); with ``bound=0`` one
  try, a connection error or timeout raised as :class:`Unanswered`.
* :class:`Subscribe` — None once the pool's hand-off subscription is confirmed (or known to
  fail: the acquire then reports Redis itself).
* :class:`Checkpoint` — None; raises a cancellation of the caller that its client lost.
* :class:`MakeLease` — ``(the shell's lease object, its LeaseState)`` for a grant (tracked by
  the heartbeat: :func:`gpulock.protocol.flow.lease_state`).
* :class:`Join` — a handle of the waiter queued (or joined) for a ticket in the runtime.
* :class:`Wait` — the waiter's :class:`~gpulock.protocol.replies.Grant`, or :class:`TimedOut`;
  raises the waiter's failure.
* :class:`Leave` — True when the ticket is still in use locally after leaving the waiter.
* :class:`Withdraw` — None: the request was withdrawn (``cancel.lua``), quietly.
* :class:`SyncedRenew` — ``(renew reply, replicas that acknowledged)``: see
  :func:`gpulock.transport.script_calls.synced_renew`.
* :class:`GiveBack` — None: the lease was released, quietly.

Errors: a driver sends a flow gpulock's own (:mod:`gpulock.errors`; redis-py's errors and
``OSError`` translated by :func:`gpulock.transport.translate.translated`, the original as
``__cause__``), and the caller's interruptions (``CancelledError``, ``KeyboardInterrupt``) as
they are. A flow never sees redis-py's exception types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator, Protocol, TypeVar

from gpulock.errors import BackendUnavailable

if TYPE_CHECKING:
    from gpulock.protocol.keep import KeptLeases
    from gpulock.protocol.lease import LeaseState
    from gpulock.protocol.request import AcquireRequest
    from gpulock.protocol.replies import Grant, QueueConfig


class Unanswered(BackendUnavailable):
    """An :class:`Eval` of ``bound=0`` (one try) got no answer: a connection error or a
    timeout, so the script may or may not have run. The flow that asked for one try decides
    (``release``: a retry that then finds no lease counts as released)."""


# ---- steps ----------------------------------------------------------------------------------
class Step:
    """What a flow asks its driver to do next (the module docstring lists the replies).
    Steps are slotted, not frozen: one is made for each call on the hot path, and a frozen
    dataclass costs several times as much to make; no one changes a step once made (but the
    runtime, which records on a :class:`Join` the waiter it registered the acquire on)."""

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
    is sent, so that no grant published after it can be missed. ``yields``: the one that
    hands asks to yield to the leases held (the runtime's listener; on the sync shell not the
    one its waiting threads read), before an acquire whose lease may be asked is sent, so
    that an ask made right after its grant is not missed (docs/SEMANTICS.md, "Preemption")."""

    yields: bool = False


@dataclass(slots=True)
class Checkpoint(Step):
    """After the acquire call: raise the caller's cancellation if it landed while the call
    was in flight and the client lost it (redis-py's asyncio client can)."""


SUBSCRIBE = Subscribe()
LISTEN = Subscribe(yields=True)
CHECKPOINT = Checkpoint()


@dataclass(slots=True)
class MakeLease(Step):
    """Make the lease object for ``grant`` (its local state:
    :func:`gpulock.protocol.flow.lease_state`)."""

    grant: Grant
    req: AcquireRequest
    valid_until: float  # local monotonic seconds


@dataclass(slots=True)
class Join(Step):
    """Queue a waiter for ``ticket`` in the runtime (:meth:`WaiterQueue.queue_waiter` with
    these fields, in order), or join the one this process has for it."""

    ticket: str
    argv: list[str]  # the acquire's ARGV, to queue it again
    waiter_ttl_ms: int
    position: int
    on_queued: Callable[[int], Any] | None
    retry_after_ms: int  # to the nearest lease expiry (-1: none), for the reap timer
    deadline: float | None = None  # local time the acquire gives up (None: never)
    script: str = "acquire"  # the script that queued it, sent ``argv`` again ("resize": a growth)
    # The runtime's waiter this step registered the acquire on, set by the runtime together
    # with the registration (``queue_waiter``'s ``claim``); None while it registered nothing.
    waiter: Any = field(default=None, init=False)

    def queue_in(self, rt: WaiterQueue) -> Any:
        """The runtime's waiter for this step (``rt.queue_waiter`` with its fields)."""
        return rt.queue_waiter(
            self.ticket,
            self.argv,
            self.waiter_ttl_ms,
            self.position,
            self.on_queued,
            self.retry_after_ms,
            self.deadline,
            self.script,
            claim=self,
        )

    def undo(self, rt: RuntimeView) -> None:
        """For a flow whose Join raised (the handle never came back): leave the waiter the
        step registered the acquire on, if it did. An interrupt (KeyboardInterrupt, or what a
        signal handler raises) can land in the step after the registration; left there, the
        registration would keep the ticket in use, so the flow would not withdraw the request,
        and the runtime would keep its place on the server with nobody to take its grant.
        Leaving it makes the ticket free again unless another acquire with the same request
        id shares the waiter (then that one keeps the request)."""
        w, self.waiter = self.waiter, None
        if w is not None:
            rt.leave_waiter(w)


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
    ``background``: Redis did not answer the acquire; do not make the caller wait for it.
    ``script``/``args``: the call that withdraws it (default ``cancel`` of the ticket; a
    growth's is a ``resize`` back to the lease's amount before it)."""

    ticket: str
    background: bool
    script: str = "cancel"
    args: list[str] | None = None

    @property
    def call(self) -> tuple[str, list[str]]:
        """``(script, args)`` of the withdrawal."""
        return self.script, [self.ticket] if self.args is None else self.args


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


class RuntimeView(Protocol):
    """What the flows need of a pool object's runtime (the background work: heartbeat, waiters,
    recovery), and all they use of it. ``gpulock.runtime.runtime.Runtime`` implements it.
    Times are local monotonic seconds unless named ``_ms`` (server milliseconds)."""

    @property
    def channel_id(self) -> str:
        """The pool object's hand-off channel id (an acquire's ARGV names it)."""
        ...

    @property
    def subscribed(self) -> bool:
        """Whether the hand-off subscription is confirmed now (no :class:`Subscribe` needed)."""
        ...

    @property
    def listening(self) -> bool:
        """Whether the subscription that hands asks to yield to the leases held is confirmed
        now (no :data:`LISTEN` needed)."""
        ...

    def use_settings(
        self,
        *,
        capacity: int | None,
        max_waiters: int,
        max_ttl_ms: int,
        sync_replicas: int,
        sync_timeout_ms: int,
        backend_timeout: float,
    ) -> None:
        """Take the pool object's settings (bytes; ms; s)."""
        ...

    def configure_argv(
        self,
        capacity: int,
        max_waiters: int,
        max_ttl_ms: int,
        create_only: bool,
        grace: bool = False,
        policy: QueueConfig | None = None,
    ) -> list[str]:
        """ARGV of ``configure.lua``; a create-only call by an object that knew the pool makes
        it again as last seen, with a grace period."""
        ...

    def seen(
        self,
        epoch: int,
        capacity: int = 0,
        max_waiters: int = 0,
        max_ttl_ms: int = 0,
        policy: QueueConfig | None = None,
    ) -> None:
        """Take in what a reply showed of the pool (epoch 0: it is gone)."""
        ...

    def remake_capacity(self) -> int | None:
        """The capacity (bytes) this object would make the pool again with after Redis lost it
        (as the server last showed it: see :meth:`configure_argv`); None when it never saw the
        pool, so has nothing to make it again from."""
        ...

    def note_grace(self, sent: float, left_ms: int) -> None:
        """A reply to a call sent at ``sent`` showed ``left_ms`` of grace period left."""
        ...

    def observe(self, sent: float, now_ms: int) -> None:
        """Record a (local send time, server time) pair of a completed call."""
        ...

    def grace_left(self) -> float:
        """Seconds left in the pool's grace period as last seen; 0 outside one."""
        ...

    def unreachable(self) -> tuple[float, BaseException] | None:
        """``(seconds, last error)`` while the background calls keep failing, else None."""
        ...

    def deadline_for(self, grant: Grant) -> float:
        """The local validity deadline of a grant that came by the waiter (no call of its own)."""
        ...

    def ticket_in_use(self, ticket: str) -> bool:
        """Whether another local acquire or a live local lease still uses ``ticket``."""
        ...

    def remove_waiter(self, ticket: str) -> None:
        """Forget the local waiter of ``ticket``."""
        ...

    def leave_waiter(self, w: Any) -> None:
        """One acquire sharing waiter ``w`` stops waiting on it; the last one removes it."""
        ...

    def untrack(self, lease_id: str) -> None:
        """Stop heartbeating a lease."""
        ...


class LeaseTracker(Protocol):
    """What a driver's :class:`MakeLease` needs of the runtime
    (:func:`gpulock.protocol.flow.lease_state`)."""

    @property
    def kept(self) -> KeptLeases:
        """The pool object's kept leases (:mod:`gpulock.protocol.keep`; off unless it keeps)."""
        ...

    def state_for(
        self,
        grant: Grant,
        ttl_s: float,
        valid_until: float,
        meta: str = "",
        tenant: str = "",
        resident: bool = False,
    ) -> tuple[LeaseState, bool]:
        """The local state of a granted lease (an existing one for a lease already held) and
        whether it is new."""
        ...

    def track(self, state: LeaseState) -> None:
        """Start heartbeating a lease."""
        ...


class WaiterQueue(Protocol):
    """What a driver's :class:`Join` needs of the runtime (:meth:`Join.queue_in`)."""

    def queue_waiter(
        self,
        ticket: str,
        argv: list[str],
        waiter_ttl_ms: int,
        position: int,
        on_position: Callable[[int], Any] | None,
        retry_after_ms: int,
        deadline: float | None = None,
        script: str = "acquire",
        *,
        claim: Join | None = None,
    ) -> Any:
        """Queue (or join) the local waiter of ``ticket`` (``script``: the script that queued
        it, which re-queues it); returns it, and sets it as ``claim.waiter`` together with the
        registration (for :meth:`Join.undo`)."""
        ...


class PlaceKeeper(RuntimeView, Protocol):
    """What the flows of a proxy's remote holders (:mod:`gpulock.protocol.remote`) need of the
    runtime besides :class:`RuntimeView`: the places it keeps for requests queued on behalf of
    holders on other hosts (refreshed by its heartbeat, their grants caught by its listener)."""

    def keep_place(
        self, ticket: str, argv: list[str], waiter_ttl_ms: int, position: int, retry_after_ms: int
    ) -> None:
        """Keep the place of ``ticket`` (queued at ``position``; ``argv``: its acquire's ARGV);
        ``retry_after_ms``: to the nearest lease expiry (-1: none), for the reap timer."""
        ...

    def kept_place(self, ticket: str) -> Any:
        """A handle of the place kept for ``ticket`` (for :class:`Wait`), None when none is."""
        ...

    def forget_place(self, handle: Any) -> None:
        """Stop keeping the place of ``handle`` (its grant was taken, or its wait failed)."""
        ...

    def hand_over(self, grant: Grant) -> None:
        """The request of ``grant`` was granted in the enqueue's reply: forget its place, and
        hand the grant to whoever waits on it."""
        ...
