"""What a refusal says when a pool is in its restart grace period: one sentence, the same from
the core, the FastAPI integration, the service, the broker, the SDK and the CLI.

After Redis lost a pool's data (a restart without it), the pool is made again with a grace
period of one ``max_ttl``: nothing new is granted until it ends, while the holders of leases
from before put them back (docs/SEMANTICS.md, "Redis loses its data"). A request refused or
timed out then is not short of memory, and its answer must not look like it is.
"""

from __future__ import annotations

import math
import time
from typing import Optional

__all__ = ["grace_note", "grace_outlasts"]


def grace_note(pool: str, left: float, *, now: Optional[float] = None) -> str:
    """``pool 'gpu0' is in its restart grace period until 12:00:41 UTC (37 s more): Redis lost
    its data, and the leases from before are being put back; nothing new is granted until it
    ends``. ``left``: seconds left in the grace period (> 0); ``now``: the Unix time it is
    counted from (default: now). The end is shown on the local host's clock, in UTC."""
    end = (time.time() if now is None else now) + left
    return (
        f"pool {pool!r} is in its restart grace period until "
        f"{time.strftime('%H:%M:%S', time.gmtime(end))} UTC ({math.ceil(left)} s more): Redis "
        f"lost its data, and the leases from before are being put back; nothing new is "
        f"granted until it ends"
    )


def grace_outlasts(grace_left: float, deadline_in: Optional[float]) -> bool:
    """Whether a request that is not granted now would wait for nothing: the pool is in its
    grace period, ``grace_left`` seconds from now (> 0), and the request gives up
    ``deadline_in`` seconds from the same instant (None: never), before the grace period ends.
    Nothing is granted until then, so such a wait could only time out: the request leaves the
    queue at once instead, told to come back at the grace period's end. The one rule every
    surface follows (the pool objects' acquire, so the FastAPI integration and the service;
    the broker's long poll). No I/O."""
    return grace_left > 0 and deadline_in is not None and deadline_in < grace_left
