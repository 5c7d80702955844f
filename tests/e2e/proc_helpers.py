"""A server process for the e2e tests that run something other than the service (the broker's
own entry point, a user's app): its own session, killed at teardown and at exit."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
from e2e_helpers import _LIVE


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
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(15)
                break
            except subprocess.TimeoutExpired:
                continue
        _LIVE.discard(self.proc.pid)
        self._log.close()
