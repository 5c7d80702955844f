"""``gpulock serve``'s start: its metrics folder and the line that says the service is ready.

* The folder (``PROMETHEUS_MULTIPROC_DIR`` when the user gives none) is
  ``gpulock-metrics-<serve's pid>-<random>`` in the temporary directory; serve removes it at
  exit. A serve killed with SIGKILL cannot: the next serve removes such folders of serve
  processes that are gone, and only those (a live serve's, or one a live worker still writes
  to, is kept; folders of another user or of another name are never touched).
* ``ready`` is said once every worker is ready: each worker marks itself in the folder
  (``gpulock_workers_ready``, a live gauge per process), and ``/ready`` answers 200.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

_PREFIX = "gpulock-metrics-"
_OWNED = re.compile(rf"^{_PREFIX}(\d+)-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def make_metrics_dir() -> str:
    """A fresh metrics folder of this process (its pid in the name)."""
    return tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")


def remove_stale_metrics_dirs(say: Callable[[str], None]) -> list[Path]:
    """Remove the metrics folders that serve processes now gone left in the temporary
    directory (killed with SIGKILL: they could not remove their own), saying so for each.
    A folder is kept while its serve lives or any process that wrote live gauges to it does.
    Returns the folders removed."""
    removed: list[Path] = []
    root = Path(tempfile.gettempdir())
    try:
        entries = list(root.iterdir())
    except OSError:
        return removed
    from gpulock.fastapi._metrics import live_gauge_pids

    for d in entries:
        m = _OWNED.match(d.name)
        if not m or not d.is_dir() or d.is_symlink():
            continue
        try:
            if d.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        pid = int(m.group(1))
        if _alive(pid) or any(_alive(p) for p in live_gauge_pids(str(d))):
            continue
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
            say(f"removed {d}: the metrics folder of a serve (pid {pid}) that is gone")
    return removed


def announce_ready(
    url: str,
    workers: int,
    metrics_dir: str,
    started: float,
    stop: threading.Event,
    say: Callable[[str], None],
) -> None:
    """In a thread: say ``ready`` once ``workers`` workers report ready in ``metrics_dir``
    and ``url`` (``/ready``) answers 200; say once, after 10 s with some but not all workers
    ready, how many are."""
    from gpulock.fastapi._metrics import ready_workers

    told = False
    first: float | None = None
    while not stop.wait(0.2):
        n = ready_workers(metrics_dir)
        if n and first is None:
            first = time.monotonic()
        if n < workers:
            if first is not None and not told and time.monotonic() - first > 10:
                told = True
                say(
                    f"{n} of {workers} workers ready; serve says 'ready' when all are "
                    f"({url} answers why a worker is not)"
                )
            continue
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    who = f"all {workers} workers are" if workers > 1 else "the worker is"
                    say(
                        f"ready: {who} ready; {url} answers 200, "
                        f"{time.monotonic() - started:.1f}s after start"
                    )
                    return
        except (OSError, urllib.error.URLError):
            pass
