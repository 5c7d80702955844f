"""A pure-Python model of preemption's ask (docs/SEMANTICS.md, "Preemption"; lua/lib.lua
ask_yield) on top of the queue model (:mod:`support.priority_model`): which holders the request
at the head of the queue asks to yield, and each one's deadline.

The rule: only the head (the first of the queue, a growth never) asks, outside a grace period
(the model has none) and only when its tenant's quota does not hold it back (quota_check 'ok').
Candidates are the leases with a preemption field (acquired preemptible, not resident: the
model has no resident lease) not asked yet whose priority + gap <= the head's priority.
Pending = bytes of the leases asked and not gone. need = amount - free - pending (on several
devices, per device: the larger of that and amount - the device's free bytes - the bytes asked
on it; any device that needs nothing means none is asked). The candidates are picked in order
(priority ascending, acquired_ms descending, lease id ascending) until they cover need, then an
earlier pick the later ones make unnecessary is dropped; a request for any device takes the
device with the fewest picks (the lowest index on a tie). None when even all would not do.
Deadline = max(now + yield grace, the lease's expiry now).

The scripts ask after every hand-off (the model's :meth:`PreemptModel.hand_off`: release,
cancel, configure, renew, a resize's) and in acquire when the request is queued (or refreshed)
at position 1; the model does the same. Times are server ms as the scripts reported them."""

from __future__ import annotations

from dataclasses import dataclass, field

from support.priority_model import QueueModel


@dataclass
class Request:
    """What a request needs beyond the queue model's entry: its lease id, priority, ttl (ms)
    and whether its lease may be asked to yield."""

    lid: str
    priority: int
    ttl_ms: int
    preemptible: bool = True


@dataclass
class PreemptModel(QueueModel):
    """:class:`QueueModel` plus the preemption setting ``spec`` ((gap, yield_grace_ms) or None:
    off) and, per held ticket, what the ask reads: its request, the ms of its grant, its
    expiry, and (once asked) (asked_ms, deadline_ms)."""

    spec: tuple[int, int] | None = None
    requests: dict[str, Request] = field(default_factory=dict)  # every ticket seen
    acquired: dict[str, int] = field(default_factory=dict)  # held ticket -> grant ms
    expiry: dict[str, int] = field(default_factory=dict)  # held ticket -> expiry ms
    asked: dict[str, tuple[int, int]] = field(default_factory=dict)  # held -> (asked, deadline)
    asked_total: int = 0  # y_asked
    _now: int = 0

    # -- hooks into the queue model ------------------------------------------------------

    def _grant(self, t: str, amount: int, tenant: str, dev: int, place: int) -> None:
        if t not in self.grows:
            self.acquired[t] = self._now
            self.expiry[t] = self._now + self.requests[t].ttl_ms
        super()._grant(t, amount, tenant, dev, place)

    def hand_off(self, now_ms: int) -> list[str]:
        """The queue model's hand-off, then the ask (lua/lib.lua grant_head)."""
        self._now = now_ms
        out = super().hand_off(now_ms)
        self.ask(now_ms)
        return out

    def release(self, ticket: str, now_ms: int) -> list[str]:
        for d in (self.acquired, self.expiry, self.asked):
            d.pop(ticket, None)
        return super().release(ticket, now_ms)

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
        """acquire.lua: the queue model's outcome ('granted', 'queued', 'refused', 'quota');
        a request queued at position 1 asks."""
        self.requests[ticket] = req
        self._now = now_ms
        out = self.acquire(ticket, amount, req.priority, now_ms, mode, tenant, pin)
        if out == "queued" and self.order()[0] == ticket:
            self.ask(now_ms)
        return out

    def refresh(self, ticket: str, now_ms: int) -> int:
        """acquire.lua again for a queued ticket: its position; at position 1 it asks."""
        pos = self.order().index(ticket) + 1
        if pos == 1:
            self.ask(now_ms)
        return pos

    def resize(self, t: str, g: str, amount: int, priority: int, now_ms: int, mode: str) -> str:
        """resize.lua: a lease asked to yield may not grow ('asked', an error that changes
        nothing); a resize answered 'granted' renews the lease (its ttl from now), never past
        its yield deadline."""
        if t in self.asked and t in self.held and amount > self.held[t]:
            return "asked"
        got = super().resize(t, g, amount, priority, now_ms, mode)
        if got == "granted" and t in self.held:
            exp = now_ms + self.requests[t].ttl_ms
            if t in self.asked:
                exp = min(exp, self.asked[t][1])
            self.expiry[t] = exp
        return got

    def renew(self, leases: list[tuple[str, int]], now_ms: int) -> list[tuple[int, int]]:
        """renew.lua for (ticket, ttl_ms) pairs: its hand-off (and ask), then per lease (new
        expiry, yield deadline): (0, 0) when not held; the expiry capped at the deadline."""
        self.hand_off(now_ms)
        out = []
        for t, ttl in leases:
            if t not in self.held:
                out.append((0, 0))
                continue
            exp = now_ms + ttl
            dl = self.asked[t][1] if t in self.asked else 0
            if dl:
                exp = min(exp, dl)
            self.expiry[t] = exp
            out.append((exp, dl))
        return out

    def configure(self, now_ms: int, spec: tuple[int, int] | None | str = "") -> list[str]:
        """configure.lua: ``spec`` a new setting (None: off; '': unchanged), then its
        hand-off (and ask)."""
        if spec != "":
            self.spec = spec  # type: ignore[assignment]
        return self.hand_off(now_ms)

    # -- the rule --------------------------------------------------------------------------

    def ask(self, now_ms: int) -> list[str]:
        """lua/lib.lua ask_yield at server time ``now_ms``: the held tickets asked now (also
        recorded with their deadlines)."""
        if self.spec is None or not self.queue:
            return []
        gap, grace = self.spec
        head = self.order()[0]
        _, amount, _, tenant, pin = self.queue[head]
        if head in self.grows or self.quota_check(tenant, amount) != "ok":
            return []
        prio = self.requests[head].priority
        need_pool = amount - (self.capacity - self.used)
        if need_pool <= 0 and (not self.dcap or self.place(amount, pin) is not None):
            return []
        pend, pend_dev = 0, {}
        cands = []
        for t, a in self.held.items():
            if not self.requests[t].preemptible:
                continue
            dv = self.dev_of.get(t, 0)
            if t in self.asked:
                pend += a
                pend_dev[dv] = pend_dev.get(dv, 0) + a
            elif self.requests[t].priority + gap <= prio:
                cands.append(
                    (self.requests[t].priority, -self.acquired[t], self.requests[t].lid, t)
                )
        if not cands:
            return []
        cands.sort()
        need_pool -= pend
        devs = [0] if not self.dcap else [i for i in range(len(self.dcap)) if pin in (None, i)]
        best: list[str] | None = None
        for i in devs:
            need = need_pool
            if self.dcap:
                free = self.dcap[i] - self.dused(i)
                need = max(need, amount - free - pend_dev.get(i, 0))
            if need <= 0:
                return []  # enough is on its way already
            picked, total = [], 0
            for c in cands:
                if total >= need:
                    break
                if not self.dcap or self.dev_of.get(c[3], 0) == i:
                    picked.append(c[3])
                    total += self.held[c[3]]
            if total < need:
                continue
            kept = []
            for k, t in enumerate(picked):  # drop an earlier pick the later ones make unnecessary
                if k < len(picked) - 1 and total - self.held[t] >= need:
                    total -= self.held[t]
                else:
                    kept.append(t)
            if best is None or len(kept) < len(best):
                best = kept
        for t in best or []:
            self.asked[t] = (now_ms, max(now_ms + grace, self.expiry[t]))
        self.asked_total += len(best or [])
        return best or []
