"""Device truth, the logic without I/O: external use, its smoothing, and over-users.

Given a :class:`~gpulock.devices.DeviceReading` and the pool's live leases
(:class:`~gpulock.LeaseInfo`, holder metadata with ``host`` and ``pid``), this module says

* :func:`external_use` — the bytes the device shows in use outside the pool's leases: with
  per-process use, the sum over processes that hold no live lease on this host plus what each
  holder uses beyond its leases (a holder's descendants count as the holder:
  :func:`fold_into_holders`), and never less than ``max(0, used − bytes leased by holders on
  this host)``, which is the answer without per-process use. Bytes; what the pool should hold
  back.
* :class:`Smoother` — what to publish of a series of such values: a rise takes effect at once
  (a late rise is an OOM), a fall only once it has lasted :attr:`Smoother.fall_samples` samples
  and :attr:`Smoother.fall_seconds` seconds (a process that frees and reallocates within a
  second does not open a window for a grant it then collides with), and a change smaller than
  :attr:`Smoother.threshold` is ignored (allocator noise should not churn the pool). The numbers
  and why: docs/SEMANTICS.md, "Device truth".
* :func:`find_overuse` and :class:`OveruseTimer` — holders whose device use exceeds their
  leases by more than a margin, and for how long; :func:`exceeds` is the one rule, used by the
  sampler and by ``gpulock run --enforce``.

The sampler (:mod:`gpulock.devices.sampler`) and the run command drive these; nothing here
reads a clock or a device (times are passed in, seconds of a monotonic clock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Hashable

from gpulock.protocol.replies import LeaseInfo
from gpulock.devices import DeviceReading

__all__ = [
    "DEFAULT_FALL_SAMPLES",
    "DEFAULT_FALL_SECONDS",
    "DEFAULT_MARGIN",
    "DEFAULT_SLACK",
    "DEFAULT_THRESHOLD",
    "Overuse",
    "OveruseTimer",
    "Smoother",
    "exceeds",
    "external_use",
    "find_overuse",
    "fold_into_holders",
    "holder_pid",
    "leases_by_pid",
]

MiB = 1 << 20
#: Changes of the external use smaller than this are ignored: 64 MiB is a few of the CUDA
#: caching allocator's 20 MiB large-block segments, far below a model or a batch.
DEFAULT_THRESHOLD = 64 * MiB
#: A fall is published once it has lasted 3 samples and 3 s (three one-second samples): longer
#: than a free-then-reallocate of one step, short enough that freed memory comes back soon.
DEFAULT_FALL_SAMPLES = 3
DEFAULT_FALL_SECONDS = 3.0
#: Over-use: a holder whose device use exceeds its leases by more than 10% plus 512 MiB. The
#: slack covers the CUDA context (some hundreds of MiB per process, outside any estimate).
DEFAULT_MARGIN = 0.10
DEFAULT_SLACK = 512 * MiB


def holder_pid(lease: LeaseInfo, host: str) -> int | None:
    """The pid of the lease's holder when its metadata says it runs on ``host``, else None."""
    h = lease.holder
    pid = h.get("pid")
    if h.get("host") != host or isinstance(pid, bool) or not isinstance(pid, int):
        return None
    return pid


def leases_by_pid(leases: Iterable[LeaseInfo], host: str) -> dict[int, list[LeaseInfo]]:
    """The live leases of holders on ``host``, grouped by the holder's pid."""
    out: dict[int, list[LeaseInfo]] = {}
    for lz in leases:
        pid = holder_pid(lz, host)
        if pid is not None:
            out.setdefault(pid, []).append(lz)
    return out


def fold_into_holders(
    processes: Mapping[int, int],
    holders: Iterable[int],
    ancestors: Callable[[int], Iterable[int]],
) -> dict[int, int]:
    """``processes`` (pid -> device bytes) with the use of each pid that holds no lease but
    descends from a holder charged to its nearest holder ancestor (``ancestors(pid)``: its
    parent, grandparent, ... nearest first). ``gpulock run`` holds the lease in its own process
    while its command (a child) uses the device: without this the command's memory would count
    as external (granted twice) and its over-use would go unseen."""
    hs = set(holders)
    out: dict[int, int] = {}
    for pid, used in processes.items():
        owner = pid
        if pid not in hs:
            owner = next((a for a in ancestors(pid) if a in hs), pid)
        out[owner] = out.get(owner, 0) + used
    return out


def external_use(reading: DeviceReading, leases: Iterable[LeaseInfo], host: str) -> int:
    """Bytes in use on the device outside the pool's live leases (module docstring). A
    process's use counts in full when it holds no live lease (a process that lost its lease
    while it still holds memory — a hung worker — counts so until the device frees it).

    With per-process use the answer is never below ``used − bytes leased on this host``: memory
    of processes the reader does not list (another container's, which NVML may not show) is
    outside the leases too."""
    by_pid = leases_by_pid(leases, host)
    leased = sum(lz.amount for group in by_pid.values() for lz in group)
    by_total = max(0, reading.used_bytes - leased)
    if reading.processes is None:
        return by_total
    ext = 0
    for pid, used in reading.processes.items():
        group = by_pid.get(pid)
        if group is None:
            ext += used
        else:
            ext += max(0, used - sum(lz.amount for lz in group))
    return max(ext, by_total)


@dataclass
class Smoother:
    """Hysteresis of the published external use (module docstring). Feed every sample to
    :meth:`update`; it returns the value to publish. Bytes; seconds of a monotonic clock."""

    threshold: int = DEFAULT_THRESHOLD
    fall_samples: int = DEFAULT_FALL_SAMPLES
    fall_seconds: float = DEFAULT_FALL_SECONDS
    published: int = 0
    _low_since: float | None = field(default=None, repr=False)
    _low_count: int = field(default=0, repr=False)
    _low_max: int = field(default=0, repr=False)

    def update(self, value: int, now: float) -> int:
        """Take one sample (bytes, at ``now`` seconds); the value to publish."""
        if value < 0:
            raise ValueError(f"external use must be >= 0 bytes, got {value}")
        if value >= self.published + self.threshold:
            self.published = value  # a rise: at once
            self._low_since = None
        elif value <= self.published - self.threshold or (value == 0 < self.published):
            if self._low_since is None:
                self._low_since, self._low_count, self._low_max = now, 0, value
            self._low_count += 1
            self._low_max = max(self._low_max, value)
            if self._low_count >= self.fall_samples and now - self._low_since >= self.fall_seconds:
                # the highest value the fall showed: memory freed for the whole window
                self.published = self._low_max
                self._low_since = None
        else:
            self._low_since = None  # within the threshold: no change, and no fall under way
        return self.published


def exceeds(actual: int, leased: int, margin: float, slack: int) -> bool:
    """Whether ``actual`` device bytes exceed ``leased`` bytes by more than the margin
    (a fraction, 0.10 = 10%) plus ``slack`` bytes."""
    return actual > leased * (1.0 + margin) + slack


@dataclass(frozen=True)
class Overuse:
    """A holder (one process) using more device memory than its leases allow. Bytes;
    ``excess`` = ``actual`` − ``leased``."""

    pid: int
    holder: dict[str, Any]
    lease_ids: tuple[str, ...]
    leased: int
    actual: int
    excess: int
    over_for: float = 0.0  # seconds it has been over (OveruseTimer)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "holder": self.holder,
            "lease_ids": list(self.lease_ids),
            "leased": self.leased,
            "actual": self.actual,
            "excess": self.excess,
            "over_for": round(self.over_for, 3),
        }


def find_overuse(
    reading: DeviceReading,
    leases: Iterable[LeaseInfo],
    host: str,
    *,
    margin: float = DEFAULT_MARGIN,
    slack: int = DEFAULT_SLACK,
) -> list[Overuse]:
    """The holders on ``host`` whose device use (per-process, so none without it) exceeds the
    bytes of their live leases by more than ``margin`` and ``slack`` (:func:`exceeds`)."""
    if reading.processes is None:
        return []
    out = []
    for pid, group in sorted(leases_by_pid(leases, host).items()):
        actual = reading.processes.get(pid)
        if actual is None:
            continue
        leased = sum(lz.amount for lz in group)
        if exceeds(actual, leased, margin, slack):
            out.append(
                Overuse(
                    pid,
                    group[0].holder,
                    tuple(lz.lease_id for lz in group),
                    leased,
                    actual,
                    actual - leased,
                )
            )
    return out


class OveruseTimer:
    """How long each key (a pid) has been over, sample after sample: :meth:`update` with the
    keys over now returns, for each, the seconds since it was first seen over without a break
    (a key not over in a sample starts again). ``hold`` seconds: what counts as over for long."""

    def __init__(self, hold: float):
        if hold < 0:
            raise ValueError(f"over-use hold must be >= 0 seconds, got {hold}")
        self.hold = hold
        self._since: dict[Hashable, float] = {}

    def update(self, over: Iterable[Hashable], now: float) -> dict[Hashable, float]:
        keys = set(over)
        self._since = {k: self._since.get(k, now) for k in keys}
        return {k: now - t for k, t in self._since.items()}

    def held(self, over: Iterable[Hashable], now: float) -> dict[Hashable, float]:
        """:meth:`update`, keeping only the keys over for at least :attr:`hold` seconds."""
        return {k: d for k, d in self.update(over, now).items() if d >= self.hold}
