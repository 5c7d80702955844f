"""The embedded server's data directory (``gpulock_service.datadir``): its default place, and
one serve at a time in it, also while the server of a serve killed with SIGKILL is still
stopping (it holds the lock it inherited)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis
from support.procs import kill_quietly

from gpulock.embedded import find_server_binary
from support.servers import RedisProcess
from support.ports import free_port

from gpulock_service.datadir import DataDir, DataDirError, default_data_dir, resolve_data_dir

# Takes DIR (argv[1]); forks a child that inherits the lock (as the embedded server does) and
# lives argv[2] seconds; prints "taken CHILD_PID" and, with argv[3] == "exit", exits at once
# itself (a serve gone while its server still runs), else sleeps.
HOLDER = """
import os, sys, time
from pathlib import Path
from gpulock_service.datadir import DataDir
d = DataDir.take(Path(sys.argv[1]))
child = os.fork()
if child == 0:
    time.sleep(float(sys.argv[2]))
    os._exit(0)
print("taken", child, flush=True)
if sys.argv[3] != "exit":
    time.sleep(60)
"""


def _holder(path, server_lives: float, how: str) -> tuple[subprocess.Popen, int]:
    """(the "serve", the pid of its "server")."""
    p = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(server_lives), how],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    word, child = p.stdout.readline().split()
    assert word == "taken"
    return p, int(child)


def test_the_default_is_per_user_state_and_per_port(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_data_dir(8001) == tmp_path / "gpulock" / "serve-8001"
    assert resolve_data_dir(None, 8001) == tmp_path / "gpulock" / "serve-8001"
    assert resolve_data_dir("none", 8001) is None and resolve_data_dir("NONE", 1) is None
    assert str(resolve_data_dir("rel", 1)) == os.path.join(os.getcwd(), "rel")
    monkeypatch.delenv("XDG_STATE_HOME")
    home = os.path.expanduser("~")
    assert str(default_data_dir(8000)) == f"{home}/.local/state/gpulock/serve-8000"
    with pytest.raises(DataDirError):
        resolve_data_dir("", 1)


def test_a_directory_in_use_is_refused_naming_its_serve(tmp_path):
    p, server = _holder(tmp_path / "d", 60, "stay")
    try:
        t = time.monotonic()
        with pytest.raises(DataDirError) as e:
            DataDir.take(tmp_path / "d")
        assert f"in use by gpulock serve (pid {p.pid})" in str(e.value), e.value
        assert time.monotonic() - t < 5  # at once: its serve runs (no stale wait)
        assert oct((tmp_path / "d").stat().st_mode & 0o777) == "0o700"
    finally:
        kill_quietly(server)
        p.kill()
        p.wait()


def test_a_directory_whose_serve_is_gone_is_taken_once_its_server_has_exited(tmp_path):
    p, _ = _holder(tmp_path / "d", 1.0, "exit")  # the "server" lives 1 s after its serve exits
    p.wait()
    d = DataDir.take(tmp_path / "d", stale_wait=30)  # waits for the server, then takes it
    try:
        assert (tmp_path / "d" / "lock").read_text().strip() == str(os.getpid())
    finally:
        d.release()
    p, server = _holder(tmp_path / "e", 60, "exit")  # a server that does not stop: refused
    p.wait()
    try:
        with pytest.raises(DataDirError) as e:
            DataDir.take(tmp_path / "e", stale_wait=0.5)
        assert "the embedded server of a serve that is gone" in str(e.value), e.value
    finally:
        kill_quietly(server)


def test_serve_with_data_the_server_cannot_read_exits_69_naming_the_directory(tmp_path):
    data = tmp_path / "data"
    with RedisProcess(find_server_binary("embedded"), data_dir=data) as rp:
        redis.Redis.from_url(rp.url).set("k", "v")
    (incr,) = (data / "appendonlydir").glob("*.incr.aof")
    incr.write_bytes(b"*2\r\n$3\r\nSET\r\nnot a command\r\n")  # not a truncated tail: garbage
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPULOCK_")}
    r = subprocess.run(
        [sys.executable, "-m", "gpulock", "serve", "--model", "sleep"]
        + ["--port", str(free_port()), "--data-dir", str(data)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 69, (r.returncode, r.stderr)
    assert "the embedded Redis did not start" in r.stderr and f"data is in {data}" in r.stderr
    assert "Traceback" not in r.stderr and "workers" not in r.stderr, r.stderr
