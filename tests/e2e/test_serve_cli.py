"""``gpulock serve`` as a user runs it first: no Redis URL (an embedded Valkey starts on
loopback), no capacity (the CPU default, said out loud), gunicorn with uvicorn workers; then
``gpulock loadtest`` against it; SIGTERM stops everything, Valkey included."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import httpx
import pytest
from support.procs import _LIVE, alive, children, cmdline
from support.serve import serve_env, start_serve, wait_workers_ready

from support.ports import free_port


@pytest.mark.timeout(150)
def test_gpulock_serve_embedded_redis_and_loadtest(tmp_path):
    port = free_port()
    env = serve_env(GPULOCK_SLEEP_SECONDS="0.05", GPULOCK_SLEEP_BYTES="64MiB")
    log = tmp_path / "serve.log"
    proc = start_serve(log, env, "--model", "sleep", "-w", "2", "--port", str(port), "--preload")
    valkey: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_workers_ready(proc, url, 2, log, 90)
        text = log.read_text()
        assert "embedded valkey-server" in text and "loopback only" in text
        assert "capacity: 2.0GiB" in text and "CPU default" in text, text
        valkey[:] = [p for p in children(proc.pid) if "valkey-server" in cmdline(p)]
        assert len(valkey) == 1
        redis_port = int(re.search(r"redis://127\.0\.0\.1:(\d+)/0", text).group(1))

        r = httpx.post(url + "/v1/embeddings", json={"input": ["hello", "world"]}, timeout=30)
        assert r.status_code == 200 and len(r.json()["data"]) == 2

        lt = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpulock_service",
                "loadtest",
                url,
                "-c",
                "8",
                "-n",
                "24",
                "-b",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=90,
            env=env,
        )
        assert lt.returncode == 0, lt.stdout + lt.stderr
        assert "requests/s" in lt.stdout and "p50" in lt.stdout and "pool peak" in lt.stdout, (
            lt.stdout
        )
        assert re.search(r"200 OK\s*│\s*24", lt.stdout), lt.stdout

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0, log.read_text()
        assert not alive(valkey[0]), "the embedded Valkey must stop with the service"
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", redis_port), timeout=1).close()
        assert "embedded Redis stopped" in log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in valkey:  # its own session: not in the group above
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        _LIVE.discard(proc.pid)
