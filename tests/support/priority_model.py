"""A small pure-Python model of the queue policy the scripts implement (docs/SEMANTICS.md,
"Priorities"): one pool, bytes, strict order by queue score, hand-off of the longest prefix
that fits. The scripts' decisions must equal this model's on any history (tests/integration/
test_priority.py drives both with the same calls and compares).

Times are the server's milliseconds as the scripts reported them (the model takes ``now_ms``
from each reply, so it needs no clock of its own)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpulock._args import AGING_S

AGING_US = int(AGING_S * 1_000_000)


@dataclass
class QueueModel:
    capacity: int
    used: int = 0
    qvt: int = 0  # the last arrival, virtual µs
    queue: dict[str, tuple[int, int]] = field(default_factory=dict)  # ticket -> (score, amount)
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
        if ahead and self.used + amount <= self.capacity:
            self.used += amount
            self.held[ticket] = amount
            return "granted"
        if mode == "try":
            return "refused"
        self.qvt = vt
        self.queue[ticket] = (score, amount)
        return "queued"

    def hand_off(self) -> list[str]:
        """Grant the longest prefix of the queue that fits; returns the tickets granted."""
        out = []
        for t in self.order():
            amount = self.queue[t][1]
            if self.used + amount > self.capacity:
                break
            del self.queue[t]
            self.used += amount
            self.held[t] = amount
            out.append(t)
        return out

    def release(self, ticket: str) -> list[str]:
        self.used -= self.held.pop(ticket)
        return self.hand_off()

    def cancel(self, ticket: str) -> list[str]:
        """A queued ticket leaves the queue (a held one is released)."""
        if ticket in self.queue:
            del self.queue[ticket]
            return self.hand_off()
        return self.release(ticket)
