"""The device sampler: reconciles a pool with its device's real memory (docs/SEMANTICS.md,
"Device truth").

A pool is one device. Every process that runs a :class:`DeviceSampler` for it (each service
worker with a device configured, ``gpulock sample``) takes part, but one samples: the holder of
the pool's sampler claim (``lua/external.lua``; ``claim_ttl`` seconds, renewed at every round).
The others make one short call a round and take over when the holder's claim runs out. Each
round the holder

1. reads the device (a :class:`~gpulock.devices.DeviceReader`, in a thread) and the pool's
   status (its live leases, with the holders' ``host`` and ``pid``);
2. charges each device process that holds no lease to its nearest ancestor that does
   (:func:`~gpulock.devices.truth.fold_into_holders`: ``gpulock run`` holds the lease, its
   command uses the device), computes the external use
   (:func:`~gpulock.devices.truth.external_use`), smooths it
   (:class:`~gpulock.devices.truth.Smoother`) and caps it at the capacity;
3. finds over-users (:func:`~gpulock.devices.truth.find_overuse`, held for ``overuse_hold``
   seconds by :class:`~gpulock.devices.truth.OveruseTimer`) and logs each at WARNING, naming
   holder, lease and excess (once when flagged, then once a minute while it lasts);
4. publishes both for ``report_ttl`` seconds; while the report counts the pool grants at most
   capacity − external; the script hands freed room to the queue's head at once.

If the sampler dies (or its device read fails) nothing is published, the report expires after
``report_ttl`` and the pool grants its full capacity again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpulock.protocol.args import _HOST
from gpulock._async import AsyncPool
from gpulock.devices.enforce import process_ancestors
from gpulock.devices.truth import (
    DEFAULT_MARGIN,
    DEFAULT_SLACK,
    Overuse,
    OveruseTimer,
    Smoother,
    external_use,
    find_overuse,
    fold_into_holders,
    leases_by_pid,
)
from gpulock.devices import DeviceError, DeviceReader, DeviceReading

__all__ = [
    "DEFAULT_CLAIM_TTL",
    "DEFAULT_INTERVAL",
    "DEFAULT_OVERUSE_HOLD",
    "DEFAULT_REPORT_TTL",
    "DeviceSampler",
    "SamplerRound",
]

log = logging.getLogger("gpulock.device")

#: seconds between rounds
DEFAULT_INTERVAL = 1.0
#: seconds a report counts: ten missed rounds (a sampler paused by a GC or a slow Redis call
#: keeps its report; one that died stops holding bytes back within 10 s)
DEFAULT_REPORT_TTL = 10.0
#: seconds the sampler claim lasts without renewal: three rounds, as the history sampler's
DEFAULT_CLAIM_TTL = 3.0
#: seconds a holder must stay over before it is flagged (a transient peak of one step is not)
DEFAULT_OVERUSE_HOLD = 5.0
#: seconds between repeated WARNING lines for the same over-user
_LOG_EVERY = 60.0
#: the most over-users one report carries (the script keeps at most 4096 bytes of them)
_MAX_REPORTED = 8


@dataclass(frozen=True)
class SamplerRound:
    """What one round did. ``holder`` False: another sampler holds the claim (nothing else
    read). Bytes; ``granted``: waiters the report's script granted."""

    holder: bool
    reading: DeviceReading | None = None
    external_raw: int = 0
    external: int = 0
    overusers: list[Overuse] = field(default_factory=list)
    granted: int = 0


def _sampler_id(host: str, device: int) -> str:
    h = re.sub(r"[^A-Za-z0-9._-]", "_", host)[:64] or "host"
    return f"{h}:{device}:{os.getpid()}-{secrets.token_hex(4)}"


class DeviceSampler:
    """Samples ``device`` with ``reader`` for ``pool`` (module docstring).

    Args:
        pool: the pool (an :class:`~gpulock.AsyncPool`; the pool must exist).
        reader: the device reader (:func:`~gpulock.devices.open_reader`).
        device: the device index the pool stands for.
        host: this host's name as holders write it in their metadata (default: the hostname
            gpulock writes there, ``socket.gethostname()``).
        interval, report_ttl, claim_ttl, overuse_hold: seconds (the DEFAULT_* above).
        smoother: the hysteresis (default :class:`~gpulock.devices.truth.Smoother` with its
            defaults).
        margin, slack: the over-use rule (:func:`~gpulock.devices.truth.exceeds`).
        clock: monotonic seconds (tests inject one).

    Raises: ValueError (a non-positive interval or ttl, a report_ttl shorter than two rounds).
    """

    def __init__(
        self,
        pool: AsyncPool,
        reader: DeviceReader,
        device: int = 0,
        *,
        host: str | None = None,
        interval: float = DEFAULT_INTERVAL,
        report_ttl: float = DEFAULT_REPORT_TTL,
        claim_ttl: float = DEFAULT_CLAIM_TTL,
        overuse_hold: float = DEFAULT_OVERUSE_HOLD,
        smoother: Smoother | None = None,
        margin: float = DEFAULT_MARGIN,
        slack: int = DEFAULT_SLACK,
        clock: Callable[[], float] = time.monotonic,
    ):
        if interval <= 0 or claim_ttl <= 0:
            raise ValueError(f"interval and claim_ttl must be > 0 s, got {interval}, {claim_ttl}")
        if report_ttl < 2 * interval:
            raise ValueError(
                f"report_ttl ({report_ttl} s) must be at least two intervals ({interval} s each)"
            )
        if margin < 0 or slack < 0:
            raise ValueError(f"margin and slack must be >= 0, got {margin}, {slack}")
        self.pool = pool
        self.reader = reader
        self.device = int(device)
        self.host = host or _HOST
        self.interval = interval
        self.report_ttl = report_ttl
        self.claim_ttl = claim_ttl
        self.smoother = smoother or Smoother()
        self.margin = margin
        self.slack = slack
        self.clock = clock
        self.id = _sampler_id(self.host, self.device)
        self.holding = False
        self.last: SamplerRound | None = None
        self._timer = OveruseTimer(overuse_hold)
        self._logged: dict[tuple[int, tuple[str, ...]], float] = {}
        self._unreadable: tuple[str, float] | None = None  # the last failure logged, and when

    async def run_once(self) -> SamplerRound:
        """One round (module docstring). Raises DeviceError (the device could not be read:
        nothing published), gpulock's errors (Redis)."""
        claim_ms = int(self.claim_ttl * 1000)
        r = await self.pool.device_report(self.id, claim_ms)
        was_holding, self.holding = self.holding, bool(r.holder)
        if not self.holding:
            self.last = SamplerRound(False)
            return self.last
        if not was_holding and r.external_until_ms > r.now_ms:
            # taking over a live report: its value is where the smoothing goes on from (a fall
            # still has to last), not 0
            self.smoother.published = r.external
        reading = await asyncio.to_thread(self.reader.read, self.device)
        st = await self.pool.status(limit=100000)
        if reading.processes is not None:
            # a holder's descendants (gpulock run's command) count as the holder
            holders = leases_by_pid(st.leases, self.host)
            folded = await asyncio.to_thread(
                fold_into_holders, reading.processes, holders, process_ancestors
            )
            reading = dataclasses.replace(reading, processes=folded)
        now = self.clock()
        raw = external_use(reading, st.leases, self.host)
        ext = min(self.smoother.update(raw, now), st.capacity)
        over = find_overuse(reading, st.leases, self.host, margin=self.margin, slack=self.slack)
        held = self._timer.held((o.pid for o in over), now)
        flagged = [
            Overuse(o.pid, o.holder, o.lease_ids, o.leased, o.actual, o.excess, held[o.pid])
            for o in over
            if o.pid in held
        ]
        self._log(flagged, now)
        report = json.dumps([o.to_dict() for o in flagged[:_MAX_REPORTED]], separators=(",", ":"))
        while len(report.encode()) > 4096 and flagged:  # long holder metadata: fewer entries
            flagged = flagged[:-1]
            report = json.dumps([o.to_dict() for o in flagged], separators=(",", ":"))
        r = await self.pool.device_report(
            self.id, claim_ms, ext, int(self.report_ttl * 1000), report
        )
        self.holding = bool(r.holder)
        self.last = SamplerRound(bool(r.written), reading, raw, ext, flagged, r.granted)
        return self.last

    def _log(self, flagged: list[Overuse], now: float) -> None:
        keep = {}
        for o in flagged:
            k = (o.pid, o.lease_ids)
            t = self._logged.get(k)
            if t is None or now - t >= _LOG_EVERY:
                log.warning(
                    "gpulock: pool %s device %d: holder %s (pid %d) uses %d bytes on the device "
                    "for %d leased (lease %s): %d bytes over, for %.1f s",
                    self.pool.name,
                    self.device,
                    json.dumps(o.holder, sort_keys=True),
                    o.pid,
                    o.actual,
                    o.leased,
                    ",".join(o.lease_ids),
                    o.excess,
                    o.over_for,
                )
                t = now
            keep[k] = t
        self._logged = keep

    async def run(self, on_round: Callable[[SamplerRound], None] | None = None) -> None:
        """Rounds every ``interval`` seconds until cancelled, ``on_round`` called with each
        that succeeds; a failed round is logged (WARNING for a device read, DEBUG for Redis)
        and the next one tried."""
        while True:
            start = self.clock()
            try:
                r = await self.run_once()
                if on_round is not None:
                    on_round(r)
            except asyncio.CancelledError:
                raise
            except DeviceError as e:
                # once per distinct failure, then once a minute while it lasts
                now, text = self.clock(), str(e)
                if (
                    self._unreadable is None
                    or self._unreadable[0] != text
                    or (now - self._unreadable[1] >= _LOG_EVERY)
                ):
                    self._unreadable = (text, now)
                    log.warning(
                        "gpulock: pool %s: device %d unreadable: %s", self.pool.name, self.device, e
                    )
            except Exception as e:  # noqa: BLE001 - a sampler never stops for one failure
                log.debug("gpulock: device sampling of pool %s failed: %s", self.pool.name, e)
            await asyncio.sleep(max(0.05, self.interval - (self.clock() - start)))
