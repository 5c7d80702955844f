"""How long a queued request will wait: from the pool's drain rate and the bytes ahead of it.

No I/O. The rate is measured by the server (lib.lua "Drain rate"): how fast the queue was
drained while it was busy, in bytes and in grants per second of busy time, decayed over
``TAU`` (30 s) of it. The scripts that answer a waiter (acquire.lua, renew.lua, status.lua)
supply the inputs and this module turns them into seconds: one rule, whatever the surface.

The rule (:func:`wait_seconds`), for a waiter at 1-based ``position`` needing ``amount`` bytes,
with ``ahead_bytes`` bytes of waiters ahead of it in queue order and ``free_bytes`` free now::

    deficit = max(0, ahead_bytes + amount - free_bytes)       bytes that must be released first
    seconds = grace_left + max(deficit / bytes_per_s, position / grants_per_s)

The bytes term is the fluid view: the queue moves as fast as bytes are given back, and
everything ahead of the waiter plus the waiter itself must fit. The grants term is the
discrete view: releases come whole, so the waiter at ``position`` waits at least for
``position`` grants (its own included) at the pool's grant rate; it is also the answer when
the bytes would fit now but the waiter still waits (a grace period, a pinned device, a
tenant's quota, a resident reservation). Taking the larger keeps the rule continuous and
monotone: never smaller for more bytes ahead, a larger amount, a later position or fewer
free bytes. ``grace_left``: seconds left in the pool's restart grace period, in which nothing
is granted; the queue starts to move when it ends.

What it cannot know: when holders will actually release (it assumes the recent rate goes on),
requests of a higher priority that arrive later and queue ahead, waiters ahead that give up,
and device reports that change the free bytes. docs/SEMANTICS.md "Wait estimate" has the
rule, and docs/BENCHMARKS.md its measured error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpulock.errors import InvalidArgument

__all__ = ["DrainRate", "wait_seconds", "wait_seconds_at_tail"]


@dataclass(frozen=True)
class DrainRate:
    """How fast a pool's queue drains while it is busy: ``bytes_per_s`` bytes and
    ``grants_per_s`` grants per second (both finite and > 0; :class:`InvalidArgument`
    otherwise). A pool whose rate is not measured yet has none (None), not a zero rate."""

    bytes_per_s: float
    grants_per_s: float

    def __post_init__(self) -> None:
        for name in ("bytes_per_s", "grants_per_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise InvalidArgument(f"{name} must be a finite number > 0, got {v!r}")

    @classmethod
    def from_wire(cls, bytes_per_s: int, grants_per_ks: int) -> DrainRate | None:
        """The rate as the Lua scripts reply it: ``bytes_per_s`` (bytes per second, an
        integer) and ``grants_per_ks`` (grants per 1000 seconds, an integer); None when
        either is 0 or less (not measured yet)."""
        b, g = int(bytes_per_s), int(grants_per_ks)
        if b <= 0 or g <= 0:
            return None
        return cls(bytes_per_s=float(b), grants_per_s=g / 1000.0)


def wait_seconds(
    *,
    ahead_bytes: int,
    amount: int,
    free_bytes: int,
    position: int,
    rate: DrainRate | None,
    grace_left: float = 0.0,
) -> float | None:
    """Estimated seconds until a waiter is granted (module docstring, "The rule").

    ``ahead_bytes``: bytes of the waiters ahead of it in queue order (>= 0); ``amount``: its
    bytes; ``free_bytes``: bytes free in the pool now (capacity - used - held back by a device
    report; may be 0 or, on a pool over its effective capacity, negative); ``position``: its
    1-based place in the queue (values below 1 count as 1); ``rate``: the pool's
    :class:`DrainRate`; ``grace_left``: seconds left in the pool's grace period (0 outside
    one; negative counts as 0). Returns seconds (>= 0, finite), or None when ``rate`` is None.
    """
    if rate is None:
        return None
    deficit = max(0, int(ahead_bytes) + int(amount) - int(free_bytes))
    places = max(1, int(position))
    drain = max(deficit / rate.bytes_per_s, places / rate.grants_per_s)
    return max(0.0, float(grace_left)) + drain


def wait_seconds_at_tail(
    *,
    queued_bytes: int,
    queue_length: int,
    amount: int,
    free_bytes: int,
    rate: DrainRate | None,
    grace_left: float = 0.0,
) -> float | None:
    """Estimated seconds a request that is not queued would wait if it joined the queue's
    tail now: :func:`wait_seconds` with every queued byte ahead of it (``queued_bytes``, the
    amounts of the ``queue_length`` waiters) at position ``queue_length + 1``. A request of a
    higher priority would queue further ahead, so for it this is an upper bound."""
    return wait_seconds(
        ahead_bytes=queued_bytes,
        amount=amount,
        free_bytes=free_bytes,
        position=max(0, int(queue_length)) + 1,
        rate=rate,
        grace_left=grace_left,
    )
