"""The rate limit of the background loops' failure logs (issue 10 item 8): while Redis was down,
one worker logged 185 'heartbeat failed' lines in ~40 s. Now: one line at the first failure,
one summary per period while it keeps failing, one line when it works again. A fake clock."""

from __future__ import annotations

import logging

from gpulock.transport.failure_log import FailureLog


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gpulock"]


def test_one_line_per_state_change_and_a_summary_per_period(caplog):
    caplog.set_level(logging.INFO, logger="gpulock")
    clock = FakeClock()
    fl = FailureLog("heartbeat for pool gpu0", period=30.0, clock=clock)
    fl.ok()  # working all along: nothing to say
    assert _lines(caplog) == []

    # 40 s of failures, one every 0.2 s (200 attempts): the first line, then one summary at 30 s.
    for _ in range(200):
        fl.failed(ConnectionError("Connection refused"))
        clock.t += 0.2
    lines = _lines(caplog)
    assert len(lines) == 2, lines
    assert "heartbeat for pool gpu0 failed (Connection refused)" in lines[0]
    # 150 after the first, in 30 s; 151 since the outage began
    assert lines[1] == (
        "gpulock: heartbeat for pool gpu0 still failing: 150 errors in the last 30 s, 151 since "
        "it began 30 s ago; the last: Connection refused"
    ), lines[1]

    fl.ok()
    lines = _lines(caplog)
    assert len(lines) == 3 and "works again after 200 failed attempt(s) in 40.0s" in lines[2], lines
    fl.ok()
    assert len(_lines(caplog)) == 3  # no second recovery line

    # A new outage starts a new count: a first line again, no stale summary.
    fl.failed(TimeoutError("Timeout reading from socket"))
    lines = _lines(caplog)
    assert len(lines) == 4 and "failed (Timeout reading from socket)" in lines[3]
    clock.t += 29.9
    fl.failed(TimeoutError("again"))
    assert len(_lines(caplog)) == 4  # within the period: silent
    clock.t += 0.2
    fl.failed(TimeoutError("again"))
    lines = _lines(caplog)
    assert (
        len(lines) == 5
        and "still failing: 2 errors in the last 30 s, 3 since it began 30 s ago" in lines[4]
    ), lines


def test_level_and_traceback_of_the_first_line(caplog):
    caplog.set_level(logging.DEBUG, logger="gpulock")
    clock = FakeClock()
    fl = FailureLog("pub/sub subscription for pool p", clock=clock, level=logging.INFO)
    try:
        raise ValueError("boom")
    except ValueError as e:
        fl.failed(e, exc_info=True)
    (rec,) = [r for r in caplog.records if r.name == "gpulock"]
    assert rec.levelno == logging.INFO and rec.exc_info is not None
