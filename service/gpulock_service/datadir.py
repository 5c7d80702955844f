"""The embedded server's data directory: where it is, and one ``gpulock serve`` at a time in it.

``gpulock serve`` without a Redis URL keeps its embedded server's data (the pools, their
leases, the dashboard's history and counters) in an append-only file under a data directory,
so that they survive restarts of the server and of serve (docs/SERVICE.md, "The embedded
server's data"). The default is per user and per port, ``$XDG_STATE_HOME/gpulock/serve-PORT``
(``~/.local/state/gpulock/serve-PORT`` when ``XDG_STATE_HOME`` is unset): the XDG base
directory for state that should outlive a restart but is not the user's documents or a cache;
the port tells apart the services of one user (one per GPU: ``--port 8001`` ...), and two
serves can never have the same port at once.

Two serves must not share a directory: each would run its own server on the same file. The
first takes an exclusive ``flock`` on ``DIR/lock`` (writing its pid there) and hands the lock
to its server too (an inherited descriptor), so the directory stays taken until both have
exited; a second serve is refused, naming the first.
"""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

__all__ = ["DataDir", "DataDirError", "default_data_dir", "resolve_data_dir"]

#: How long a serve waits for a directory whose last owner is gone while its server still
#: holds the lock (a serve killed with SIGKILL: its server is stopping), seconds.
STALE_WAIT_S = 10.0
NONE = "none"


class DataDirError(Exception):
    """The data directory cannot be used; the message names it and what to do."""


def default_data_dir(port: int) -> Path:
    """``$XDG_STATE_HOME/gpulock/serve-PORT``, or ``~/.local/state/gpulock/serve-PORT``."""
    base = os.environ.get("XDG_STATE_HOME", "").strip()
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".local" / "state"
    return root / "gpulock" / f"serve-{port}"


def resolve_data_dir(given: str | None, port: int) -> Path | None:
    """The data directory serve uses: ``given`` (``--data-dir`` / ``GPULOCK_DATA_DIR``;
    ``none``: no persistence, None) or the default for ``port``. Relative paths are made
    absolute. Raises DataDirError for an empty value."""
    if given is None:
        return default_data_dir(port)
    g = given.strip()
    if not g:
        raise DataDirError("--data-dir is empty: give a directory, or 'none' for no persistence")
    if g.lower() == NONE:
        return None
    return Path(os.path.abspath(os.path.expanduser(g)))


def _serve_alive(pid: int) -> bool:
    """Whether ``pid`` runs and is a gpulock process (not another that took its pid)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"gpulock" in f.read()
    except FileNotFoundError:
        return False
    except OSError:  # not Linux, or not ours to read: whether it runs at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class DataDir:
    """A data directory taken by this process (:meth:`take`); ``fd`` is the lock to hand to
    the server (``pass_fds``), ``port_file`` where the server's port is kept between runs."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self.fd = fd

    @classmethod
    def take(cls, path: Path, *, stale_wait: float = STALE_WAIT_S) -> DataDir:
        """Create ``path`` (mode 0700) and lock it for this process. Waits up to
        ``stale_wait`` seconds when the serve that held it is gone (its server may still be
        stopping). Raises DataDirError: not a usable directory, or in use by another serve."""
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise DataDirError(
                f"cannot use {path} as the embedded server's data directory: {e.strerror}; give "
                f"another --data-dir, or --data-dir none for no persistence"
            ) from None
        deadline = time.monotonic() + stale_wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise DataDirError(f"cannot lock {path / 'lock'}: {e.strerror}") from None
            owner = _owner(fd)
            live = owner is not None and _serve_alive(owner)
            if live or time.monotonic() >= deadline:
                os.close(fd)
                who = (
                    f"gpulock serve (pid {owner})"
                    if live
                    else "the embedded server of a serve that is gone, still running"
                )
                raise DataDirError(
                    f"the data directory {path} is in use by {who}: two services cannot share "
                    f"one; give this one another --data-dir (or --port: the default directory "
                    f"is per port), or stop the other"
                )
            time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    @property
    def port_file(self) -> Path:
        return self.path / "port"

    def last_port(self) -> int | None:
        """The port the server had last time (None: never, or unreadable)."""
        try:
            return int(self.port_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def keep_port(self, port: int) -> None:
        """Remember the server's port, so the next run can take it again (the CLI's
        ``GPULOCK_REDIS_URL`` stays right)."""
        try:
            self.port_file.write_text(f"{port}\n")
        except OSError:
            pass

    def release(self) -> None:
        """Drop this process's hold (the server's inherited one ends when it exits)."""
        try:
            os.close(self.fd)
        except OSError:
            pass


def _owner(fd: int) -> int | None:
    """The pid the lock's holder wrote, None when none can be read."""
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None
