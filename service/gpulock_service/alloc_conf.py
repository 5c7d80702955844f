"""PyTorch's CUDA caching allocator settings for the service: ``PYTORCH_CUDA_ALLOC_CONF`` is
set to ``expandable_segments:True`` (segments that grow in place instead of new fixed blocks:
far less fragmentation when request shapes vary, the field guides' advice) unless the user set
it. It must be in the environment before torch initialises CUDA, so :func:`apply` runs when the
app is built, before any worker imports torch; ``/health`` reports :func:`state`."""

from __future__ import annotations

import os
from typing import Any

VAR = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT = "expandable_segments:True"

_set_by: str | None = None  # "gpulock" or "user", once apply() ran in this process


def apply() -> dict[str, Any]:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to :data:`DEFAULT` unless it is set (to anything, even
    empty: the user's choice); returns :func:`state`. Idempotent."""
    global _set_by
    if _set_by is None:
        if VAR in os.environ:
            _set_by = "user"
        else:
            os.environ[VAR] = DEFAULT
            _set_by = "gpulock"
    return state()


def state() -> dict[str, Any]:
    """``{"value": the variable now (None if unset), "set_by": "gpulock" | "user" | None}``."""
    return {"value": os.environ.get(VAR), "set_by": _set_by}
