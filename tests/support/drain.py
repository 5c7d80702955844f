"""A pool with a measured drain rate (docs/SEMANTICS.md, "Wait estimate"), for the tests of the
surfaces that show the wait estimate: a queue of waiters behind a holder, drained, through the
core's sync :class:`gpulock.Pool` on threads.

Only lower bounds on time are used (each holder keeps its lease at least a known time), never
how fast the machine is: every wait is on observed state."""

from __future__ import annotations

import threading
import time
from typing import Any

from gpulock import Pool
from support.waiting import wait_until

HOLD = 0.1  # seconds each waiter keeps its lease after its grant
FIRST_HOLD = 0.3  # seconds the holder keeps its lease once the queue formed


def queue_behind(pool: Pool, unit: int, n: int, *, hold: float = HOLD) -> list[threading.Thread]:
    """``n`` threads that each acquire ``unit`` bytes (queued, in this order: each starts only
    once the one before it queued), keep the lease ``hold`` seconds and release it."""
    threads = []
    for _ in range(n):
        queued = threading.Event()

        def one(queued: threading.Event = queued) -> None:
            lease = pool.acquire(unit, timeout=120, on_queued=lambda place: queued.set())
            time.sleep(hold)  # a lower bound on the busy time, not a wait for state
            lease.release()

        t = threading.Thread(target=one, daemon=True)
        t.start()
        threads.append(t)
        wait_until(queued.is_set, 60, "the acquire to queue")
    return threads


def measure_drain(pool: Pool, unit: int, n: int = 3) -> Any:
    """Drain a queue of ``n`` waiters of ``unit`` bytes (the pool's capacity) behind a holder;
    returns the pool's measured :class:`gpulock.estimates.wait.DrainRate`."""
    holder = pool.acquire(unit)
    threads = queue_behind(pool, unit, n)
    time.sleep(FIRST_HOLD)  # a lower bound on the busy time, not a wait for state
    holder.release()
    for t in threads:
        t.join(240)
        assert not t.is_alive(), "a waiter of the drained queue never got its lease"
    drain = pool.status().drain
    assert drain is not None, "a drained queue measures the pool's drain rate"
    return drain
