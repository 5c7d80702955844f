"""How long a queued request will wait: from the pool's drain rate and the waiters ahead of it.

No I/O. The rate is measured by the server (lib.lua "Drain rate"): how fast the queue was
drained while it was busy, in bytes and in grants per second of busy time, and the share of
those grants that went out of arrival order, decayed over ``TAU`` (30 s) of it. The scripts
that answer a waiter (acquire.lua, resize.lua, renew.lua, status.lua) supply the inputs, the
bytes and the count of the waiters ahead of it among them (lib.lua ``ahead_of``, the one place
they are counted), and this module turns them into seconds: one rule, whatever the surface.

The rule (:func:`wait_seconds`), for a waiter at 1-based ``position`` needing ``amount`` bytes,
with ``ahead_bytes`` bytes of the ``ahead_count`` waiters that will be granted before it and
``free_bytes`` free now::

    deficit = max(0, ahead_bytes + amount - free_bytes)     bytes that must be released first
    places  = ahead_count + 1                               (position without a count)
    seconds = grace_left + stretch * max(deficit / bytes_per_s, places / grants_per_s)
    stretch = 1 / (1 - min(out_of_order, MAX_OUT_OF_ORDER))

The bytes term is the fluid view: the queue moves as fast as bytes are given back, and
everything ahead of the waiter plus the waiter itself must fit. The grants term is the
discrete view: releases come whole, so the waiter waits at least for ``places`` grants (its
own included) at the pool's grant rate; it is also the answer when the bytes would fit now but
the waiter still waits (a grace period, a pinned device, a tenant's quota, a resident
reservation). Taking the larger keeps the rule continuous and monotone: never smaller for
more bytes ahead, more waiters ahead, a larger amount, a later position, a larger
out-of-order share or fewer free bytes. ``grace_left``: seconds left in the pool's restart
grace period, in which nothing is granted; the queue starts to move when it ends.

Who is ahead: the waiters before it in queue order, less those it passes: under backfill
(while the head's window is open) the larger ones, and on a pool with quotas those of another
tenant at its quota. The stretch: a share ``out_of_order`` of the queue's grants passed
someone (a priority, a backfill, a quota); a waiter that may be passed waits longer than the
grants before it take. The share counts at most ``MAX_OUT_OF_ORDER`` (1/3, a stretch of at most
1.5), as not every such grant passes a given waiter; on a FIFO pool of one priority and no
quotas it is 0 and the rule is the plain FIFO one.

What it cannot know: when holders will actually release (it assumes the recent rate goes on),
which waiter a given out-of-order grant passes (the stretch is one pool-wide factor: too long
for those that pass, such as a high priority or the smallest under backfill, where they are
not already near the head), requests of a higher priority that arrive later and queue ahead,
waiters ahead that give up, which device's bytes are free on a pool of several devices, and
device reports that change the free bytes. docs/SEMANTICS.md "Wait estimate" has the rule, and
docs/BENCHMARKS.md (12.2) its measured error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpulock.errors import InvalidArgument

__all__ = ["MAX_OUT_OF_ORDER", "DrainRate", "wait_seconds", "wait_seconds_at_tail"]

# The largest share of out-of-order grants the rule stretches by (so by at most 1.5x): a share
# measured over a few grants can be near 1 and the rule must stay finite; and a waiter is not
# passed by every grant that passes someone (docs/BENCHMARKS.md 12.2: a larger cap made the
# passed waiters' estimates too long under backfill and quotas).
MAX_OUT_OF_ORDER = 1 / 3


@dataclass(frozen=True)
class DrainRate:
    """How fast a pool's queue drains while it is busy: ``bytes_per_s`` bytes and
    ``grants_per_s`` grants per second (both finite and > 0; :class:`InvalidArgument`
    otherwise). A pool whose rate is not measured yet has none (None), not a zero rate."""

    bytes_per_s: float
    grants_per_s: float
    # The share of those grants that went out of arrival order (a later arrival granted while
    # an earlier one still waited: priorities, backfill, quotas), in [0, 1]; 0 on a FIFO pool
    # of one priority and no quotas.
    out_of_order: float = 0.0

    def __post_init__(self) -> None:
        for name in ("bytes_per_s", "grants_per_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise InvalidArgument(f"{name} must be a finite number > 0, got {v!r}")
        o = self.out_of_order
        if not isinstance(o, (int, float)) or not 0 <= o <= 1:
            raise InvalidArgument(f"out_of_order must be a number in [0, 1], got {o!r}")

    @property
    def stretch(self) -> float:
        """The factor the rule stretches a wait by for the grants that pass a waiter:
        ``1 / (1 - min(out_of_order, MAX_OUT_OF_ORDER))``, in [1, 1.5]."""
        return 1.0 / (1.0 - min(float(self.out_of_order), MAX_OUT_OF_ORDER))

    @classmethod
    def from_wire(
        cls, bytes_per_s: int, grants_per_ks: int, out_of_order_pm: int = 0
    ) -> DrainRate | None:
        """The rate as the Lua scripts reply it: ``bytes_per_s`` (bytes per second, an
        integer), ``grants_per_ks`` (grants per 1000 seconds, an integer) and
        ``out_of_order_pm`` (per mille of the grants out of arrival order, clamped to
        [0, 1000]); None when either of the first two is 0 or less (not measured yet)."""
        b, g = int(bytes_per_s), int(grants_per_ks)
        if b <= 0 or g <= 0:
            return None
        o = min(1000, max(0, int(out_of_order_pm))) / 1000.0
        return cls(bytes_per_s=float(b), grants_per_s=g / 1000.0, out_of_order=o)


def wait_seconds(
    *,
    ahead_bytes: int,
    amount: int,
    free_bytes: int,
    position: int,
    rate: DrainRate | None,
    grace_left: float = 0.0,
    ahead_count: int | None = None,
) -> float | None:
    """Estimated seconds until a waiter is granted (module docstring, "The rule").

    ``ahead_bytes``: bytes of the waiters ahead of it in queue order (>= 0); ``amount``: its
    bytes; ``free_bytes``: bytes free in the pool now (capacity - used - held back by a device
    report; may be 0 or, on a pool over its effective capacity, negative); ``position``: its
    1-based place in the queue (values below 1 count as 1); ``rate``: the pool's
    :class:`DrainRate`; ``grace_left``: seconds left in the pool's grace period (0 outside
    one; negative counts as 0); ``ahead_count``: how many waiters ahead of it will be granted
    before it (the scripts' count, those ``ahead_bytes`` sums; None: ``position - 1``, every
    one). Returns seconds (>= 0, finite), or None when ``rate`` is None.
    """
    if rate is None:
        return None
    deficit = max(0, int(ahead_bytes) + int(amount) - int(free_bytes))
    places = max(1, int(position) if ahead_count is None else int(ahead_count) + 1)
    drain = max(deficit / rate.bytes_per_s, places / rate.grants_per_s)
    return max(0.0, float(grace_left)) + drain * rate.stretch


def wait_seconds_at_tail(
    *,
    queued_bytes: int,
    queue_length: int,
    amount: int,
    free_bytes: int,
    rate: DrainRate | None,
    grace_left: float = 0.0,
    ahead_count: int | None = None,
) -> float | None:
    """Estimated seconds a request that is not queued would wait if it joined the queue's
    tail now: :func:`wait_seconds` at position ``queue_length + 1`` behind ``queued_bytes``,
    the bytes of those of the ``queue_length`` waiters that would be ahead of it (every one,
    or as the scripts count them, ``ahead_count`` of them). A request of a higher priority
    would queue further ahead, so for it this is an upper bound."""
    return wait_seconds(
        ahead_bytes=queued_bytes,
        amount=amount,
        free_bytes=free_bytes,
        position=max(0, int(queue_length)) + 1,
        rate=rate,
        grace_left=grace_left,
        ahead_count=ahead_count,
    )
