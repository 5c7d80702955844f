"""The OOM back-off rule (pure: no I/O, no clock of its own): how a CUDA out-of-memory error
inside a lease raises the estimate of its shape bucket and shrinks the share of the pool's
capacity that is granted, and how both come back. docs/SEMANTICS.md, "Back-off on OOM",
gives the rule in words, its numbers and why.

An OOM inside a lease means the lease was too small for the work: the estimate was too low,
or memory outside the leases was in use. Two reactions, both AIMD (as TCP's congestion
window: cut fast, grow back slowly):

* the bucket's **scale** (a multiplier ≥ 1 on its calibrated or formula estimate) is
  multiplied by ``estimate_up`` (capped at ``estimate_max``); every ``estimate_every`` clean
  calls of the bucket take ``estimate_down`` off it again, never below 1 (the estimate never
  goes under its calibrated/formula floor);
* the pool's **factor** (the share of the capacity leases may fill, in
  ``[capacity_floor, 1]``) is multiplied by ``capacity_cut``; each ``capacity_every_s``
  seconds without an OOM add ``capacity_step`` back, up to 1. The factor is applied by
  asking each lease for ``amount / factor`` bytes (:meth:`BackoffRule.lease_amount`), so at
  most ``factor × capacity`` bytes of real work run at once.

OOMs within ``episode_s`` of the last reaction count as the same episode (one event that
made several concurrent requests fail) and change nothing, as TCP reacts once per round trip.

Times are server milliseconds (the state is shared by every worker through Redis and read on
the server's clock); counts are successes of the bucket (a shared counter)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpulock.errors import InvalidArgument

__all__ = ["BackoffRule", "BucketState", "PoolState", "decode_bucket", "decode_pool"]


@dataclass(frozen=True)
class BucketState:
    """A shape bucket's back-off: ``scale`` (≥ 1) set at server time ``at_ms`` when the
    bucket's success counter stood at ``ok_at``."""

    scale: float = 1.0
    ok_at: int = 0
    at_ms: int = 0

    def encode(self) -> str:
        """``"<scale> <ok_at> <at_ms>"``: the hash field's value."""
        return f"{self.scale!r} {self.ok_at} {self.at_ms}"


@dataclass(frozen=True)
class PoolState:
    """The pool's back-off: ``factor`` (in ``[floor, 1]``) set at server time ``at_ms``."""

    factor: float = 1.0
    at_ms: int = 0

    def encode(self) -> str:
        """``"<factor> <at_ms>"``: the hash field's value."""
        return f"{self.factor!r} {self.at_ms}"


def _text(raw: str | bytes | None) -> str:
    return (raw.decode() if isinstance(raw, bytes) else raw) or ""


def decode_bucket(raw: str | bytes | None) -> BucketState:
    """The state a hash field holds (absent or unreadable: no back-off)."""
    try:
        s, ok, at = _text(raw).split()
        return BucketState(max(1.0, float(s)), int(ok), int(at))
    except ValueError:
        return BucketState()


def decode_pool(raw: str | bytes | None) -> PoolState:
    """The state a hash field holds (absent or unreadable: no back-off)."""
    try:
        f, at = _text(raw).split()
        return PoolState(min(1.0, float(f)), int(at))
    except ValueError:
        return PoolState()


@dataclass(frozen=True)
class BackoffRule:
    """The rule's numbers; the defaults are the documented rule (docs/SEMANTICS.md).

    Args:
        estimate_up: a bucket's scale is multiplied by this on an OOM (> 1).
        estimate_max: the scale's cap (≥ 1).
        estimate_down: taken off the scale per ``estimate_every`` clean calls (> 0).
        estimate_every: clean calls of the bucket per step down (≥ 1).
        capacity_cut: the pool's factor is multiplied by this on an OOM (in (0, 1)).
        capacity_floor: the factor's floor (in (0, 1]).
        capacity_step: added to the factor per ``capacity_every_s`` seconds without an OOM.
        capacity_every_s: seconds per step up (> 0).
        episode_s: OOMs within this many seconds of the last reaction change nothing (≥ 0).

    Raises: InvalidArgument naming the first value out of its range."""

    estimate_up: float = 1.5
    estimate_max: float = 4.0
    estimate_down: float = 0.1
    estimate_every: int = 50
    capacity_cut: float = 0.8
    capacity_floor: float = 0.5
    capacity_step: float = 0.05
    capacity_every_s: float = 60.0
    episode_s: float = 5.0

    def __post_init__(self) -> None:
        checks = (
            ("estimate_up", self.estimate_up > 1),
            ("estimate_max", self.estimate_max >= 1),
            ("estimate_down", self.estimate_down > 0),
            ("estimate_every", self.estimate_every >= 1),
            ("capacity_cut", 0 < self.capacity_cut < 1),
            ("capacity_floor", 0 < self.capacity_floor <= 1),
            ("capacity_step", self.capacity_step > 0),
            ("capacity_every_s", self.capacity_every_s > 0),
            ("episode_s", self.episode_s >= 0),
        )
        for name, ok in checks:
            v = getattr(self, name)
            if not ok or not math.isfinite(v):
                raise InvalidArgument(f"oom back-off: {name}={v!r} is out of range")

    # ---- a bucket's scale -------------------------------------------------------------------

    def scale(self, st: BucketState, ok: int) -> float:
        """The bucket's scale now, its success counter at ``ok``: ``st.scale`` less
        ``estimate_down`` per ``estimate_every`` successes since it was set, at least 1."""
        steps = max(0, ok - st.ok_at) // self.estimate_every
        return max(1.0, min(self.estimate_max, st.scale - steps * self.estimate_down))

    def bucket_oom(self, st: BucketState, ok: int, now_ms: int) -> BucketState:
        """The bucket's state after an OOM at ``now_ms`` (success counter at ``ok``): its
        scale now × ``estimate_up`` (at most ``estimate_max``); unchanged within
        ``episode_s`` of the last raise."""
        if st.at_ms and now_ms - st.at_ms < self.episode_s * 1000:
            return st
        up = min(self.estimate_max, self.scale(st, ok) * self.estimate_up)
        return BucketState(up, ok, now_ms)

    # ---- the pool's factor ------------------------------------------------------------------

    def factor(self, st: PoolState, now_ms: int) -> float:
        """The pool's factor at ``now_ms``: ``st.factor`` plus ``capacity_step`` per
        ``capacity_every_s`` since it was set, at most 1 (and at least ``capacity_floor``)."""
        if st.factor >= 1.0:
            return 1.0
        steps = math.floor(max(0, now_ms - st.at_ms) / (self.capacity_every_s * 1000))
        return max(self.capacity_floor, min(1.0, st.factor + steps * self.capacity_step))

    def pool_oom(self, st: PoolState, now_ms: int) -> PoolState:
        """The pool's state after an OOM at ``now_ms``: its factor now × ``capacity_cut``
        (at least ``capacity_floor``); unchanged within ``episode_s`` of the last cut."""
        if st.at_ms and now_ms - st.at_ms < self.episode_s * 1000:
            return st
        cut = max(self.capacity_floor, self.factor(st, now_ms) * self.capacity_cut)
        return PoolState(cut, now_ms)

    @staticmethod
    def lease_amount(amount: int, factor: float, room: int | None) -> int:
        """Bytes to lease for work of ``amount`` bytes under ``factor``: ``ceil(amount /
        factor)``, but never more than ``room`` (the most the pool can ever grant this
        request, e.g. capacity minus resident leases; None: unbounded) and never less than
        ``amount`` (a request the room cannot hold keeps the pool's own answer, 413)."""
        if factor >= 1.0 or amount <= 0:
            return amount
        inflated = math.ceil(amount / factor)
        if room is not None:
            inflated = min(inflated, room)
        return max(amount, inflated)
