"""Kept bytes: the leases a pool object keeps after their release, to grant its own next
requests from without a round trip while nobody waits (docs/SEMANTICS.md, "Kept bytes").

I/O-free and thread-safe (the sync shell's callers and the runtime's loop both use it); the
shells take and put back leases here, the runtime gives back what :meth:`KeptLeases.give_back`
and :meth:`KeptLeases.expired` return. A kept lease is an ordinary lease in Redis, renewed by
the heartbeat; the server lists it as kept (``release.lua``'s ``keep`` mode answered "kept")
and tells its holder, on the hand-off channel, the moment a request does not fit.

The rules:

* A lease is kept only when the server said so: its release, sent in ``keep`` mode, found
  nobody waiting (nor a grace period, nor an ask to yield). Its local state is then handed on
  (:meth:`~gpulock.protocol.lease.LeaseState.handed_on`) to an idle entry here, and the
  released lease object stays released.
* An acquire takes an idle kept lease when it asks for exactly what the lease was granted for:
  the same amount, ttl, priority, tenant and preemptibility, and a device the lease is on (or
  none), with no request id and not resident. Anything else does not fit: the shell gives the
  idle kept leases back first, then asks Redis as usual.
* Releasing a grant from kept bytes puts it back here, unless the pool object was told to give
  its kept leases back (:meth:`give_back`, "draining"): then its release goes to Redis in
  ``keep`` mode, and the server decides. Draining ends when the server next answers "kept".
* While draining nothing is taken from here; an idle entry is given back once it was idle
  ``keep_s`` seconds (checked at the heartbeat's ticks), or when the lease may be lost soon.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, Hashable

from gpulock.errors import InvalidArgument
from gpulock.protocol.lease import LeaseState
from gpulock.units import parse_size

__all__ = ["KeptLeases", "MIN_LEFT_S", "back_for_growth", "take_for"]

#: Every keeper of this process (see _after_fork_in_child).
_ALL: weakref.WeakSet[KeptLeases] = weakref.WeakSet()

#: A kept lease is granted from only while its local validity has at least this many seconds
#: left (the heartbeat renews it at ttl/3, so a live one has about 2/3 of its ttl): a request
#: is not handed a lease that may be lost before it can start.
MIN_LEFT_S = 0.5


def too_short(s: LeaseState) -> bool:
    """Whether ``s`` has too little validity left to grant from: under :data:`MIN_LEFT_S`, or
    under a quarter of its ttl for a ttl under 2 s (a renewal leaves about 2/3 of it)."""
    return s.seconds_left() < min(MIN_LEFT_S, s.ttl_s / 4)


def match_key(amount: int, ttl_s: float, priority: int, tenant: str, preemptible: bool) -> Hashable:
    """What a request must ask for exactly to be granted from a kept lease (the device is
    checked apart: a request for any device takes a lease on any)."""
    return (amount, ttl_s, priority, tenant, preemptible)


def state_key(s: LeaseState) -> Hashable:
    return match_key(s.amount, s.ttl_s, s.priority, s.tenant, s.preemptible)


def _after_fork_in_child() -> None:
    """A forked child shares its parent's leases, not its pool objects: it must not grant
    from the parent's kept leases (both would use the bytes). Each keeper forgets them (the
    parent gives them back) and keeps nothing from then on; its lock is made anew (a thread of
    the parent may have held it at the fork)."""
    for k in list(_ALL):
        k._lock = threading.Lock()
        k._idle.clear()
        k.idle_count = 0
        k.keep_s = 0.0
        k.draining = True


class KeptLeases:
    """The kept leases of one pool object. ``keep_s``: seconds an idle kept lease is kept
    (0: keeping is off); ``clock``: the local monotonic clock (s); ``hold(state)``: makes a
    handed-on state the one the heartbeat renews for its lease (called under this object's
    lock, so that two threads handing the same lease on cannot leave the wrong one held)."""

    def __init__(
        self,
        keep_s: float,
        clock: Callable[[], float],
        hold: Callable[[LeaseState], None] = lambda s: None,
    ):
        self.keep_s = keep_s
        self._clock = clock
        self._hold = hold
        self._idle: dict[Hashable, list[tuple[LeaseState, float]]] = {}
        self.idle_count = 0  # read without the lock by the shells' fast path: a hint
        self.draining = False
        self.grants = 0  # grants made from kept bytes (no round trip)
        self.kept = 0  # releases the server answered "kept"
        self.given_back = 0  # kept leases given back to Redis
        self._lock = threading.Lock()
        _ALL.add(self)

    @property
    def on(self) -> bool:
        return self.keep_s > 0

    def take(
        self,
        amount: int,
        ttl_s: float,
        priority: int,
        tenant: str,
        device: int | None,
        preemptible: bool,
    ) -> LeaseState | None:
        """An active local state for a grant from an idle kept lease that fits exactly, or
        None (none fits, or draining). The idle entry's state is handed on."""
        key = match_key(amount, ttl_s, priority, tenant, preemptible)
        with self._lock:
            if self.draining:
                return None
            lst = self._idle.get(key)
            if not lst:
                return None
            for i in range(len(lst) - 1, -1, -1):
                s = lst[i][0]
                if device is not None and s.device != device:
                    continue
                if not s.active or too_short(s) or s.yield_requested:
                    continue
                del lst[i]
                self.idle_count -= 1
                self.grants += 1
                n = s.handed_on()
                s.released = True
                self._hold(n)
                return n
        return None

    def put_back(self, s: LeaseState) -> LeaseState | None:
        """The release of ``s`` (a grant from kept bytes, or any lease of this pool object):
        put back here with no round trip, it returns the handed-on state of the same lease now
        idle here (the caller holds it in place of ``s``, which is released); None when the
        release must go to Redis (not a kept lease, draining, lost, soon lost, or asked to
        yield)."""
        if not s.kept:
            return None
        with self._lock:
            if self.draining or not s.active or s.yield_requested or self.keep_s <= 0:
                return None
            if too_short(s):
                return None
            n = s.handed_on()
            s.released = True
            # filed before it is held: an interrupt between the two leaves an idle entry the
            # heartbeat does not renew (given back when it runs short), never a renewed lease
            # nothing can give back
            self._idle.setdefault(state_key(n), []).append((n, self._clock()))
            self.idle_count += 1
            self._hold(n)
            return n

    def adopt(self, s: LeaseState) -> LeaseState:
        """The server answered "kept" to the release of ``s``: ``s`` is released, and a
        handed-on state of the same lease, marked kept, is idle here (returned: the caller
        holds it in its place). Draining ends: nobody waited."""
        n = s.handed_on()
        n.kept = True
        s.released = True
        with self._lock:
            self.draining = False
            self.kept += 1
            self._idle.setdefault(state_key(n), []).append((n, self._clock()))  # then held,
            self.idle_count += 1  # as in put_back
            self._hold(n)
        return n

    def stop(self) -> list[LeaseState]:
        """The pool object is closing: keep nothing from now on (``keep_s`` becomes 0); the
        idle kept leases, removed from here, for the caller to release."""
        with self._lock:
            self.keep_s = 0.0
        return self.give_back()

    def give_back(self, drain: bool = True) -> list[LeaseState]:
        """Every idle kept lease, removed from here, for the caller to release in Redis;
        ``drain``: also stop taking from here until the server next answers "kept" (someone
        waits, or may)."""
        with self._lock:
            if drain:
                self.draining = True
            out = [s for lst in self._idle.values() for s, _ in lst]
            self._idle.clear()
            self.idle_count = 0
            self.given_back += len(out)
            return out

    def expired(self) -> list[LeaseState]:
        """The idle kept leases idle for ``keep_s`` seconds or more, or lost, or whose
        validity runs short, removed from here, for the caller to release."""
        now = self._clock()
        out: list[LeaseState] = []
        with self._lock:
            for key, lst in list(self._idle.items()):
                keep = []
                for s, since in lst:
                    if now - since >= self.keep_s or not s.active or too_short(s):
                        out.append(s)
                    else:
                        keep.append((s, since))
                if keep:
                    self._idle[key] = keep
                else:
                    del self._idle[key]
            self.idle_count -= len(out)
            self.given_back += len(out)
        return out

    def idle(self) -> list[LeaseState]:
        """The idle kept leases now (a copy; for status and tests)."""
        with self._lock:
            return [s for lst in self._idle.values() for s, _ in lst]

    def counts(self) -> dict[str, Any]:
        """``{"idle", "idle_bytes", "grants", "kept", "given_back", "draining"}``: this pool
        object's kept leases now and its counters since it was made."""
        idle = self.idle()
        return {
            "idle": len(idle),
            "idle_bytes": sum(s.amount for s in idle),
            "grants": self.grants,
            "kept": self.kept,
            "given_back": self.given_back,
            "draining": self.draining,
        }


def take_for(
    kept: KeptLeases,
    default_ttl: float,
    amount: Any,
    ttl: Any,
    timeout: Any,
    holder: Any,
    on_queued: Any,
    priority: Any,
    tenant: Any,
    device: Any,
    preemptible: Any,
) -> LeaseState | None:
    """An acquire's arguments (as :meth:`gpulock.AsyncPool.acquire` takes them, with no
    request id and not resident) granted from an idle kept lease, or None: none fits, or an
    argument is not of the plain kind this path checks cheaply (the full path then validates
    it and names a bad one). ``holder`` is not sent anywhere: status shows the holder of the
    request the lease was first granted to."""
    if type(amount) is not int:
        if type(amount) is not str:
            return None
        try:
            amount = parse_size(amount)
        except InvalidArgument:
            return None
    if ttl is None:
        ttl = default_ttl
    elif type(ttl) is not int and type(ttl) is not float:
        return None
    if timeout is not None and (
        (type(timeout) is not int and type(timeout) is not float) or not timeout >= 0
    ):
        return None
    if (
        (holder is not None and type(holder) is not dict)
        or (on_queued is not None and not callable(on_queued))
        or type(priority) is not int
        or (tenant is not None and type(tenant) is not str)
        or (device is not None and type(device) is not int)
        or type(preemptible) is not bool
    ):
        return None
    return kept.take(amount, ttl, priority, tenant or "", device, preemptible)


def back_for_growth(kept: KeptLeases, state: LeaseState, amount: Any) -> list[LeaseState]:
    """The idle kept leases of ``kept``, taken out, for the caller to release before
    ``state``'s lease grows to ``amount`` (bytes or a size string): a growth of the pool
    object's own lease never waits for, nor is refused because of, its own idle kept bytes.
    Empty when none is idle, for a shrink or the same amount, and for a bad amount (the
    resize names it)."""
    if not kept.idle_count or not state.active:
        return []
    try:
        grows = parse_size(amount) > state.amount
    except InvalidArgument:
        return []
    return kept.give_back(drain=False) if grows else []


os.register_at_fork(after_in_child=_after_fork_in_child)
