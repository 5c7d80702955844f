"""What ``gpulock serve`` says on stderr, and its exit codes: one place for the supervisor
(``serve.py``) and the embedded server's keeper (``embedded_server.py``)."""

from __future__ import annotations

import signal
import sys

EXIT_USAGE = 2  # a bad option, setting or busy port: nothing was started
EXIT_UNAVAILABLE = 69  # the embedded Redis could not be kept running: the service was stopped


def say(msg: str) -> None:
    """One line on stderr, prefixed ``gpulock serve:``, flushed at once."""
    print(f"gpulock serve: {msg}", file=sys.stderr, flush=True)


def describe_exit(rc: int | None) -> str:
    """A child's return code in words: ``killed by SIGKILL`` (negative: a signal) or
    ``exit status N``."""
    if rc is not None and rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"
