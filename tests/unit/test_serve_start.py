"""Which metrics folders a starting ``gpulock serve`` removes: only those of serve processes
that are gone and that no live process writes to; never a live serve's, a folder a live worker
still writes live gauges to, nor a folder of another name. (The real SIGKILL is in
tests/e2e/test_serve_start.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from gpulock_service.serve_start import make_metrics_dir, remove_stale_metrics_dirs


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_only_the_folders_of_gone_serves_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = _dead_pid()
    gone = tmp_path / f"gpulock-metrics-{dead}-abc"
    gone.mkdir()
    (gone / "counter_123.db").write_bytes(b"x")
    mine = make_metrics_dir()  # this process plays a live serve
    assert os.path.basename(mine).startswith(f"gpulock-metrics-{os.getpid()}-")
    written = tmp_path / f"gpulock-metrics-{dead}-def"  # its serve is gone, a worker lives
    written.mkdir()
    (written / f"gauge_livesum_{os.getpid()}.db").write_bytes(b"x")
    other = tmp_path / "gpulock-metrics-xyz"  # an earlier version's name: whose, unknown
    other.mkdir()
    said: list[str] = []
    assert remove_stale_metrics_dirs(said.append) == [gone]
    assert not gone.exists()
    assert os.path.isdir(mine) and written.exists() and other.exists()
    assert said == [f"removed {gone}: the metrics folder of a serve (pid {dead}) that is gone"]
