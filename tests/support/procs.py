"""Subprocesses of the tests: read their state in /proc, signal them, the argv of the
``gpulock`` CLI, and a server process in its own session that is killed at teardown and, whatever
happens, at exit."""

from __future__ import annotations

import atexit
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

_LIVE: set[int] = set()  # process-group ids still running (killed at exit, whatever happens)


@atexit.register
def _kill_leftovers() -> None:
    for pgid in list(_LIVE):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def gpulock_argv() -> list[str]:
    """The argv prefix that runs the ``gpulock`` CLI of this interpreter's environment (its
    console script, or ``python -c`` when the package is on ``sys.path`` only)."""
    script = Path(sys.executable).with_name("gpulock")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from gpulock.cli import main; sys.exit(main())"]


#: Run as ``python -c _DEFAULT_SIGNALS ARGV...``: SIGINT, SIGTERM and SIGHUP back to their
#: default disposition, then exec ARGV (same pid).
_DEFAULT_SIGNALS = (
    "import os, signal, sys\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
    "    signal.signal(s, signal.SIG_DFL)\n"
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def with_default_signals(argv: list[str]) -> list[str]:
    """``argv`` run with SIGINT, SIGTERM and SIGHUP at their default disposition, whatever the
    tests inherited: a test run started with ``&`` from a script, or under ``nohup``, has them
    ignored, and ``gpulock run`` leaves an ignored signal ignored (so a test that sends one
    would wait for an exit that never comes). The process is ``argv``'s once it has exec'd
    (same pid)."""
    return [sys.executable, "-c", _DEFAULT_SIGNALS, *argv]


def broker_argv(port: int, redis_url: str) -> list[str]:
    """The argv of the HTTP lease broker's own entry point on 127.0.0.1:``port`` against
    ``redis_url`` (tokens and limits come from the environment)."""
    return [
        sys.executable,
        "-m",
        "gpulock_broker",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--redis-url",
        redis_url,
        "--log-level",
        "warning",
    ]


def proc_state(pid: int) -> str:
    """One letter of /proc/PID/stat: R, S, T (stopped), Z (zombie), ...; "" when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (killed, not yet reaped by its parent)."""
    return proc_state(pid) not in ("", "Z")


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid``; nothing if it is gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc), zombies left out."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                data = f.read()
        except OSError:
            continue
        rest = data.rsplit(")", 1)[1].split()
        if int(rest[1]) == pid and rest[0] != "Z":
            out.append(int(stat.split("/")[2]))
    return sorted(out)


def cmdline(pid: int) -> str:
    """The command line of ``pid``, arguments joined by spaces; "" when gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_group(proc: subprocess.Popen, grace: float) -> None:
    """Stop the process group led by ``proc`` (started with ``start_new_session=True``): SIGTERM,
    up to ``grace`` seconds for the leader to exit, then SIGKILL to the group (members that
    outlived their leader, if any) and up to 5 s more; it leaves the at-exit list."""
    pgid = proc.pid
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    _LIVE.discard(pgid)


class Proc:
    """A server process in its own session, killed at teardown (and at exit, whatever happens)."""

    def __init__(self, cmd: list[str], env: dict, log_path, port: int):
        self.port, self.url, self.log_path = port, f"http://127.0.0.1:{port}", log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        _LIVE.add(self.proc.pid)

    def wait_up(self, path: str = "/health", timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
                )
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(self.log_path.read_text()[-3000:])

    def stop(self) -> None:
        stop_group(self.proc, 15)
        self._log.close()


def finish_all(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for every process (``stderr=PIPE``, text) and assert it exited 0 (its stderr's tail
    in the message). Raises AssertionError; the caller's ``finally`` calls :func:`kill_all`."""
    for pr in procs:
        _, err = pr.communicate(timeout=timeout)
        assert pr.returncode == 0, (err or "")[-3000:]


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL and reap the processes still running (a test's cleanup)."""
    for pr in procs:
        if pr.poll() is None:
            pr.kill()
            pr.wait()
