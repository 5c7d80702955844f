"""Ports for the servers the tests start, collision-free between the processes of one parallel
run (pytest-xdist's workers).

A port chosen by binding port 0 and closing the socket (``gpulock.embedded.free_port``) is only
free until someone else binds it: two workers can be handed the same port, and the second server
then fails to start, or a "nothing listens there" port gets a listener. Here each worker
(``PYTEST_XDIST_WORKER`` = ``gwN`` of ``PYTEST_XDIST_WORKER_COUNT``) draws from its own block of
a range that nothing else on the machine hands out, going round it from a random start and
skipping ports something holds now; a serial run has the whole range.

* :func:`free_port`: above the kernel's ephemeral range (61000-65535 with Linux's default
  32768-60999). Neither the kernel (``bind`` to port 0, outgoing connections) nor gpulock
  (``free_port``, ``server_port``, cluster ports) hands these out, so a server restarted on its
  port finds it free.
* :func:`cluster_port`: a Redis Cluster node's port in 10000-19999, its cluster bus (port
  + 10000) in 20000-29999: both below the ephemeral range and below 55536.

Subprocesses that pick ports themselves (``gpulock serve``'s embedded server, the benchmarks)
use gpulock's own choices, which lie outside these blocks' ranges or are bound within
milliseconds of the choice.
"""

from __future__ import annotations

import os
import random
import socket

__all__ = ["cluster_port", "free_port"]

_CLUSTER_RANGE = (10000, 20000)  # node ports; each bus is port + 10000
_BUS_OFFSET = 10000
_RESERVED = {6379, 8000, 8100}  # a user's Redis, `gpulock serve`, `gpulock broker`


def _ephemeral() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
            return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _plain_range() -> tuple[int, int]:
    """Above the ephemeral range when that leaves at least 1,000 ports, else 30000-31999 (below
    Linux's default range; a machine whose range is both wide and low is unusual)."""
    hi = _ephemeral()[1]
    return (hi + 1, 65536) if 65536 - (hi + 1) >= 1000 else (30000, 32000)


def _worker() -> tuple[int, int]:
    """(index, count) of this xdist worker; (0, 1) outside xdist (the variables are inherited by
    subprocesses, which then share their worker's block)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        index = int(name[2:]) if name.startswith("gw") else 0
    except ValueError:
        return 0, 1
    return (index, count) if 0 <= index < count else (0, 1)


class _Block:
    """This process's block of ``[lo, hi)``: ports handed out in turn, from a random start (two
    runs at once on one machine, or a worker and its subprocess, start apart)."""

    def __init__(self, lo: int, hi: int):
        index, count = _worker()
        size = (hi - lo) // count
        self.lo, self.size = lo + index * size, size
        self.next = random.randrange(size)

    def take(self, free) -> int:
        for _ in range(self.size):
            port = self.lo + self.next
            self.next = (self.next + 1) % self.size
            if port not in _RESERVED and free(port):
                return port
        raise RuntimeError(f"no free port in {self.lo}-{self.lo + self.size - 1}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


_plain: _Block | None = None
_cluster: _Block | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing holds now and that no other worker of this run is
    handed."""
    global _plain
    if _plain is None:
        _plain = _Block(*_plain_range())
    return _plain.take(lambda p: _bindable(host, p))


def cluster_port(host: str = "127.0.0.1") -> int:
    """A cluster node's port (for :func:`gpulock.transport.local_cluster.start_cluster`): it and
    its bus port (+ 10000) are free now, and no other worker of this run is handed either."""
    global _cluster
    if _cluster is None:
        _cluster = _Block(*_CLUSTER_RANGE)
    return _cluster.take(lambda p: _bindable(host, p) and _bindable(host, p + _BUS_OFFSET))
