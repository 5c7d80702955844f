"""Checks of a request's arguments that gpulock and its SDK both make, before anything is sent,
with the same bounds and messages: a priority, a device index."""

from __future__ import annotations

from typing import Any, Optional

from .errors import InvalidArgument

# A request's priority (gpulock's PRIORITY_MIN, PRIORITY_MAX): higher goes first in the queue.
PRIORITY_MIN, PRIORITY_MAX = -100, 100
# The most devices a pool holds (gpulock's MAX_DEVICES): a device index is in [0, 63].
MAX_DEVICES = 64


def check_priority(priority: Any) -> int:
    """``priority`` if it is an integer in [PRIORITY_MIN, PRIORITY_MAX] (not a bool), else
    InvalidArgument naming it (before anything is sent)."""
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not PRIORITY_MIN <= priority <= PRIORITY_MAX
    ):
        raise InvalidArgument(
            f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority!r:.80}"
        )
    return priority


def check_device(device: Any) -> Optional[int]:
    """``device`` if it is None (any device) or a device index in [0, MAX_DEVICES) (an int,
    not a bool), else InvalidArgument naming it (before anything is sent). Whether the pool
    has that device is the broker's to say (a 422, InvalidArgument naming it)."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < MAX_DEVICES:
        raise InvalidArgument(
            f"device must be a device index in [0, {MAX_DEVICES - 1}] or None, got {device!r:.80}"
        )
    return device
