"""Readiness of one worker: whether it takes guarded calls now, and why not (``/ready``,
``gpulock_workers_ready``), from Redis's last answer, the application's conditions, the
resident leases and any sticky CUDA error."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import Any

from ._backend import Backend
from ._errors import not_ready
from ._metrics import metrics
from ._resident import ResidentLeases
from ._settings import Settings

log = logging.getLogger("gpulock.fastapi")


class Readiness:
    """The worker's readiness.

    Args:
        settings: ``reaper_interval`` (status freshness) and ``exit_on_fatal``.
        backend: the last status read and the last Redis error.
        resident: the resident leases wanted and held.

    Attributes:
        conditions: ``name → (ok, message)`` set by the application.
        fatal_error: the sticky CUDA error that makes this worker exit, None before one.
        started, stopping: set by the limiter's ``start()`` and ``stop()``.
    """

    def __init__(self, settings: Settings, backend: Backend, resident: ResidentLeases):
        self._settings = settings
        self._backend = backend
        self._resident = resident
        self.conditions: dict[str, tuple[bool, str]] = {}
        self.fatal_error: str | None = None
        self.started = False
        self.stopping = False

    def set_condition(self, name: str, ok: bool, message: str = "") -> None:
        """An application condition for readiness (e.g. ``"model"``). Guarded calls are refused
        with 503 while any condition is false."""
        self.conditions[name] = (ok, message)
        self.publish()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, details)``: Redis answered the last status read (within 3 reaper
        intervals), every condition holds, every resident lease is valid, no fatal CUDA
        error."""
        be = self._backend
        checks: dict[str, Any] = {}
        fresh = be.status is not None and (time.monotonic() - be.status_at) < max(
            3 * self._settings.reaper_interval, 3.0
        )
        checks["redis"] = {
            "ok": bool(fresh and be.redis_error is None),
            "message": be.redis_error or ("" if fresh else "no recent status from Redis"),
        }
        devices = self._devices_problem()
        if devices:
            checks["devices"] = {"ok": False, "message": devices}
        for k, (ok, msg) in self.conditions.items():
            checks[k] = {"ok": ok, "message": msg}
        wanted = self._resident.wanted
        if wanted:
            held = self._resident.held()
            ok = held >= wanted
            checks["resident_lease"] = {
                "ok": ok,
                "held_bytes": held,
                "wanted_bytes": wanted,
                "message": "" if ok else self._resident.message(),
            }
        if self.fatal_error:
            checks["cuda"] = {"ok": False, "message": self.fatal_error}
        ready = all(c["ok"] for c in checks.values())
        return ready, checks

    def accepting(self) -> tuple[bool, str]:
        """``(True, "")`` when this worker takes guarded calls now, else ``(False, why)``."""
        if self.fatal_error:
            return False, f"worker is exiting after a CUDA error: {self.fatal_error}"
        if self.stopping or not self.started:
            return False, "worker is not started or is shutting down"
        devices = self._devices_problem()
        if devices:
            return False, devices
        for k, (ok, msg) in self.conditions.items():
            if not ok:
                return False, f"{k}: {msg}" if msg else f"{k} not ready"
        if self._resident.wanted and self._resident.held() < self._resident.wanted:
            return False, self._resident.message()
        return True, ""

    def _devices_problem(self) -> str:
        """Why this worker's pool does not suit it ("" when it does): the integration runs
        a model on one GPU and leases without a device, so its pool must have one device
        (docs/SEMANTICS.md, "Devices and placement"), or its leases would count on GPUs it
        does not use."""
        st = self._backend.status
        if st is None or len(st.devices) < 2:
            return ""
        return (
            f"pool {st.pool!r} has {len(st.devices)} devices, but this service runs its model "
            "on one GPU and leases from a pool of one device: give it a pool of its own "
            "(gpulock pool set NAME --capacity SIZE)"
        )

    def check_accepting(self) -> None:
        """Raise 503 (not ready) unless this worker takes guarded calls now."""
        ok, why = self.accepting()
        if not ok:
            raise not_ready(why)

    def publish(self) -> None:
        """Set ``gpulock_workers_ready`` for this process."""
        with contextlib.suppress(Exception):
            metrics().ready.set(1 if (self.started and self.readiness()[0]) else 0)

    def fatal(self, message: str) -> None:
        """A sticky CUDA error: not ready from now on; exit so the process manager restarts
        us (after the 500 has been sent: uvicorn's graceful shutdown finishes it)."""
        if self.fatal_error is None:
            self.fatal_error = message
            log.error("gpulock: CUDA error, this worker is exiting: %s", message)
        self.publish()
        if self._settings.exit_on_fatal:
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
