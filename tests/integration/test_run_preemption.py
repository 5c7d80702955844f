"""``gpulock run`` under preemption (issue 33), as a real process against a real Redis: a job
holding the whole pool is asked to yield by a request of higher priority; its command gets
--yield-signal (SIGTERM by default, SIGUSR1, or none), a cooperative one exits and the waiter is
granted within the yield grace; an uncooperative one is stopped as on a lost lease and the
waiter is granted once the server takes the lease back. Each job's ttl is at most the yield
grace, so the server's deadline is now + grace: the bounds below are the server's guarantee
(plus the waiter's re-poll and a second), not a speed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from gpulock import AcquireTimeout, Pool
from gpulock.cli import EXIT_LEASE_LOST
from gpulock.protocol.keys import pool_key
from support.preempt import enable_preemption
from support.procs import gpulock_argv, with_default_signals
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

GAP = 5
# Long enough that a cooperative job on a loaded machine exits well within it; the job's ttl is
# at most the grace, so the server's deadline is the ask + the grace.
YIELD_GRACE_S = 10.0
JOB_TTL_S = 3.0
WAIT_S = 60.0  # a generous deadline for what must happen; never a bound on its speed

# CMD: note each signal in the marker file; exit 42 on it unless told to ignore it
JOB = textwrap.dedent("""
    import os, signal, sys, time
    marker, leave = sys.argv[1], sys.argv[2] == "exit"
    def on_sig(signum, frame):
        with open(marker, "a") as f:
            f.write(signal.Signals(signum).name + "\\n")
        if leave:
            sys.exit(42)
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, on_sig)
    with open(marker + ".ready", "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.05)
""")


def _pool(url: str) -> None:
    r = subprocess.run(
        [*gpulock_argv(), "pool", "set", "gpu0", "--capacity", "1GiB"],
        env={**os.environ, "GPULOCK_REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    c = redis.Redis.from_url(url)
    try:
        enable_preemption(c, "gpu0", GAP, YIELD_GRACE_S)
    finally:
        c.close()


def _job(url: str, marker: Path, *opts: str, on_signal: str = "exit") -> subprocess.Popen:
    """``gpulock run`` holding the whole pool for JOB (``opts`` before ``--``)."""
    argv = [*gpulock_argv(), "run", "-p", "gpu0", "-a", "1GiB", "--ttl", str(JOB_TTL_S)]
    argv += ["--grace", "1", *opts, "--", sys.executable, "-c", JOB, str(marker), on_signal]
    p = subprocess.Popen(
        with_default_signals(argv),
        env={**os.environ, "GPULOCK_REDIS_URL": url},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: Path(str(marker) + ".ready").exists(), timeout=WAIT_S, interval=0.05)
    return p


def _urgent(url: str, priority: int = 10) -> tuple[float, int]:
    """A request of ``priority`` for the whole pool from another pool object: (seconds from
    its start to its grant, the grant's fencing token); released at once."""
    with Pool.from_url(url, "gpu0") as pool:
        t0 = time.monotonic()
        lease = pool.acquire("1GiB", priority=priority, timeout=WAIT_S)
        took = time.monotonic() - t0
        token = lease.token
        lease.release()
    return took, token


def _cfg(url: str, field: str) -> int:
    c = redis.Redis.from_url(url)
    try:
        v = c.hget(pool_key("gpu0", "cfg"), field)
    finally:
        c.close()
    return int(v) if v else 0


@pytest.fixture
def url(redis_proc1):
    _pool(redis_proc1.url)
    return redis_proc1.url


def test_cooperative_job_gets_sigterm_releases_and_the_waiter_is_granted(url, tmp_path):
    marker = tmp_path / "m"
    p = _job(url, marker, "--priority", "-10")
    took, _ = _urgent(url)
    out, err = p.communicate(timeout=WAIT_S)
    assert p.returncode == 42, err  # CMD's own status: it exited on the signal
    assert marker.read_text().splitlines() == ["SIGTERM"]
    assert "asked to yield" in err and "sending SIGTERM" in err, err
    # released, not taken back: before the deadline (the ask + the grace), on the server's
    # clock, and the release's own hand-off granted the urgent request
    assert _cfg(url, "y_done") == 1 and _cfg(url, "y_taken") == 0
    # the guarantee, on the server's clock: yielded within the grace plus one second
    assert _cfg(url, "y_done_ms") <= (YIELD_GRACE_S + 1.0) * 1000
    print(f"cooperative: urgent acquire granted after {took:.3f}s")  # for the report


def test_uncooperative_job_is_stopped_as_on_a_lost_lease(url, tmp_path):
    marker = tmp_path / "m"
    p = _job(url, marker, on_signal="ignore")
    took, _ = _urgent(url)
    out, err = p.communicate(timeout=WAIT_S)
    assert p.returncode == EXIT_LEASE_LOST, err
    sigs = marker.read_text().splitlines()
    assert sigs[0] == "SIGTERM" and len(sigs) >= 2, sigs  # asked, then stopped (lost)
    assert "asked to yield" in err and "lost while CMD" in err and "SIGKILL" in err, err
    # taken back at the deadline: max(grace, the job's expiry at the ask) = the ask + the grace
    assert _cfg(url, "y_taken") == 1 and _cfg(url, "y_done") == 0
    print(f"uncooperative: urgent acquire granted after {took:.3f}s")  # for the report


def test_yield_signal_sigusr1(url, tmp_path):
    marker = tmp_path / "m"
    p = _job(url, marker, "--yield-signal", "usr1")
    _urgent(url)
    out, err = p.communicate(timeout=WAIT_S)
    assert p.returncode == 42, err
    assert marker.read_text().splitlines() == ["SIGUSR1"]
    assert "sending SIGUSR1" in err, err


def test_yield_signal_none_sends_nothing(url, tmp_path):
    marker = tmp_path / "m"
    p = _job(url, marker, "--yield-signal", "none")
    _urgent(url)  # granted once the server takes the lease back
    out, err = p.communicate(timeout=WAIT_S)
    assert p.returncode == EXIT_LEASE_LOST, err
    # the only signal CMD saw is the lost lease's SIGTERM, after the yield was said
    assert marker.read_text().splitlines()[0] == "SIGTERM"
    said = err.index("asked to yield")
    assert "not signalled (--yield-signal none)" in err and err.index("lost while CMD") > said


def test_not_preemptible_job_is_never_asked(url, tmp_path):
    marker = tmp_path / "m"
    p = _job(url, marker, "--no-preemptible")
    with Pool.from_url(url, "gpu0") as pool:
        with pytest.raises(AcquireTimeout):  # it waits past the grace and the job's ttl
            pool.acquire("1GiB", priority=10, timeout=2 * YIELD_GRACE_S)
    assert _cfg(url, "y_asked") == 0
    assert not marker.exists()  # CMD got no signal
    p.terminate()
    p.communicate(timeout=WAIT_S)


@pytest.mark.parametrize("bad", ["SIGFOO", "999", "-3", ""])
def test_bad_yield_signal_exits_2_naming_it(url, bad):
    r = subprocess.run(
        [*gpulock_argv(), "run", "-p", "gpu0", "-a", "1MiB", "--yield-signal", bad, "--", "true"],
        env={**os.environ, "GPULOCK_REDIS_URL": url},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and f"--yield-signal: {bad!r}" in r.stderr, r.stderr
