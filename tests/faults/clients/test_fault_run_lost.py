"""``gpulock run`` whose lease is lost while CMD runs: CMD gets SIGTERM (then SIGKILL after
--grace), and gpulock run exits 70 with a message on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from gpulock import Pool
from gpulock.cli import EXIT_LEASE_LOST
from support.procs import alive, gpulock_argv
from support.waiting import wait_until

TTL_S = 1.5

# CMD: writes its pid when ready; on SIGTERM appends "TERM <monotonic>" to the marker and then
# either exits (argv[2] == "exit") or ignores it and keeps running (argv[2] == "ignore").
TRAP = textwrap.dedent("""
    import os, signal, sys, time
    marker, mode = sys.argv[1], sys.argv[2]
    def on_term(signum, frame):
        with open(marker, "a") as f:
            f.write(f"TERM {time.monotonic()}\\n")
        if mode == "exit":
            sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    with open(marker + ".pid", "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(0.02)
""")


def start_run(url: str, name: str, marker: Path, mode: str, grace: float) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *gpulock_argv(),
            "run",
            "--pool",
            name,
            "--amount",
            "10",
            "--ttl",
            str(TTL_S),
            "--grace",
            str(grace),
            "--",
            sys.executable,
            "-c",
            TRAP,
            str(marker),
            mode,
        ],
        env={**os.environ, "GPULOCK_REDIS_URL": url},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(60)
def test_run_lease_lost_while_redis_paused(redis_proc1, tmp_path):
    url, name, marker = redis_proc1.url, "lost", tmp_path / "marker"
    with Pool.from_url(url, name) as pool:
        pool.configure(100)
    p = start_run(url, name, marker, "exit", grace=5)
    try:
        pidfile = Path(str(marker) + ".pid")
        wait_until(lambda: pidfile.exists() and pidfile.read_text(), timeout=10)
        time.sleep(0.6)  # past one heartbeat
        redis_proc1.pause()
        t_pause = time.monotonic()
        try:
            out, err = p.communicate(
                timeout=TTL_S + 8
            )  # gpulock run ends while Redis is still paused
            t_exit = time.monotonic()
        finally:
            redis_proc1.resume()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    t_term = float(marker.read_text().split()[1])
    print(
        f"\nRedis paused: CMD got SIGTERM {t_term - t_pause:.2f}s after the pause (ttl {TTL_S}s); "
        f"gpulock run exited {t_exit - t_pause:.2f}s after it"
    )
    assert p.returncode == EXIT_LEASE_LOST, err
    assert out == ""
    assert "lost while CMD" in err and "sending SIGTERM" in err and f"exit {EXIT_LEASE_LOST}" in err
    # CMD is stopped at the lease's local deadline (at most ~ttl after the pause: the last
    # renewal preceded it), not after the 5 s socket timeout of the hung renew call. The strict
    # "local deadline before the server expiry" check is test_fault_pause's.
    # (The slack is for a loaded machine's scheduling of gpulock run and CMD, which can be
    # descheduled for a second or two; the hung call would end only ~5 s after it was sent.)
    assert t_term - t_pause < TTL_S + 2.5
    assert not alive(int(Path(str(marker) + ".pid").read_text()))


@pytest.mark.timeout(60)
def test_run_lease_deleted_cmd_ignoring_term_gets_sigkill(redis_proc1, tmp_path):
    url, name, marker = redis_proc1.url, "lost", tmp_path / "marker"
    r = redis.Redis.from_url(url, decode_responses=True)
    with Pool.from_url(url, name) as pool:
        pool.configure(100)
        p = start_run(url, name, marker, "ignore", grace=0.5)
        try:
            pidfile = Path(str(marker) + ".pid")
            wait_until(lambda: pidfile.exists() and pidfile.read_text(), timeout=10)
            cmd_pid = int(pidfile.read_text())
            (li,) = pool.status().leases
            # Remove the lease behind the holder's back (as an operator or a lost Redis would).
            k = f"gpulock:{{{name}}}:"
            with r.pipeline(transaction=True) as tx:
                tx.zrem(k + "leases", li.lease_id).hdel(k + "holders", li.lease_id)
                tx.hdel(k + "tickets", li.request_id).hincrby(k + "cfg", "used", -li.amount)
                tx.execute()
            t_del = time.monotonic()
            out, err = p.communicate(timeout=10)
            t_exit = time.monotonic()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        print(
            f"\nlease deleted: gpulock run exited {t_exit - t_del:.2f}s later (renew every {TTL_S / 3:.2f}s, "
            f"grace 0.5s)"
        )
        assert p.returncode == EXIT_LEASE_LOST, err
        assert "server no longer has it" in err and "sending SIGKILL" in err
        assert marker.read_text().startswith("TERM")  # TERM came first, was ignored...
        assert not alive(cmd_pid)  # ...then SIGKILL
        # one renewal period + the TERM grace; slack for a loaded machine (the alternative, a
        # run that never noticed, would run until communicate's 10 s timeout)
        assert t_exit - t_del < TTL_S / 3 + 0.5 + 4.0
        assert pool.status().used == 0
    r.close()
