"""Giving kept bytes back (:mod:`gpulock.protocol.keep`, docs/SEMANTICS.md "Kept bytes"): the
runtime's side. The server tells a holder of kept leases on its hand-off channel the moment a
request does not fit (a ``k`` message), and a renewal's reply shows the queue; either way the
idle kept leases are released in the runtime's loop, and the pool object stops granting from
kept bytes until the server next answers "kept". Idle kept leases past the pool object's
``keep`` seconds are released at the heartbeat's ticks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from gpulock.protocol.lease import LeaseState
from gpulock.runtime.shared import Shared

log = logging.getLogger("gpulock")


class KeptBack:
    """Releases the kept leases of the pool object of ``shared`` that it gives back."""

    def __init__(self, shared: Shared):
        self._shared = shared
        self.kept = shared.kept

    def wanted_back(self) -> None:
        """Someone waits (a ``k`` message, or a renewal's reply saw a queue or a grace
        period): stop granting from kept bytes and release the idle ones, in the background.
        Safe from any thread; nothing to do when the pool object keeps nothing."""
        if not self.kept.idle_count and self.kept.draining:
            return
        self.release_soon(self.kept.give_back(drain=True))

    def expire(self) -> None:
        """Release (in the background) the idle kept leases idle for ``keep`` seconds, lost,
        or soon lost. Called in the loop at the heartbeat's ticks."""
        if self.kept.idle_count:
            self.release_soon(self.kept.expired())

    def release_soon(self, states: Sequence[LeaseState]) -> None:
        """Release ``states`` (idle kept leases taken out of the keeper) in the loop, thread-
        safely; when there is no loop (closed), they expire on the server."""
        if not states:
            return
        try:
            self._shared.tasks.in_loop(
                lambda: self._shared.tasks.spawn(self.release_now(list(states)))
            )
        except RuntimeError:
            pass  # no loop: they expire after their ttl

    async def release_now(self, states: Sequence[LeaseState]) -> None:
        """Release ``states`` in Redis together (one pipeline where the client batches), best
        effort: a release that fails leaves the lease to expire after its ttl."""
        sh = self._shared
        calls = []
        for s in states:
            s.released = True
            if sh.leases.get(s.lease_id) is s:
                sh.leases.drop(s.lease_id)
            calls.append(sh.calls.eval("release", [s.lease_id, str(s.token)]))
        for r in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            if isinstance(r, Exception):
                log.debug("gpulock: pool %s: a kept lease's release failed: %s", sh.pool, r)
