"""A pure-Python model of kept bytes (docs/SEMANTICS.md, "Kept bytes"; lua/lib.lua kept_drop,
tell_kept; release.lua's 'keep' mode) on top of the preemption model
(:mod:`support.preempt_model`): which leases the pool lists as kept, and whom a request that
does not fit tells to give them back.

The rules:

* A release in 'keep' mode (ARGV 3 'keep', ARGV 4 the holder's channel) of a held lease keeps
  it when nobody waits (the queue, growths included, is empty), the pool is not in a grace
  period (the model has none), the lease is not resident (the model has none) and it is not
  asked to yield: the lease stays as it was, it is appended to the kept list once (a second
  'keep' release of a kept lease leaves the list as it is), and k_kept counts 1. Otherwise
  it is an ordinary release.
* Any end of a lease (release, cancel) drops it from the kept list.
* An acquire that does not fit (queued, refreshed at its place, refused in 'try' mode) and a
  growth that queues tell every holder of a kept lease: one message per channel naming its
  kept leases in list order; k_told counts the leases named.

Times are server ms as the scripts reported them."""

from __future__ import annotations

from dataclasses import dataclass, field

from support.preempt_model import PreemptModel, Request


@dataclass
class KeepModel(PreemptModel):
    """:class:`PreemptModel` plus the kept list (held ticket, channel) in the order the
    scripts keep it, the counters, and the messages the last call sent."""

    kept: list[tuple[str, str]] = field(default_factory=list)
    k_kept: int = 0
    k_told: int = 0
    told: dict[str, list[str]] = field(default_factory=dict)  # channel -> tickets, last call

    def _drop(self, ticket: str) -> None:
        self.kept = [(t, c) for t, c in self.kept if t != ticket]

    def tell(self) -> None:
        """lua/lib.lua tell_kept: the messages of this call (by channel), counted."""
        for t, chan in self.kept:
            self.told.setdefault(chan, []).append(t)
        self.k_told += len(self.kept)

    # -- the scripts' calls ----------------------------------------------------------------

    def take(
        self,
        ticket: str,
        req: Request,
        amount: int,
        now_ms: int,
        mode: str,
        tenant: str = "",
        pin: int | None = None,
    ) -> str:
        self.told = {}
        out = super().take(ticket, req, amount, now_ms, mode, tenant, pin)
        if out in ("queued", "refused"):
            self.tell()
        return out

    def refresh(self, ticket: str, now_ms: int) -> int:
        self.told = {}
        pos = super().refresh(ticket, now_ms)
        self.tell()
        return pos

    def resize(self, t: str, g: str, amount: int, priority: int, now_ms: int, mode: str) -> str:
        self.told = {}
        out = super().resize(t, g, amount, priority, now_ms, mode)
        if out in ("queued", "refused"):
            self.tell()
        return out

    def release(self, ticket: str, now_ms: int) -> list[str]:
        self.told = {}
        self._drop(ticket)
        return super().release(ticket, now_ms)

    def cancel(self, ticket: str, now_ms: int) -> list[str]:
        self.told = {}
        self._drop(ticket)
        return super().cancel(ticket, now_ms)

    def release_keep(self, ticket: str, chan: str, now_ms: int) -> str:
        """release.lua in 'keep' mode of held ``ticket`` by the holder of channel ``chan``:
        'kept' (nothing changes but the list and k_kept) or 'released' (its hand-off ran)."""
        self.told = {}
        self._now = now_ms
        if not self.queue and ticket not in self.asked:
            if ticket not in [t for t, _ in self.kept]:
                self.kept.append((ticket, chan))
            self.k_kept += 1
            return "kept"
        self.release(ticket, now_ms)
        return "released"

    def kept_bytes(self) -> int:
        return sum(self.held[t] for t, _ in self.kept)
