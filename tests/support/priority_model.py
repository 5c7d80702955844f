"""A small pure-Python model of the queue policies the scripts implement (docs/SEMANTICS.md,
"Priorities" and "Backfill"): one pool, bytes, order by queue score, hand-off of the longest
prefix that fits and, under backfill while the head's window is open, of later requests that
fit. The scripts' decisions must equal this model's on any history (tests/integration/
test_priority.py drives both with the same calls and compares).

Times are the server's milliseconds as the scripts reported them (the model takes ``now_ms``
from each reply, so it needs no clock of its own)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpulock._args import AGING_S

AGING_US = int(AGING_S * 1_000_000)
BACKFILL_DEPTH = 32  # lua/lib.lua


@dataclass
class QueueModel:
    capacity: int
    policy: str = "fifo"
    backfill_ms: int = 2000
    used: int = 0
    qvt: int = 0  # the last arrival, virtual µs
    # ticket -> (score, amount, enqueued_ms)
    queue: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)  # ticket -> amount

    def score(self, now_ms: int, priority: int) -> tuple[int, int]:
        vt = max(now_ms * 1000, self.qvt + 1)
        return vt - priority * AGING_US, vt

    def order(self) -> list[str]:
        """Queued tickets, head first."""
        return sorted(self.queue, key=lambda t: self.queue[t][0])

    def acquire(self, ticket: str, amount: int, priority: int, now_ms: int, mode: str) -> str:
        """'granted', 'queued' or 'refused' (mode 'try' that could not be granted)."""
        assert amount <= self.capacity
        score, vt = self.score(now_ms, priority)
        head = self.order()[:1]
        ahead = not head or score < self.queue[head[0]][0]
        if head and not ahead:
            ahead = self.backfill_open(now_ms, self.queue[head[0]][2])
        if ahead and self.used + amount <= self.capacity:
            self.used += amount
            self.held[ticket] = amount
            return "granted"
        if mode == "try":
            return "refused"
        self.qvt = vt
        self.queue[ticket] = (score, amount, now_ms)
        return "queued"

    def backfill_open(self, now_ms: int, head_enqueued_ms: int) -> bool:
        return self.policy == "backfill" and now_ms - head_enqueued_ms < self.backfill_ms

    def hand_off(self, now_ms: int) -> list[str]:
        """Grant the longest prefix of the queue that fits, then (backfill) later requests
        that fit while the blocked head's window is open; returns the tickets granted."""
        out = []
        blocked = None
        for t in self.order():
            score, amount, enq = self.queue[t]
            if self.used + amount > self.capacity:
                blocked = enq
                break
            del self.queue[t]
            self.used += amount
            self.held[t] = amount
            out.append(t)
        if (
            blocked is not None
            and self.used < self.capacity
            and self.backfill_open(now_ms, blocked)
        ):
            for t in self.order()[1 : 1 + BACKFILL_DEPTH]:
                amount = self.queue[t][1]
                if self.used + amount <= self.capacity:
                    del self.queue[t]
                    self.used += amount
                    self.held[t] = amount
                    out.append(t)
                if self.used >= self.capacity:
                    break
        return out

    def release(self, ticket: str, now_ms: int) -> list[str]:
        self.used -= self.held.pop(ticket)
        return self.hand_off(now_ms)

    def cancel(self, ticket: str, now_ms: int) -> list[str]:
        """A queued ticket leaves the queue (a held one is released)."""
        if ticket in self.queue:
            del self.queue[ticket]
            return self.hand_off(now_ms)
        return self.release(ticket, now_ms)
