"""``gpulock serve`` as a user starts it, in a subprocess of a test: the environment it runs in,
the process (its own session, its output in a log file, killed at exit whatever happens) and
how many of its workers are ready.

The caller stops it (SIGTERM to check a clean exit, or :func:`support.procs.stop_group`) and
discards its pid from :data:`support.procs._LIVE`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx

from .procs import _LIVE
from .waiting import wait_until


def serve_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would configure serve from outside the test
    (``GPULOCK_*``, ``OTEL_*``, ``PROMETHEUS_MULTIPROC_DIR``), with ``PYTHONUNBUFFERED=1`` and
    ``extra`` on top."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPULOCK_", "OTEL_")) and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def start_serve(
    log: Path, env: dict[str, str], *args: str, cli: str = "gpulock_service"
) -> subprocess.Popen[bytes]:
    """``python -m <cli> serve <args> --log-level warning`` (``cli``: ``gpulock_service`` or
    ``gpulock``, whose ``serve`` subcommand gpulock_service adds) with ``env``, stdout and stderr into the
    file ``log``, in a session of its own (its pid, the group's id, is in ``_LIVE``)."""
    argv = [sys.executable, "-m", cli, "serve", *args, "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    _LIVE.add(proc.pid)
    return proc


def workers_ready(url: str) -> float | None:
    """The ``gpulock_workers_ready`` gauge on serve's ``/metrics`` at ``url``
    (``http://host:port``): how many workers are ready; None while it does not answer or has
    no such line."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    found = re.search(r"^gpulock_workers_ready (\S+)", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def wait_workers_ready(
    proc: subprocess.Popen[bytes], url: str, n: int, log: Path, timeout: float
) -> None:
    """Wait until ``n`` workers of serve (``proc``, at ``url``) are ready. AssertionError,
    with the end of ``log``, if serve exits first or they are not ready within ``timeout``
    seconds."""
    try:
        wait_until(
            lambda: proc.poll() is not None or workers_ready(url) == n,
            timeout,
            f"{n} workers of gpulock serve ready",
            interval=0.1,
        )
    except AssertionError as e:
        raise AssertionError(f"{e}\n{log.read_text(errors='replace')[-3000:]}") from None
    assert proc.poll() is None, f"gpulock serve exited:\n{log.read_text(errors='replace')[-3000:]}"
