"""A route's priority, and a request's (docs/SERVICE.md, "Priorities").

A route is declared with ``priority`` (default 0) and ``max_priority`` (default: its
``priority``), both integers in [PRIORITY_MIN, PRIORITY_MAX], checked when the route is declared.
Its requests queue with ``priority``. Only when the limiter names a ``priority_header`` (default
None: headers are ignored, since any client could send one) does a request that carries that
header queue with the header's value instead, clamped to at most ``max_priority``:

    effective = min(int(header), max_priority)

so by default a header can only lower a request's priority (a bulk client yielding to
interactive ones), and raise it only up to the bound the route's author allowed. A header
value that is not an integer in [PRIORITY_MIN, PRIORITY_MAX] is a 400 naming the header and
the value (nothing is leased); an absent header leaves the route's priority."""

from __future__ import annotations

from dataclasses import dataclass

from gpulock_common.options import PRIORITY_MAX, PRIORITY_MIN
from gpulock_common.options import parse_priority as _checked

from gpulock.errors import InvalidArgument
from ._errors import GpuLockHTTPException

__all__ = ["PRIORITY_MAX", "PRIORITY_MIN", "RoutePriority"]


@dataclass(frozen=True)
class RoutePriority:
    """A route's ``priority`` and the most a request's header may ask (``max_priority``)."""

    priority: int = 0
    max_priority: int = 0

    @classmethod
    def of(cls, route: str, priority: object = 0, max_priority: object = None) -> RoutePriority:
        """Checked at declaration: ``max_priority`` None is ``priority``.

        Raises: InvalidArgument naming the route and the value, for a priority or a
        max_priority that is not an integer in [PRIORITY_MIN, PRIORITY_MAX], or a max_priority
        below the priority."""
        try:
            p = _checked(priority)
        except InvalidArgument as e:
            raise InvalidArgument(f"route {route!r}: {e}") from None
        if max_priority is None:
            return cls(p, p)
        try:
            mp = _checked(max_priority)
        except InvalidArgument:
            raise InvalidArgument(
                f"route {route!r}: max_priority must be an integer in "
                f"[{PRIORITY_MIN}, {PRIORITY_MAX}], got {max_priority!r:.80}"
            ) from None
        if mp < p:
            raise InvalidArgument(
                f"route {route!r}: max_priority ({mp}) must not be below priority ({p})"
            )
        return cls(p, mp)

    def for_request(self, header: str | None, value: str | None) -> int:
        """The priority a request queues with: the route's, or (``header`` named and the
        request carries it: ``value``) the header's, at most ``max_priority``.

        Raises: GpuLockHTTPException 400 ``invalid_priority`` naming the header and the value,
        when it is not an integer in [PRIORITY_MIN, PRIORITY_MAX]."""
        if header is None or value is None:
            return self.priority
        try:
            asked = _checked(value)
        except InvalidArgument:
            raise GpuLockHTTPException(
                400,
                f"header {header}: {value!r:.80} is not a priority: send an integer in "
                f"[{PRIORITY_MIN}, {PRIORITY_MAX}] (higher goes first; values above this "
                f"route's max_priority, {self.max_priority}, count as it)",
                "invalid_priority",
            ) from None
        return min(asked, self.max_priority)
