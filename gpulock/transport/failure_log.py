"""Rate-limited logging of a background loop's repeated failures (a Redis outage made the
heartbeat log 185 lines in 40 s before). Used by the runtime's heartbeat and listener and by
the GpuLimiter's reaper tick and claim refresh."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("gpulock")


class FailureLog:
    """The log lines of one background loop's repeated failures, rate-limited: one line at the
    first failure, one when the loop works again, and while it keeps failing one summary per
    ``period`` seconds (``still failing: N errors in the last 30 s, M since it began T s ago``)
    instead of a line per try.

    Args:
        what: what fails, for the messages ("heartbeat for pool gpu0").
        period: seconds between summaries while failing.
        clock: monotonic clock in seconds (tests inject a fake one).
        level: the logging level of the lines.
    """

    def __init__(
        self,
        what: str,
        *,
        period: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        level: int = logging.WARNING,
        logger: logging.Logger = log,
    ):
        self.what, self.period, self.clock, self.level, self.log = (
            what,
            period,
            clock,
            level,
            logger,
        )
        self.failing = False
        self.errors = 0  # failures since the first one of this run
        self.last: BaseException | None = None  # the last failure (None once it works)
        self._since = 0.0
        self._window = 0  # failures since the last line
        self._next_summary = 0.0

    def failed(self, err: BaseException, *, exc_info: bool = False) -> None:
        """One failed attempt (``exc_info``: add the traceback to the first line)."""
        now = self.clock()
        self.errors += 1
        self.last = err
        if not self.failing:
            self.failing, self._since, self._window = True, now, 0
            self._next_summary = now + self.period
            self.log.log(
                self.level,
                "gpulock: %s failed (%s); retrying (repeated failures are summed up every %.0fs)",
                self.what,
                err,
                self.period,
                exc_info=exc_info,
            )
            return
        self._window += 1
        if now >= self._next_summary:
            self.log.log(
                self.level,
                "gpulock: %s still failing: %d errors in the last %.0f s, %d since it "
                "began %.0f s ago; the last: %s",
                self.what,
                self._window,
                self.period,
                self.errors,
                now - self._since,
                err,
            )
            self._window = 0
            self._next_summary = now + self.period

    @property
    def failing_for(self) -> float:
        """Seconds since the first failure of the current run of failures (0 when none)."""
        return self.clock() - self._since if self.failing else 0.0

    def ok(self) -> None:
        """An attempt succeeded: say so once if the loop was failing."""
        if self.failing:
            self.log.log(
                self.level,
                "gpulock: %s works again after %d failed attempt(s) in %.1fs",
                self.what,
                self.errors,
                self.clock() - self._since,
            )
        self.failing, self.errors, self.last = False, 0, None
