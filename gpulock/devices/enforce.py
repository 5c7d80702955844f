"""``gpulock run --enforce``: watch CMD's device memory against its lease.

A thread reads the device every :data:`CHECK_INTERVAL_S` seconds (a
:class:`~gpulock.devices.DeviceReader` with per-process use), sums the bytes of CMD's process
and all its descendants (psutil), and calls ``on_over`` once when that sum has exceeded the
lease by the margin and slack (:func:`gpulock.devices.truth.exceeds`) for ``hold`` seconds
without a break (:class:`gpulock.devices.truth.OveruseTimer`). The run command then stops CMD
(SIGTERM, SIGKILL after ``--grace``) and exits :data:`gpulock.cli.common.EXIT_OVERUSE`.

A device read that fails, or a reader without per-process use, enforces nothing: the thread
says so once (``on_note``) and keeps trying.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from gpulock.devices.truth import OveruseTimer, exceeds
from gpulock.devices import DeviceError, DeviceReader

#: seconds between device reads
CHECK_INTERVAL_S = 0.25


@dataclass(frozen=True)
class Breach:
    """CMD's device use over its lease. Bytes; ``over_for`` seconds; ``pids`` the processes
    counted (CMD and its descendants that use the device)."""

    actual: int
    leased: int
    over_for: float
    pids: tuple[int, ...]


def process_tree(pid: int) -> set[int]:
    """``pid`` and its descendants (those alive now; an empty set when ``pid`` is gone)."""
    try:
        p = psutil.Process(pid)
        return {pid} | {c.pid for c in p.children(recursive=True)}
    except psutil.Error:
        return set()


def process_ancestors(pid: int) -> list[int]:
    """The pids of ``pid``'s parent, grandparent, ... (nearest first; empty when ``pid`` is gone
    or not visible, e.g. in another pid namespace)."""
    try:
        return [p.pid for p in psutil.Process(pid).parents()]
    except psutil.Error:
        return []


class Enforcer:
    """The watching thread (module docstring). ``stop()`` ends it; ``on_over(breach)`` and
    ``on_note(text)`` are called from it."""

    def __init__(
        self,
        reader: DeviceReader,
        device: int,
        pid: int,
        leased: int,
        *,
        margin: float,
        slack: int,
        hold: float,
        on_over: Callable[[Breach], None],
        on_note: Callable[[str], None],
        interval: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.reader, self.device, self.pid, self.leased = reader, device, pid, leased
        self.margin, self.slack = margin, slack
        self._timer = OveruseTimer(hold)
        self.on_over, self.on_note = on_over, on_note
        self.interval, self.clock = interval, clock
        self._stop = threading.Event()
        self._noted: set[str] = set()
        self._thread = threading.Thread(target=self._main, name="gpulock-run-enforce", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _note(self, text: str) -> None:
        if text not in self._noted:
            self._noted.add(text)
            self.on_note(text)

    def check(self) -> Breach | None:
        """One check: the breach if CMD has been over for ``hold`` seconds, else None."""
        try:
            r = self.reader.read(self.device)
        except DeviceError as e:
            self._note(f"--enforce cannot read device {self.device}: {e}")
            return None
        if r.processes is None:
            self._note(
                f"--enforce: the {self.reader.name} reader has no per-process use on device "
                f"{self.device}; nothing is enforced"
            )
            return None
        tree = process_tree(self.pid)
        pids = tuple(sorted(p for p in tree if p in r.processes))
        actual = sum(r.processes[p] for p in pids)
        over = exceeds(actual, self.leased, self.margin, self.slack)
        held = self._timer.held([self.pid] if over else [], self.clock())
        if self.pid in held:
            return Breach(actual, self.leased, held[self.pid], pids)
        return None

    def _main(self) -> None:
        while not self._stop.is_set():
            b = self.check()
            if b is not None:
                self.on_over(b)
                return
            self._stop.wait(self.interval)
