"""A small pure-Python model of the queue policies the scripts implement (docs/SEMANTICS.md,
"Priorities", "Backfill", "Tenant quotas", "Devices and placement" and "Resizing a lease"):
one pool of one or several devices, bytes, order by queue score,
hand-off of the longest prefix that fits (passing over waiters whose tenant is at its quota)
and, under backfill while the head's window is open, of later requests that fit. On several
devices a request fits when the pool's bytes fit it and a device has room (its pinned one, or
the one the placement rule picks). A lease resizes: a shrink hands its bytes on, a growth is
a request of the difference at the lease's tenant and device, ordered at its lease's place
(the queue score of the request the lease was granted to; for a lease granted at once to an
empty queue, that of a request of its priority arriving just before the millisecond of its
grant): granted at once if it fits and would be ahead of the queue's front, else queued as a
growth waiter (ticket ``grow:<lease id>``) at that score; when waiters are left after a hand-off,
the growths of a stuck device (no lease on it may free bytes) that fit are granted ahead of
them; a growth that would leave its device stuck with none fitting is refused (the deadlock
rule). The scripts' decisions must equal this model's on any history (tests/integration/
test_priority.py drives both with the same calls and compares).

Times are the server's milliseconds as the scripts reported them (the model takes ``now_ms``
from each reply, so it needs no clock of its own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from gpulock.protocol.args import AGING_S

AGING_US = int(AGING_S * 1_000_000)
BACKFILL_DEPTH = 32  # lua/lib.lua
QUOTA_DEPTH = 32  # lua/lib.lua


@dataclass
class QueueModel:
    capacity: int
    policy: str = "fifo"
    backfill_ms: int = 2000
    used: int = 0
    qvt: int = 0  # the last arrival, virtual µs
    # ticket -> (score, amount, enqueued_ms, tenant, pinned device or None)
    queue: dict[str, tuple[int, int, int, str, int | None]] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)  # ticket -> amount
    quotas: dict[str, int] = field(default_factory=dict)  # tenant -> bytes
    tenant_of: dict[str, str] = field(default_factory=dict)  # held ticket -> tenant
    dcap: list[int] = field(default_factory=list)  # per device; [] : one device (capacity)
    placement: str = "bestfit"
    dev_of: dict[str, int] = field(default_factory=dict)  # held ticket -> device
    # queued growth ticket ("grow:<lease id>") -> the held ticket of its lease (the queue
    # entry's amount is the difference, its device the lease's)
    grows: dict[str, str] = field(default_factory=dict)
    # held ticket -> its lease's place: the queue score its growths get (lua/lib.lua lease_place)
    places: dict[str, int] = field(default_factory=dict)

    def dused(self, i: int) -> int:
        return sum(a for t, a in self.held.items() if self.dev_of.get(t, 0) == i)

    def place(self, amount: int, pin: int | None) -> int | None:
        """The device a request gets now (lua/lib.lua place), or None."""
        caps = self.dcap or [self.capacity]
        if pin is not None:
            return pin if self.dused(pin) + amount <= caps[pin] else None
        free = [(c - self.dused(i), i) for i, c in enumerate(caps) if c - self.dused(i) >= amount]
        if not free:
            return None
        if self.placement == "spread":
            return min(free, key=lambda f: (-f[0], f[1]))[1]
        return min(free)[1]

    def largest(self, pin: int | None) -> int:
        caps = self.dcap or [self.capacity]
        return caps[pin] if pin is not None else max(caps)

    def score(self, now_ms: int, priority: int) -> tuple[int, int]:
        vt = max(now_ms * 1000, self.qvt + 1)
        return vt - priority * AGING_US, vt

    def order(self) -> list[str]:
        """Queued tickets, head first (equal scores by ticket, as a Redis sorted set)."""
        return sorted(self.queue, key=lambda t: (self.queue[t][0], t))

    def tenant_used(self, tenant: str) -> int:
        return sum(a for t, a in self.held.items() if self.tenant_of.get(t) == tenant)

    def quota_check(self, tenant: str, amount: int) -> str:
        """'ok', 'wait' (the tenant holds too much now) or 'never' (over its quota)."""
        q = self.quotas.get(tenant, 0) if tenant else 0
        if not q:
            return "ok"
        if amount > q:
            return "never"
        return "wait" if self.tenant_used(tenant) + amount > q else "ok"

    def front(self) -> tuple[str | None, dict[str, int]]:
        """The first waiter not passed over (at most QUOTA_DEPTH deep), and the tenants passed
        over before it with the score of each one's first waiter passed over."""
        passed: dict[str, int] = {}
        for t in self.order()[:QUOTA_DEPTH]:
            score, amount, _, tenant, _ = self.queue[t]
            q = self.quota_check(tenant, amount)
            if q == "ok" and tenant not in passed:
                return t, passed
            if q != "never" and tenant not in passed:
                passed[tenant] = score
        return None, passed

    def _grant(self, t: str, amount: int, tenant: str, dev: int, place: int) -> None:
        """Waiter ``t`` is granted: a new lease (its place ``place``), or, for a growth,
        ``amount`` more bytes for its lease."""
        self.used += amount
        if t in self.grows:
            self.held[self.grows.pop(t)] += amount
            return
        self.held[t] = amount
        self.places[t] = place
        self.tenant_of[t] = tenant
        self.dev_of[t] = dev

    def _dequeue(self, t: str) -> None:
        del self.queue[t]
        self.grows.pop(t, None)

    def _grant_test(
        self,
        amount: int,
        priority: int,
        now_ms: int,
        tenant: str,
        pin: int | None,
        place: int | None = None,
    ) -> tuple[int | None, int, int]:
        """lua/lib.lua grant_test: the device a request is granted on now (None: it is not),
        and its queue score and arrival; a growth's score is its lease's ``place``."""
        score, vt = self.score(now_ms, priority)
        if place is not None:
            score = place
        fits = self.used + amount <= self.capacity and self.quota_check(tenant, amount) == "ok"
        dev = self.place(amount, pin) if fits else None
        fits = dev is not None
        f, passed = self.front()
        ahead = f is None or score < self.queue[f][0]
        if tenant in passed and passed[tenant] < score:
            fits = False  # a tenant's own waiters keep their order
        if fits and f is not None and not ahead:
            ahead = self.backfill_open(now_ms, self.queue[f][2])
        return (dev if ahead and fits else None), score, vt

    def acquire(
        self,
        ticket: str,
        amount: int,
        priority: int,
        now_ms: int,
        mode: str,
        tenant: str = "",
        pin: int | None = None,
    ) -> str:
        """'granted', 'queued', 'refused' (mode 'try' that could not be granted) or 'quota'
        (the amount exceeds the tenant's quota: an error, nothing changes)."""
        assert amount <= self.largest(pin)
        if self.quota_check(tenant, amount) == "never":
            return "quota"
        dev, score, vt = self._grant_test(amount, priority, now_ms, tenant, pin)
        if dev is not None:
            # its place: its score when others waited, else a request's of its priority just
            # before its grant's millisecond (lua/lib.lua lease_place)
            place = score if self.queue else now_ms * 1000 - 1 - priority * AGING_US
            self._grant(ticket, amount, tenant, dev, place)
            return "granted"
        if mode == "try":
            return "refused"
        self.qvt = vt
        self.queue[ticket] = (score, amount, now_ms, tenant, pin)
        return "queued"

    def grown_total(self, g: str) -> int | None:
        """lua/lib.lua grown_total: the amount growth ``g``'s lease would have, or None when it
        can never grow (the lease is gone, or the total exceeds its tenant's quota)."""
        t = self.grows[g]
        if t not in self.held:
            return None
        total = self.held[t] + self.queue[g][1]
        if self.quota_check(self.queue[g][3], total) == "never":
            return None
        return total

    def frees(self, dev: int, except_t: str | None = None) -> bool:
        """Whether a lease on device ``dev`` (but ``except_t``'s) may free bytes: one that does
        not wait to grow (lua/lib.lua growth_scan; the model has no resident lease)."""
        growing = set(self.grows.values())
        return any(
            self.dev_of.get(t, 0) == dev and a > 0 and t not in growing
            for t, a in self.held.items()
            if t != except_t
        )

    def resize(self, t: str, g: str, amount: int, priority: int, now_ms: int, mode: str) -> str:
        """resize.lua on held ticket ``t``'s lease (growth ticket ``g``) to ``amount`` bytes at
        ``priority``: 'granted' (now: a shrink, the same amount, a growth granted at once or by
        the hand-off its joining made), 'queued', 'refused' (mode 'try'), or an error that
        changes nothing: 'lost', 'capacity', 'quota', 'conflict', 'deadlock'."""
        if t not in self.held:
            return "lost"
        cur, tenant, dev = self.held[t], self.tenant_of.get(t, ""), self.dev_of.get(t, 0)
        pin = dev if self.dcap else None
        if amount > cur:
            if amount > self.largest(pin):
                return "capacity"
            if self.quota_check(tenant, amount) == "never":
                return "quota"
        if g in self.queue:
            if amount > cur and cur + self.queue[g][1] == amount:
                return "queued"  # the same growth again: refreshed
            if amount > cur:
                return "conflict"
            self._dequeue(g)  # withdrawn
            withdrawn = True
        else:
            withdrawn = False
        if amount <= cur:
            if amount < cur:
                self.held[t] = amount
                self.used -= cur - amount
            if amount < cur or withdrawn:
                self.hand_off(now_ms)
            return "granted"
        delta = amount - cur
        got, score, _ = self._grant_test(delta, priority, now_ms, tenant, pin, self.places[t])
        if got is not None:
            self.used += delta
            self.held[t] = amount
            return "granted"
        if mode == "try":
            return "refused"
        self.queue[g] = (score, delta, now_ms, tenant, pin)
        self.grows[g] = t
        if not self.frees(dev, t):
            # joining leaves its device stuck: the hand-off's rule for a stuck device decides
            if g in self.hand_off(now_ms):
                return "granted"
            if not self.frees(dev, t):
                self._dequeue(g)
                return "deadlock"
        return "queued"

    def backfill_open(self, now_ms: int, head_enqueued_ms: int) -> bool:
        return self.policy == "backfill" and now_ms - head_enqueued_ms < self.backfill_ms

    def hand_off(self, now_ms: int) -> list[str]:
        """Grant the longest prefix of the queue that fits, passing over waiters whose tenant
        has no room and the later waiters of that tenant (at most QUOTA_DEPTH of them) and
        dropping those over their quota, then
        (backfill) later requests that fit while the blocked head's window is open; returns
        the tickets granted."""
        out = []
        blocked = None
        skipped = 0
        passed: set[str] = set()
        for t in self.order():
            score, amount, enq, tenant, pin = self.queue[t]
            q = self.quota_check(tenant, amount)
            whole: int | None = amount
            if t in self.grows:
                whole = self.grown_total(t)
            if whole is None or q == "never" or whole > self.largest(pin):
                self._dequeue(t)
                continue
            if q == "wait" or tenant in passed:
                passed.add(tenant)
                skipped += 1
                if skipped >= QUOTA_DEPTH:
                    break
                continue
            dev = self.place(amount, pin) if self.used + amount <= self.capacity else None
            if dev is None:
                blocked = enq
                break
            self._grant(t, amount, tenant, dev, score)
            self._dequeue(t)
            out.append(t)
        if (
            blocked is not None
            and self.used < self.capacity
            and self.backfill_open(now_ms, blocked)
        ):
            for t in self.order()[skipped + 1 : skipped + 1 + BACKFILL_DEPTH]:
                amount, tenant, pin = self.queue[t][1], self.queue[t][3], self.queue[t][4]
                q = self.quota_check(tenant, amount)
                if q == "wait":
                    passed.add(tenant)
                whole = self.grown_total(t) if t in self.grows else amount
                if (
                    whole is not None
                    and whole <= self.largest(pin)
                    and self.used + amount <= self.capacity
                    and q == "ok"
                    and tenant not in passed
                ):
                    dev = self.place(amount, pin)
                    if dev is not None:
                        self._grant(t, amount, tenant, dev, self.queue[t][0])
                        self._dequeue(t)
                        out.append(t)
                if self.used >= self.capacity:
                    break
        if blocked is not None or skipped > 0:
            out += self._stuck_growths()
        return out

    def _stuck_growths(self) -> list[str]:
        """The hand-off's last step (lua/lib.lua grant_from): on each stuck device (no lease on
        it may free bytes), the growths of its leases that fit, in queue order."""
        devs = range(len(self.dcap) or 1)
        stuck = {i for i in devs if not self.frees(i)}
        cands = [
            g
            for g in self.order()
            if g in self.grows
            and self.grows[g] in self.held
            and self.dev_of.get(self.grows[g], 0) in stuck
        ]
        out = []
        for g in cands:
            _, amount, _, tenant, pin = self.queue[g]
            q = self.quota_check(tenant, amount)
            whole = self.grown_total(g)
            if (
                whole is not None
                and q == "ok"
                and whole <= self.largest(pin)
                and self.used + amount <= self.capacity
            ):
                dev = self.place(amount, pin)
                if dev is not None:
                    self._grant(g, amount, tenant, dev, 0)
                    self._dequeue(g)
                    out.append(g)
        return out

    def release(self, ticket: str, now_ms: int) -> list[str]:
        self.used -= self.held.pop(ticket)
        self.places.pop(ticket, None)
        self.tenant_of.pop(ticket, None)
        self.dev_of.pop(ticket, None)
        return self.hand_off(now_ms)

    def set_quota(self, tenant: str, quota: int, now_ms: int) -> list[str]:
        """configure's quotas (0 removes), then its hand-off."""
        if quota:
            self.quotas[tenant] = quota
        else:
            self.quotas.pop(tenant, None)
        return self.hand_off(now_ms)

    def cancel(self, ticket: str, now_ms: int) -> list[str]:
        """A queued ticket leaves the queue (a held one is released)."""
        if ticket in self.queue:
            self._dequeue(ticket)
            return self.hand_off(now_ms)
        return self.release(ticket, now_ms)


def end_one(
    c: Any, pool: str, call: Callable[..., Any], model: QueueModel, kind: str, t: str
) -> None:
    """A history's "rel" (release ticket ``t``'s lease, if it holds one) or "cancel" (withdraw
    it, queued or held) through the scripts (``call``: a script form of support.pools) and
    the model alike; the hand-offs each makes must be the same."""
    from gpulock.protocol.keys import pool_keys

    from support.pools import _s

    if kind == "rel":
        if t not in model.held:
            return
        lid = _s(c.hget(pool_keys(pool)[6], t))
        token = int(_s(c.hget(pool_keys(pool)[2], lid)).split("|")[1])
        r = call(c, pool, "release", lid, token)
        assert r[0] == 1
        assert int(r[3]) == len(model.release(t, int(r[1])))
    elif t in model.held or t in model.queue:
        r = call(c, pool, "cancel", t)
        model.cancel(t, int(r[1]))
