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

__all__ = ["grace_note"]


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
