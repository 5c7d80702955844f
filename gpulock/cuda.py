"""torch/CUDA helpers for code that leases GPU memory: classify CUDA errors, free the caching
allocator after an OOM, read a device's memory without initialising CUDA in this process, and
measure the peak memory of a piece of work (calibration).

Nothing here imports torch at module import: each function imports it lazily, and the
functions that only *classify* an exception never import it at all (an exception raised by
torch means torch is already in ``sys.modules``). So this module is safe in a gunicorn master
and under ``--preload`` (no CUDA call before fork).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DeviceMemory",
    "cuda_available",
    "device_memory",
    "drop_traceback",
    "empty_cache",
    "is_cuda_error",
    "is_fatal_cuda_error",
    "is_oom",
    "measure_peak",
    "resident_bytes",
    "resolve_device",
]

# Messages of CUDA/cuBLAS/cuDNN allocation failures. All are recoverable: the allocation
# failed, the context is fine (cudaErrorMemoryAllocation is not a sticky error).
_OOM_MARKERS = (
    "cuda out of memory",
    "cuda error: out of memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cudnn_status_not_enough_workspace",
    "hip out of memory",
)
# Errors that poison the CUDA context (sticky errors): every later call in this process fails,
# so the only cure is a new process. Source: CUDA Runtime API, "cudaError" enum — the errors
# documented as "the process must be terminated and relaunched".
_FATAL_MARKERS = (
    "device-side assert triggered",
    "illegal memory access",
    "illegal instruction",
    "misaligned address",
    "unspecified launch failure",
    "invalid program counter",
    "hardware stack error",
    "uncorrectable ecc error",
    "cublas_status_execution_failed",
    "cudnn_status_execution_failed",
    "cudnn_status_internal_error",
    "launch timed out",
    "an illegal address",
)


def _torch() -> Any:
    """torch if it is already imported, else None (never imports it)."""
    return sys.modules.get("torch")


def is_oom(exc: BaseException) -> bool:
    """True for a GPU out-of-memory error: ``torch.cuda.OutOfMemoryError`` (alias
    ``torch.OutOfMemoryError``) or a RuntimeError whose message is a CUDA/cuBLAS/cuDNN
    allocation failure. Never imports torch."""
    t = _torch()
    if t is not None:
        oom_type = getattr(t, "OutOfMemoryError", None) or getattr(
            getattr(t, "cuda", None), "OutOfMemoryError", None
        )
        if oom_type is not None and isinstance(exc, oom_type):
            return True
    if isinstance(exc, (RuntimeError, MemoryError)) and not isinstance(exc, RecursionError):
        msg = str(exc).lower()
        return any(m in msg for m in _OOM_MARKERS)
    return False


def is_cuda_error(exc: BaseException) -> bool:
    """True for any error raised by the CUDA runtime or its libraries (OOM included)."""
    if is_oom(exc):
        return True
    t = _torch()
    acc = getattr(t, "AcceleratorError", None) if t is not None else None
    if acc is not None and isinstance(exc, acc):
        return True
    if isinstance(exc, RuntimeError):
        msg = str(exc).lower()
        return (
            "cuda error" in msg
            or "cublas" in msg
            or "cudnn" in msg
            or any(m in msg for m in _FATAL_MARKERS)
        )
    return False


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """True for a CUDA error that is not an OOM: a device-side assert, an illegal memory
    access and the like poison the context, so the process must exit and be restarted.
    An unrecognised ``CUDA error: ...`` counts as fatal too: it is safer to
    restart a worker than to keep serving from a context that may be broken."""
    return is_cuda_error(exc) and not is_oom(exc)


def drop_traceback(exc: BaseException) -> None:
    """Clear the frames of ``exc``'s traceback (and its causes') so the tensors their locals
    reference can be freed. Call it before :func:`empty_cache` after an OOM: the traceback of a
    CUDA OOM pins the very tensors that filled the memory."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            try:
                traceback.clear_frames(e.__traceback__)
            except Exception:
                pass
            e.__traceback__ = None
        e = e.__cause__ or e.__context__


def empty_cache() -> bool:
    """Give the caching allocator's unused blocks back to the driver
    (``torch.cuda.empty_cache()``). Does nothing (returns False) when torch is not imported or
    CUDA was never initialised in this process, so it never creates a CUDA context."""
    t = _torch()
    if t is None:
        return False
    try:
        if not t.cuda.is_initialized():
            return False
        t.cuda.empty_cache()
        return True
    except Exception:
        return False


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, False when torch is not installed. Imports torch; call
    it in a worker, not in a process that forks workers afterwards."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_device(spec: str = "auto") -> str:
    """``"auto"`` → ``"cuda:0"`` when CUDA is available, else ``"cpu"``; other values pass
    through (``"cuda"`` becomes ``"cuda:0"``)."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return "cuda:0" if cuda_available() else "cpu"
    if spec == "cuda":
        return "cuda:0"
    return spec


def _device_index(device: str) -> int:
    if ":" in device:
        return int(device.split(":", 1)[1])
    return 0


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory in bytes, and where the numbers came from (``nvml``, ``nvidia-smi``,
    ``torch``)."""

    total: int
    free: int
    source: str
    name: str = ""


def device_memory(
    index: int = 0, *, allow_torch_subprocess: bool = True, timeout_s: float = 60.0
) -> DeviceMemory | None:
    """Total and free memory of GPU ``index`` **without initialising CUDA in this process**
    (safe before gunicorn forks its workers). Tries, in order: NVML (``pynvml`` /
    ``nvidia-ml-py``), ``nvidia-smi``, and ``torch.cuda.mem_get_info`` in a short-lived
    subprocess. Returns None when no GPU is found."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            info = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            return DeviceMemory(
                int(info.total),
                int(info.free),
                "nvml",
                name.decode() if isinstance(name, bytes) else str(name),
            )
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = (
                subprocess.run(
                    [
                        smi,
                        f"--id={index}",
                        "--query-gpu=memory.total,memory.free,name",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=timeout_s,
                    check=True,
                )
                .stdout.strip()
                .splitlines()
            )
            total, free, name = (x.strip() for x in out[0].split(",", 2))
            return DeviceMemory(
                int(float(total)) * 2**20, int(float(free)) * 2**20, "nvidia-smi", name
            )
        except Exception:
            pass
    if allow_torch_subprocess and (
        os.path.exists("/dev/nvidiactl") or os.environ.get("CUDA_VISIBLE_DEVICES")
    ):
        code = (
            "import torch,sys\n"
            "if not torch.cuda.is_available(): sys.exit(3)\n"
            f"f,t=torch.cuda.mem_get_info({index}); print(t, f, torch.cuda.get_device_name({index}))"
        )
        try:
            r = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s
            )
            if r.returncode == 0:
                total, free, name = r.stdout.strip().split(" ", 2)
                return DeviceMemory(int(total), int(free), "torch", name)
        except Exception:
            pass
    return None


def resident_bytes(device: str, *, context_bytes: int = 0) -> int | None:
    """What this process keeps on ``device`` between requests: the caching allocator's
    reservation (``torch.cuda.memory_reserved``, weights and cached blocks) plus
    ``context_bytes`` for the CUDA context, which the allocator does not see. None on CPU."""
    if not device.startswith("cuda"):
        return None
    import torch

    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_reserved(device)) + int(context_bytes)


def measure_peak(fn: Callable[[], Any], device: str) -> int:
    """Run ``fn()`` and return the peak of memory it allocated on ``device`` above what was
    allocated before (``torch.cuda.max_memory_allocated`` after
    ``reset_peak_memory_stats``), in bytes. Used to calibrate per-shape estimates.

    Raises: RuntimeError on a CPU device (there is nothing to measure)."""
    if not device.startswith("cuda"):
        raise RuntimeError(f"measure_peak needs a CUDA device, got {device!r}")
    import torch

    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return max(0, int(torch.cuda.max_memory_allocated(device)) - int(base))
