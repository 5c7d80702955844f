"""Places kept across a 503: the one mechanism the FastAPI service and the HTTP broker share.

A request that carries a request id and is not granted by its deadline is answered 503 with
Retry-After, but its place in the pool's queue is *kept*, so the retry the client sends after
Retry-After (with the same request id) finds it instead of queueing at the back. The rule,
the same on both surfaces:

* a place is kept while an answer about it is being made (an HTTP request is *attached*) or
  the surface says it is busy (a Redis call for it in flight);
* every answer that leaves it queued extends it to at least :meth:`KeptPlaces.hold_for`
  seconds after that answer: ``hold``, and never less than twice the Retry-After it was told
  plus 2 s (so the retry finds it), plus the restart grace left; at most ``cap``. A client that
  keeps retrying keeps its place, however long the queue takes;
* once nothing is attached and its hold has passed, it is *withdrawn*: removed here and handed
  to ``on_expire``, which takes it out of the pool's queue (the service cancels the job, the
  broker cancels the ticket). ``on_expire`` may :meth:`KeptPlaces.keep` it again instead
  (the service does when a retry on another worker asked for more time).

The timing is an event-loop timer per place (``loop.call_later``), not a polling sweep.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["RECHECK_S", "KeptPlace", "KeptPlaces", "hold_for"]

#: How soon a place found busy when its hold ran out is looked at again, seconds.
RECHECK_S = 0.25


def hold_for(
    retry_after: float, *, hold: float, cap: float = math.inf, extra: float = 0.0
) -> float:
    """Seconds to keep a place after an answer that told ``retry_after`` seconds:
    ``min(cap, max(hold, 2 * retry_after + 2)) + extra``. Twice the Retry-After plus 2 s
    covers a client's jitter (up to +30 %) and a slow round trip; ``extra`` is the restart
    grace left, during which nothing is granted."""
    return min(cap, max(hold, 2.0 * retry_after + 2.0)) + extra


@dataclass(eq=False)
class KeptPlace:
    """One kept place: how many answers are attached to it, and until when it is held
    (the registry's clock, seconds)."""

    attached: int = 0
    until: float = 0.0
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    def busy(self) -> bool:
        """Whether it must not be withdrawn now (an answer is attached). Subclasses add their
        own reasons (the broker: a Redis call for it in flight)."""
        return self.attached > 0


K = TypeVar("K")
P = TypeVar("P", bound=KeptPlace)


class KeptPlaces(Generic[K, P]):
    """The kept places by key (the service: the request's ticket; the broker:
    ``(pool, ticket)``).

    Args:
        hold: the fewest seconds a place is kept after each answer that leaves it queued (the
            service's ``park_timeout``, the broker's ``waiter_ttl``); > 0.
        on_expire: ``on_expire(key, place)``, called once the place is withdrawn here; it
            withdraws it from the pool (it must not raise; it may :meth:`keep` it again).
        cap: the most seconds :meth:`hold_for` says (the broker's ``park_max``).
        clock: the clock ``until`` is on, seconds (monotonic).
    """

    def __init__(
        self,
        hold: float,
        on_expire: Callable[[K, P], None],
        *,
        cap: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.hold, self.cap = hold, cap
        self._on_expire = on_expire
        self._clock = clock
        self._places: dict[K, P] = {}

    def __len__(self) -> int:
        return len(self._places)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._places))

    def hold_for(self, retry_after: float, extra: float = 0.0) -> float:
        """:func:`hold_for` with this registry's ``hold`` and ``cap``."""
        return hold_for(retry_after, hold=self.hold, cap=self.cap, extra=extra)

    def get(self, key: K) -> P | None:
        """The place kept for ``key``, or None."""
        return self._places.get(key)

    def items(self) -> list[tuple[K, P]]:
        """The kept places, a snapshot."""
        return list(self._places.items())

    def attach(self, key: K, make: Callable[[], P]) -> P:
        """The place for ``key`` (``make()`` when none is kept), with one more answer
        attached to it."""
        place = self._places.get(key)
        if place is None:
            place = self._places[key] = make()
        place.attached += 1
        return place

    def detach(self, key: K, place: P, *, keep: bool) -> None:
        """End an answer attached to ``place``. ``keep`` (it is still queued): it is kept at
        least ``hold`` seconds from now (kept again if it had been dropped; an answer that
        told a Retry-After calls :meth:`keep` with :meth:`hold_for` first); else it is
        dropped once nothing else keeps it busy (withdrawn by the timer while busy)."""
        place.attached -= 1
        if keep:
            self.keep(key, place, until=self._clock() + self.hold)
        elif self._places.get(key) is place:
            if place.busy():
                self._arm(key, place, RECHECK_S)
            else:
                self.discard(key)

    def keep(self, key: K, place: P, *, until: float) -> None:
        """Keep ``place`` for ``key`` until at least ``until`` (never shortened), unless
        another place is kept for ``key`` now."""
        if self._places.setdefault(key, place) is not place:
            return
        place.until = max(place.until, until)
        self._arm(key, place, place.until - self._clock())

    def discard(self, key: K, place: P | None = None) -> P | None:
        """Stop keeping the place for ``key`` (only if it is ``place``, when given); it is not
        withdrawn: the caller has settled it. Returns it, or None."""
        if place is not None and self._places.get(key) is not place:
            return None
        place = self._places.pop(key, None)
        if place is not None and place.timer is not None:
            place.timer.cancel()
            place.timer = None
        return place

    def clear(self) -> list[tuple[K, P]]:
        """Stop keeping every place (timers cancelled); returns them."""
        out = list(self._places.items())
        for key, _ in out:
            self.discard(key)
        return out

    def _arm(self, key: K, place: P, delay: float) -> None:
        if place.timer is not None:
            place.timer.cancel()
        place.timer = asyncio.get_running_loop().call_later(max(0.0, delay), self._due, key, place)

    def _due(self, key: K, place: P) -> None:
        place.timer = None
        if self._places.get(key) is not place:
            return
        left = place.until - self._clock()
        if place.busy():
            self._arm(key, place, max(left, RECHECK_S))
        elif left > 0:
            self._arm(key, place, left)
        else:
            del self._places[key]
            self._on_expire(key, place)
