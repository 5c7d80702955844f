"""A small network of "hosts" made of Linux network namespaces, for the multi-host tests.

Layout (every address lives only inside namespaces this module creates; nothing is added to
the test's own namespace, and everything is removed on close, also after a failure)::

        backend net 10.77.1.0/24 (bridge "brb")        front net 10.77.2.0/24 (bridge "brf")
    redis 10.77.1.1 ─┐                              ┌─ c1 10.77.2.11  (SDK, sync)
    broker 10.77.1.2 ┼── [sw: brb]   [sw: brf] ─────┼─ c2 10.77.2.12  (SDK, async)
    c3 10.77.1.13 ───┘           broker 10.77.2.2 ──┘
                      (core AsyncPool users talk to Redis directly)

The bridges live in a "switch" namespace; each host is joined to a bridge by a veth pair whose
switch-side end is named ``p-<host>`` (the broker has ``p-brk-b`` and ``p-brk-f``).
``cut(port)`` sets that switch-side end down: the host's packets are dropped (its own link
loses carrier), as when a cable is pulled, and ``heal(port)`` brings it back.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

from support.procs import stop_group

HOSTS = {
    # host: [(bridge, switch port, device in host, address)]
    "redis": [("brb", "p-redis", "eth0", "10.77.1.1/24")],
    "broker": [
        ("brb", "p-brk-b", "bk0", "10.77.1.2/24"),
        ("brf", "p-brk-f", "fr0", "10.77.2.2/24"),
    ],
    "c1": [("brf", "p-c1", "eth0", "10.77.2.11/24")],
    "c2": [("brf", "p-c2", "eth0", "10.77.2.12/24")],
    "c3": [("brb", "p-c3", "eth0", "10.77.1.13/24")],
}
REDIS_IP, BROKER_BACK_IP, BROKER_FRONT_IP = "10.77.1.1", "10.77.1.2", "10.77.2.2"


def why_unavailable() -> str | None:
    """None when namespaces can be made here, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    name = f"glprobe{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {r.stderr.strip()}")
    return r


class Lab:
    """The namespaces, links and the processes started in them."""

    def __init__(self, workdir: Path):
        self.id = uuid.uuid4().hex[:6]
        self.workdir = workdir
        self.ns = {h: f"gl{self.id}-{h}" for h in [*HOSTS, "sw"]}
        self.procs: list[subprocess.Popen] = []

    # ---- topology ------------------------------------------------------------------------
    def up(self) -> "Lab":
        try:
            for n in self.ns.values():
                sh("ip", "netns", "add", n)
            sw = self.ns["sw"]
            sh("ip", "-n", sw, "link", "set", "lo", "up")
            for br in ("brb", "brf"):
                sh("ip", "-n", sw, "link", "add", br, "type", "bridge")
                sh("ip", "-n", sw, "link", "set", br, "up")
            for host, links in HOSTS.items():
                n = self.ns[host]
                sh("ip", "-n", n, "link", "set", "lo", "up")
                for br, port, dev, addr in links:
                    sh(
                        "ip",
                        "-n",
                        sw,
                        "link",
                        "add",
                        port,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        dev,
                        "netns",
                        n,
                    )
                    sh("ip", "-n", sw, "link", "set", port, "master", br)
                    sh("ip", "-n", sw, "link", "set", port, "up")
                    sh("ip", "-n", n, "addr", "add", addr, "dev", dev)
                    sh("ip", "-n", n, "link", "set", dev, "up")
        except Exception:
            self.close()
            raise
        return self

    def cut(self, port: str) -> None:
        sh("ip", "-n", self.ns["sw"], "link", "set", port, "down")

    def heal(self, port: str) -> None:
        sh("ip", "-n", self.ns["sw"], "link", "set", port, "up")

    # ---- processes -------------------------------------------------------------------------
    def spawn(
        self, host: str, argv: list[str], log: str, env: dict | None = None
    ) -> subprocess.Popen:
        """Start ``argv`` in ``host``'s namespace, in a new session (so it and its children can
        be signalled as a group); stdout+stderr go to ``workdir/log``."""
        out = open(self.workdir / log, "ab")
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.ns[host], *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        out.close()
        self.procs.append(p)
        return p

    def run(self, host: str, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns[host], *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def stop(self, p: subprocess.Popen, timeout: float = 5) -> None:
        if p.poll() is None:
            stop_group(p, timeout)

    def close(self) -> None:
        for p in reversed(self.procs):
            try:
                self.stop(p)
            except Exception:
                pass
        self.procs.clear()
        for n in self.ns.values():
            # Anything still running in it (it should not) would keep it alive: kill by ns.
            r = sh("ip", "netns", "pids", n, check=False)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            sh("ip", "netns", "del", n, check=False)

    def wait_tcp(self, host: str, ip: str, port: int, timeout: float = 15) -> None:
        code = (
            f"import socket,time\nd=time.time()+{timeout}\n"
            f"while True:\n  try:\n    socket.create_connection(('{ip}',{port}),0.5).close();break\n"
            f"  except OSError:\n    assert time.time()<d, 'no listener';time.sleep(0.05)\n"
        )
        r = self.run(host, ["python3", "-c", code], timeout=timeout + 5)
        if r.returncode != 0:
            raise RuntimeError(f"{ip}:{port} not reachable from {host}: {r.stderr[-500:]}")

    def __enter__(self) -> "Lab":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.close()
