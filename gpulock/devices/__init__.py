"""Device readers: what a GPU says about its memory, read the same way whatever reads it.

A reader answers :meth:`DeviceReader.read` with a :class:`DeviceReading` for one device index:
the device's total and used bytes and, when the driver tells (NVML), the bytes each process
uses on it. Three readers:

* :class:`NvmlReader` — NVML through ``nvidia-ml-py`` (the ``gpu`` extra: ``pip install
  gpulock[gpu]``), imported on first use. Per-process use from
  ``nvmlDeviceGetComputeRunningProcesses`` and ``...GraphicsRunningProcesses``; when the
  driver withholds a process's use (no permission, some containers) ``processes`` is None.
* :class:`TorchReader` — ``torch.cuda.mem_get_info``: totals only (``processes`` None). It
  makes a CUDA context in the reading process (some hundreds of MiB of device memory), so it
  is the fallback when NVML is missing.
* :class:`FakeReader` — a JSON file, read at every call, so tests and CPU dry runs inject
  devices and change them by rewriting the file (write a temporary file and ``os.replace`` it:
  a reader never sees half a file). Shape::

      {"devices": [{"index": 0, "total": 85899345920, "used": 1073741824,
                    "processes": {"4242": 1073741824}}]}

  ``processes`` (pid -> bytes) may be absent or null: a device without per-process use.

:func:`open_reader` picks one from a spec (``auto``, ``nvml``, ``torch``, ``fake:PATH``);
``auto`` takes ``$GPULOCK_FAKE_DEVICES`` (a fake file's path) when set, else NVML when
importable, else torch when CUDA is available. Nothing here is verified on a real GPU yet
(docs/SERVICE.md, "What is verified on a GPU").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gpulock_common.options import MAX_DEVICES

__all__ = [
    "FAKE_DEVICES_ENV",
    "DeviceError",
    "DeviceReader",
    "DeviceReading",
    "FakeReader",
    "NvmlReader",
    "TorchReader",
    "open_reader",
    "write_fake_devices",
]

FAKE_DEVICES_ENV = "GPULOCK_FAKE_DEVICES"


class DeviceError(RuntimeError):
    """A device could not be read (no such index, no driver, an unreadable fake file)."""


@dataclass(frozen=True)
class DeviceReading:
    """One device's memory at one moment. Bytes.

    ``processes``: pid -> bytes that process uses on the device, or None when the reader has
    no per-process use (torch, or a driver that withholds it)."""

    index: int
    total_bytes: int
    used_bytes: int
    processes: dict[int, int] | None = None


class DeviceReader(Protocol):
    """Reads one device. ``name`` says which reader it is (``nvml``, ``torch``, ``fake``)."""

    name: str

    def read(self, index: int) -> DeviceReading:
        """The device's memory now. Raises DeviceError."""
        ...

    def count(self) -> int:
        """How many devices it sees (indices 0 .. count-1). Raises DeviceError."""
        ...


def _nonneg_int(v: Any, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise DeviceError(f"{what} must be a non-negative integer of bytes, got {v!r}")
    return v


class FakeReader:
    """Reads devices from a JSON file (module docstring), at every call. ``path``: the file."""

    name = "fake"

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def _devices(self) -> list[Any]:
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DeviceError(f"fake device file {str(self.path)!r} unreadable: {e}") from e
        devs = doc.get("devices") if isinstance(doc, dict) else None
        if not isinstance(devs, list):
            raise DeviceError(f"fake device file {str(self.path)!r} has no 'devices' list")
        return devs

    def count(self) -> int:
        """The entries of the file (a device file lists devices 0 .. count-1)."""
        return len(self._devices())

    def read(self, index: int) -> DeviceReading:
        devs = self._devices()
        for n, d in enumerate(devs):
            ix = d.get("index") if isinstance(d, dict) else None
            if isinstance(ix, bool) or not isinstance(ix, int):
                raise DeviceError(
                    f"fake device file {str(self.path)!r}: entry {n} needs an integer 'index', "
                    f"got {d!r:.80}"
                )
            if ix == index:
                procs = d.get("processes")
                table: dict[int, int] | None = None
                if procs is not None:
                    if not isinstance(procs, dict):
                        raise DeviceError(f"fake device {index}: 'processes' must map pid to bytes")
                    table = {}
                    for k, v in procs.items():
                        try:
                            pid = int(k)
                        except ValueError as e:
                            raise DeviceError(
                                f"fake device {index}: pid {k!r} is not a number"
                            ) from e
                        if pid < 1:
                            raise DeviceError(f"fake device {index}: pid {k!r} is not a pid")
                        table[pid] = _nonneg_int(v, f"fake device {index} process {k}")
                total = _nonneg_int(d.get("total"), f"fake device {index} 'total'")
                used = _nonneg_int(d.get("used"), f"fake device {index} 'used'")
                if used > total:
                    raise DeviceError(
                        f"fake device {index}: 'used' {used} is more than its 'total' {total}"
                    )
                return DeviceReading(index, total, used, table)
        raise DeviceError(f"fake device file {str(self.path)!r} has no device {index}")


def write_fake_devices(path: str | os.PathLike[str], devices: list[dict[str, Any]]) -> None:
    """Write a fake device file atomically (a temporary file, then ``os.replace``).
    ``devices``: ``[{"index", "total", "used", "processes"?}]`` as in the module docstring."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"devices": devices}), encoding="utf-8")
    os.replace(tmp, p)


class NvmlReader:
    """NVML through ``nvidia-ml-py`` (imported, and NVML initialised, on first read)."""

    name = "nvml"

    def __init__(self) -> None:
        self._nvml: Any = None

    def _lib(self) -> Any:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as e:
                raise DeviceError(
                    "NVML is not installed: pip install 'gpulock[gpu]' (nvidia-ml-py)"
                ) from e
            try:
                pynvml.nvmlInit()
            except Exception as e:  # noqa: BLE001 - pynvml.NVMLError and friends
                raise DeviceError(f"NVML could not start: {e}") from e
            self._nvml = pynvml
        return self._nvml

    def count(self) -> int:
        nv = self._lib()
        try:
            return int(nv.nvmlDeviceGetCount())
        except Exception as e:  # noqa: BLE001 - pynvml.NVMLError
            raise DeviceError(f"NVML could not count the devices: {e}") from e

    def read(self, index: int) -> DeviceReading:
        nv = self._lib()
        try:
            h = nv.nvmlDeviceGetHandleByIndex(index)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            procs: dict[int, int] | None = {}
            for fn in (
                nv.nvmlDeviceGetComputeRunningProcesses,
                nv.nvmlDeviceGetGraphicsRunningProcesses,
            ):
                for p in fn(h):
                    used = getattr(p, "usedGpuMemory", None)
                    if used is None or procs is None:
                        procs = None  # the driver withholds it: no per-process use at all
                        continue
                    procs[int(p.pid)] = procs.get(int(p.pid), 0) + int(used)
        except DeviceError:
            raise
        except Exception as e:  # noqa: BLE001 - pynvml.NVMLError
            raise DeviceError(f"NVML could not read device {index}: {e}") from e
        return DeviceReading(index, int(mem.total), int(mem.used), procs)


class TorchReader:
    """``torch.cuda.mem_get_info`` (no per-process use; makes a CUDA context, see above)."""

    name = "torch"

    def count(self) -> int:
        try:
            import torch

            return int(torch.cuda.device_count())
        except Exception as e:  # noqa: BLE001 - ImportError, a broken driver
            raise DeviceError(f"torch could not count the devices: {e}") from e

    def read(self, index: int) -> DeviceReading:
        try:
            import torch

            free, total = torch.cuda.mem_get_info(index)
        except Exception as e:  # noqa: BLE001 - ImportError, no CUDA, a bad index
            raise DeviceError(f"torch could not read device {index}: {e}") from e
        return DeviceReading(index, int(total), int(total) - int(free), None)


def read_all(reader: DeviceReader, limit: int = MAX_DEVICES) -> list[DeviceReading]:
    """Every device ``reader`` sees, devices 0 .. ``reader.count()``-1: what ``gpulock pool
    set --devices auto`` makes a pool of. NVML's indices are the PCI bus order, which CUDA's
    device ordinals follow only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.

    Raises DeviceError: the reader sees no device or more than ``limit``, or one of them
    cannot be read or reports no memory (naming it: a pool made of the others would leave a
    GPU out without a word)."""
    n = reader.count()
    if n < 1:
        raise DeviceError(f"the {reader.name} reader sees no device")
    if n > limit:
        raise DeviceError(
            f"the {reader.name} reader sees {n} devices; a pool holds at most {limit}"
        )
    out = [reader.read(i) for i in range(n)]
    for d in out:
        if d.total_bytes < 1:
            raise DeviceError(f"device {d.index} reports {d.total_bytes} bytes of memory")
    return out


def open_reader(spec: str = "auto") -> DeviceReader:
    """A reader for ``spec``: ``auto``, ``nvml``, ``torch`` or ``fake:PATH`` (module docstring).

    Raises: ValueError (an unknown spec, naming it), DeviceError (``auto`` found no reader)."""
    if spec.startswith("fake:"):
        if not spec[5:]:
            raise ValueError("device reader 'fake:' needs a file path, e.g. fake:/tmp/devices.json")
        return FakeReader(spec[5:])
    if spec == "nvml":
        return NvmlReader()
    if spec == "torch":
        return TorchReader()
    if spec != "auto":
        raise ValueError(f"device reader must be auto, nvml, torch or fake:PATH, got {spec!r}")
    fake = os.environ.get(FAKE_DEVICES_ENV)
    if fake:
        return FakeReader(fake)
    try:
        import pynvml  # noqa: F401

        return NvmlReader()
    except ImportError:
        pass
    try:
        import torch

        if torch.cuda.is_available():
            return TorchReader()
    except ImportError:
        pass
    raise DeviceError(
        f"no device reader: install nvidia-ml-py (pip install 'gpulock[gpu]'), or torch with "
        f"CUDA, or set {FAKE_DEVICES_ENV} to a fake device file"
    )
