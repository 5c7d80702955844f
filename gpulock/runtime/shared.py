"""What the parts of one pool object's runtime share, made once by the runtime and handed to each
part in its constructor: the held leases (:class:`HeldLeases`, their one owner), the server
clock anchor (:class:`ClockAnchor`) and the frozen :class:`Shared` value that names them with
the pool, the local clock, the script calls, the settings, the loop's tasks and the waiters.

No part keeps a reference to another part's private state: what they have in common is here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Callable

from gpulock.protocol.keep import KeptLeases
from gpulock.protocol.lease import LeaseState, validity_deadline
from gpulock.protocol.replies import Grant, YieldAsk
from gpulock.runtime.calls import Calls, Settings
from gpulock.runtime.tasks import LoopTasks
from gpulock.runtime.waiters import WaiterRegistry

__all__ = ["ClockAnchor", "HeldLeases", "Shared"]


class HeldLeases(Mapping[str, LeaseState]):
    """The leases pool ``pool`` holds in this process, by lease id: those the heartbeat renews,
    the recovery puts back, and the waiters' tickets are checked against. A read-only mapping
    to its readers; adding and dropping are safe from any thread (a dict insert or pop; finding
    and adding a granted lease happen under one lock: :meth:`state_for`)."""

    def __init__(self, pool: str, clock: Callable[[], float]):
        self.pool = pool
        self._clock = clock
        self._by_id: dict[str, LeaseState] = {}
        self._lock = threading.Lock()  # the sync shell makes leases on caller threads

    def __getitem__(self, lease_id: str) -> LeaseState:
        return self._by_id[lease_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, state: LeaseState) -> None:
        """Hold ``state`` (replacing one of the same lease id)."""
        self._by_id[state.lease_id] = state

    def drop(self, lease_id: str) -> None:
        """Stop holding the lease ``lease_id`` (nothing when it is not held)."""
        self._by_id.pop(lease_id, None)

    def lose(self, state: LeaseState, reason: str) -> None:
        """Mark ``state`` lost for ``reason`` (firing its on_lost) and stop holding it."""
        state.mark_lost(reason)
        self.drop(state.lease_id)

    def ask(self, asks: Sequence[YieldAsk]) -> None:
        """A hand-off message asked this process to yield leases (preemption): mark each held
        one (:meth:`LeaseState.asked`, which fires its on_yield once); ids not held (released
        meanwhile, or another pool object's on a shared channel) are skipped. Safe from any
        thread."""
        for a in asks:
            s = self._by_id.get(a.lease_id)
            if s is not None:
                s.asked(a.deadline_ms)

    def live(self) -> list[LeaseState]:
        """The leases neither released nor lost, in the order they were added."""
        return [s for s in list(self._by_id.values()) if not s.released and s.lost_reason is None]

    def state_for(
        self,
        grant: Grant,
        ttl_s: float,
        valid_until: float,
        epoch: int,
        meta: str = "",
        tenant: str = "",
        resident: bool = False,
    ) -> tuple[LeaseState, bool]:
        """The local state of a granted lease: the existing one when this process already
        holds that lease (the same request id acquired again returns the same grant), so that
        both lease objects share one validity clock and one release. Returns (state, new); a
        new one (of ``epoch`` unless the grant names one) is held at once."""
        with self._lock:
            s = self._by_id.get(grant.lease_id)
            if (
                s is not None
                and s.token == grant.token
                and not s.released
                and s.lost_reason is None
            ):
                return s, False
            s = LeaseState(self.pool, grant, ttl_s, valid_until, self._clock)
            s.meta = meta
            s.tenant = tenant
            s.resident = resident
            if not s.epoch:
                s.epoch = epoch
            self._by_id[s.lease_id] = s
            return s, True


class ClockAnchor:
    """The last (local send time, server time) pair of a completed call: where a grant that
    came with no call of its own (by a waiter) counts its validity from."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self.anchor: tuple[float, int] | None = None  # (local time sent, server now ms)

    def observe(self, sent: float, now_ms: int) -> None:
        """Record a (local send time, server time) pair from a completed call."""
        self.anchor = (sent, now_ms)

    def deadline_for(self, grant: Grant) -> float:
        """The local validity deadline of ``grant`` (:func:`gpulock.protocol.lease.validity_deadline`
        from the last recorded anchor, or from now and the grant's own server time)."""
        sent, server_now = self.anchor if self.anchor else (self._clock(), grant.now_ms)
        return validity_deadline(sent, server_now, grant.expires_ms)


@dataclass(frozen=True)
class Shared:
    """What the runtime's parts share (one per pool object, made by the runtime).

    ``pool``: the pool name; ``clock``: the local monotonic clock (s); ``calls``: the background
    script calls; ``settings``: the pool object's settings (mutable, set by the pool object);
    ``tasks``: the loop and its spawned tasks; ``leases``: the held leases; ``waiters``: the
    waiter registry; ``anchor``: the server clock anchor; ``is_closed()``: whether the runtime
    was closed; ``channel_id``: the pool object's hand-off channel id (acquire's ARGV 8); ``kept``: its kept
    leases (:mod:`gpulock.protocol.keep`)."""

    pool: str
    clock: Callable[[], float]
    calls: Calls
    settings: Settings
    tasks: LoopTasks
    leases: HeldLeases
    waiters: WaiterRegistry
    anchor: ClockAnchor
    is_closed: Callable[[], bool]
    channel_id: str = ""
    kept: KeptLeases = field(default_factory=lambda: KeptLeases(0.0, lambda: 0.0))
