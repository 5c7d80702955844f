"""Device truth in one worker: the device its pool stands for and the worker's
:class:`~gpulock.devices.sampler.DeviceSampler` of it, which reconciles the pool with the
device's real memory (docs/SEMANTICS.md, "Device truth"), and what ``/health`` shows of it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpulock.errors import InvalidArgument
from ._backend import Backend

if TYPE_CHECKING:
    from gpulock.devices.sampler import DeviceSampler

log = logging.getLogger("gpulock.fastapi")


class DeviceTruth:
    """The worker's device and its sampler.

    Args:
        index: the device index (0..1023) the pool stands for; None: no sampler.
        reader: how to read the device: ``auto``, ``nvml``, ``torch`` or ``fake:PATH``
            (:func:`gpulock.devices.open_reader`).
        backend: the pool the sampler reports to, and its last status read.

    Attributes:
        index, reader: as given (``index`` an int or None).
        sampler: the running sampler (one worker of the pool samples, the others stand by);
            None before :meth:`start`, without an index, or when the reader did not open.

    Raises: InvalidArgument for an index that is not a device index.
    """

    def __init__(self, index: int | None, reader: str, backend: Backend):
        if index is not None and (isinstance(index, bool) or not 0 <= int(index) <= 1023):
            raise InvalidArgument(f"device must be a device index 0..1023, got {index!r}")
        self.index = None if index is None else int(index)
        self.reader = reader
        self.sampler: DeviceSampler | None = None
        self._backend = backend

    def start(self, spawn: Callable[..., Any]) -> None:
        """Run the sampler in the background (``spawn``: a task the limiter's ``stop()``
        cancels), when an index was given; a reader that cannot be opened is logged and leaves
        the pool without device truth. Call it after the backend connected."""
        if self.index is None:
            return
        from gpulock.devices.sampler import DeviceSampler
        from gpulock.devices import DeviceError, open_reader

        assert self._backend.pool is not None, "the backend is not connected"
        try:
            reader = open_reader(self.reader)
        except (ValueError, DeviceError) as e:
            log.warning("gpulock: pool %s: no device sampler: %s", self._backend.pool_name, e)
            return
        self.sampler = DeviceSampler(self._backend.pool, reader, self.index)
        spawn(self.sampler.run(), name="gpulock-device-sampler")

    def truth(self) -> dict[str, Any]:
        """The device's truth as last read (never waits on Redis): the pool's external use and
        effective capacity from the last status read (bytes; ``report_left`` seconds the report
        still counts), its over-users, and whether this worker samples."""
        st = self._backend.status
        ds = self.sampler
        return {
            "device": self.index,
            "sampling": bool(ds and ds.holding),
            "reader": ds.reader.name if ds else None,
            "external_bytes": st.external if st else 0,
            "effective_capacity": st.effective_capacity if st else None,
            "report_left": st.external_left if st else 0.0,
            "overusers": st.overusers if st else [],
        }
