"""A small pure-Python model of the queue policies the scripts implement (docs/SEMANTICS.md,
"Priorities", "Backfill", "Tenant quotas" and "Devices and placement"): one pool of one or
several devices, bytes, order by queue score,
hand-off of the longest prefix that fits (passing over waiters whose tenant is at its quota)
and, under backfill while the head's window is open, of later requests that fit. On several
devices a request fits when the pool's bytes fit it and a device has room (its pinned one, or
the one the placement rule picks). The scripts' decisions must equal this model's on any history (tests/integration/
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
        """Queued tickets, head first."""
        return sorted(self.queue, key=lambda t: self.queue[t][0])

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

    def _grant(self, t: str, amount: int, tenant: str, dev: int) -> None:
        self.used += amount
        self.held[t] = amount
        self.tenant_of[t] = tenant
        self.dev_of[t] = dev

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
        score, vt = self.score(now_ms, priority)
        fits = self.used + amount <= self.capacity and self.quota_check(tenant, amount) == "ok"
        dev = self.place(amount, pin) if fits else None
        fits = dev is not None
        f, passed = self.front()
        ahead = f is None or score < self.queue[f][0]
        if tenant in passed and passed[tenant] < score:
            fits = False  # a tenant's own waiters keep their order
        if fits and f is not None and not ahead:
            ahead = self.backfill_open(now_ms, self.queue[f][2])
        if ahead and fits and dev is not None:
            self._grant(ticket, amount, tenant, dev)
            return "granted"
        if mode == "try":
            return "refused"
        self.qvt = vt
        self.queue[ticket] = (score, amount, now_ms, tenant, pin)
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
            if q == "never" or amount > self.largest(pin):
                del self.queue[t]
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
            del self.queue[t]
            self._grant(t, amount, tenant, dev)
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
                if self.used + amount <= self.capacity and q == "ok" and tenant not in passed:
                    dev = self.place(amount, pin)
                    if dev is not None:
                        del self.queue[t]
                        self._grant(t, amount, tenant, dev)
                        out.append(t)
                if self.used >= self.capacity:
                    break
        return out

    def release(self, ticket: str, now_ms: int) -> list[str]:
        self.used -= self.held.pop(ticket)
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
            del self.queue[ticket]
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
