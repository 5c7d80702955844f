"""The FIFO of one pool object's long-polled acquires for its wait connections (see
``_core``: an acquire takes a slot before its first request and holds it to its end)."""

from __future__ import annotations

import threading
from collections import deque
from typing import Deque, Protocol

from .errors import InvalidArgument


class Waker(Protocol):
    def wake(self) -> bool:
        """Hand this waiter a slot; False if it stopped waiting (the slot goes to the next)."""


class Gate:
    """FIFO of one pool object's long-polled acquires for its ``slots`` wait connections.

    An acquire enters before its first request and leaves when it ends (granted, timed out,
    failed, interrupted), so it keeps its connection across its long polls and keeps its place
    in the broker's queue. When all slots are taken, ``enter`` queues the waiter; ``leave``
    hands the slot to the first waiter still waiting. Thread-safe and I/O-free: the driver
    blocks on its own waiter (an Event, a Future) and ``withdraw``s it when it stops waiting;
    after ``withdraw`` the waiter holds a slot exactly if it was woken."""

    def __init__(self, slots: int):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise InvalidArgument(f"max_connections must be a whole number >= 1, not {slots!r}")
        self.slots = slots
        self._free = slots
        self._queue: Deque[Waker] = deque()
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        """Acquires waiting in this process for a wait connection."""
        return len(self._queue)

    @property
    def in_use(self) -> int:
        return self.slots - self._free

    def enter(self, waiter: Waker) -> bool:
        """True: a slot is taken at once. False: the waiter is queued (wait for its wake)."""
        with self._lock:
            if self._free > 0 and not self._queue:
                self._free -= 1
                return True
            self._queue.append(waiter)
            return False

    def withdraw(self, waiter: Waker) -> None:
        with self._lock:
            try:
                self._queue.remove(waiter)
            except ValueError:
                pass  # woken already (it holds a slot), or never queued

    def leave(self) -> None:
        with self._lock:
            while self._queue:
                if self._queue.popleft().wake():
                    return
            self._free += 1
