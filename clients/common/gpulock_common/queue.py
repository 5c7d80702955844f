"""A waiter's place in a pool's queue, as ``on_queued`` callbacks receive it.

``on_queued(position)`` callbacks were called with the 1-based position as an int; they now
get a :class:`QueuePlace`, which *is* that int (``place == 3``, ``f"{place}"``, arithmetic and
comparisons work as before) and carries the rest of what the server said: the estimated wait
(seconds, or None while the pool's drain rate is not measured: gpulock.estimates.wait) and the
queue's length. The core (gpulock) and the SDK (gpulock-client) hand out the same class.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["QueuePlace"]


class QueuePlace(int):
    """A queued request's 1-based ``position`` (the int's value), its ``estimated_wait``
    (seconds >= 0, None when not known) and the ``queue_length`` (waiters queued, itself
    included; None when not known). Immutable; arithmetic gives plain ints."""

    _wait: Optional[float]
    _length: Optional[int]

    def __new__(
        cls,
        position: int,
        *,
        estimated_wait: Optional[float] = None,
        queue_length: Optional[int] = None,
    ) -> "QueuePlace":
        self = super().__new__(cls, int(position))
        object.__setattr__(self, "_wait", None if estimated_wait is None else float(estimated_wait))
        object.__setattr__(self, "_length", None if queue_length is None else int(queue_length))
        return self

    @property
    def position(self) -> int:
        """The 1-based place in the queue (1: next to be granted), a plain int."""
        return int(self)

    @property
    def estimated_wait(self) -> Optional[float]:
        """Estimated seconds until the grant, or None (no measured drain rate yet)."""
        return self._wait

    @property
    def queue_length(self) -> Optional[int]:
        """Waiters in the pool's queue when this place was reported, or None."""
        return self._length

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("QueuePlace is immutable")

    def __getnewargs_ex__(self) -> tuple[tuple[int], dict[str, Any]]:
        return (int(self),), {"estimated_wait": self._wait, "queue_length": self._length}

    def __str__(self) -> str:
        return str(int(self))

    def __repr__(self) -> str:
        return (
            f"QueuePlace({int(self)}, estimated_wait={self._wait!r}, queue_length={self._length!r})"
        )
