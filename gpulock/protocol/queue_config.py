"""A pool's scheduling settings as ``configure.lua`` takes and answers them (its ARGV 6 to 11):
:class:`QueueConfig`. No I/O. ``gpulock.protocol.replies`` (the configure reply) and
``gpulock.protocol.status`` (a status snapshot's settings) both hand it out."""

from __future__ import annotations

from typing import Any, NamedTuple

from gpulock_common.options import Preemption, PoolSettings

from gpulock.protocol.args import decode_quotas, encode_quotas

__all__ = ["QueueConfig"]


class QueueConfig(NamedTuple):
    """A pool's scheduling settings as ``configure.lua`` takes them (its ARGV 6 to 11) and
    answers them, and as a client remembers them to make the pool again after a loss. Each
    None when not given (a configure then leaves it as it is)."""

    policy: str | None  # "fifo" or "backfill"
    backfill_ms: int | None  # the backfill window, ms
    quotas: str | None  # tenant quotas, "<tenant>=<bytes> ..." ("": none)
    devices: str | None  # each device's capacity, "<bytes> ..." ("": a pool of one device)
    placement: str | None  # "bestfit" or "spread"
    # preemption: "<gap> <yield_grace_ms>" (on) or "off" (as ARGV 11 takes it; the reply's ""
    # is "off" here)
    preempt: str | None = None

    @classmethod
    def asked(cls, s: PoolSettings, devices: str | None) -> QueueConfig | None:
        """What a ``configure`` of the checked settings ``s`` asks of these (``devices``
        already encoded, ``protocol.args.encode_devices``: they set the capacity too); None
        when it asks none of them. Raises InvalidArgument naming a bad quota."""
        q = cls(
            s.policy,
            None if s.backfill_window is None else max(1, round(s.backfill_window * 1000)),
            None if s.quotas is None else encode_quotas(s.quotas),
            devices,
            s.placement,
            _preempt_asked(s.preemption),
        )
        return None if q == _ASKS_NOTHING else q

    def argv(self) -> list[str]:
        """``configure.lua``'s ARGV 6 to 11, in this record's order ("": unchanged)."""
        return ["" if v is None else str(v) for v in self]

    def shown(self, capacity: int) -> dict[str, Any]:
        """As ``configure``'s reply shows them: ``policy``, ``backfill_window`` (seconds),
        ``quotas`` (tenant: bytes), ``devices`` (each one's bytes; ``[capacity]`` for a pool
        of one device), ``placement`` and ``preemption`` (``{"gap", "yield_grace_s"}``;
        None: off, or not in the reply)."""
        return {
            "policy": self.policy,
            "backfill_window": (self.backfill_ms or 0) / 1000,
            "quotas": decode_quotas(self.quotas or ""),
            "devices": [int(c) for c in (self.devices or "").split()] or [capacity],
            "placement": self.placement,
            "preemption": p.shown() if (p := self.preemption) is not None else None,
        }

    @property
    def preemption(self) -> Preemption | None:
        """The preemption setting: None when off (or not known)."""
        return None if self.preempt in (None, "off") else Preemption.from_wire(self.preempt)

    @staticmethod
    def preempt_shown(wire: str) -> str:
        """A reply's preemption setting ("<gap> <yield_grace_ms>", "" when off) as this
        record keeps it ("off" when off)."""
        return wire or "off"


def _preempt_asked(p: Preemption | bool | None) -> str | None:
    """ARGV 11 for ``configure``'s checked ``preemption``: None: unchanged; "off"; or the
    setting's wire form."""
    if p is None:
        return None
    return p.to_wire() if isinstance(p, Preemption) else "off"


_ASKS_NOTHING = QueueConfig(None, None, None, None, None, None)
