"""The Redis-compatible servers the tests run: the binaries this machine has, the settings of
replicated servers, and :class:`RedisProcess`: :class:`gpulock.embedded.RedisProcess` on a port
of this test process's own (:func:`support.ports.free_port`, never the shared one on 6379)."""

from __future__ import annotations

from gpulock import embedded
from gpulock.embedded import embedded_binary, find_server_binary

from .ports import free_port

# Start replication at once (no 5 s wait for more replicas), stop without waiting for replicas.
FAST_REPLICATION = ["--repl-diskless-sync-delay", "0", "--shutdown-timeout", "0"]


def server_kinds() -> list[tuple[str, str]]:
    """``(kind, binary)`` of each server this machine has: the system ``redis-server`` first,
    then the embedded Valkey the README's first command uses. Raises RuntimeError when there
    is none (.ci/run installs one)."""
    kinds = []
    try:
        kinds.append(("redis", find_server_binary("redis")))
    except FileNotFoundError:
        pass
    emb = embedded_binary()
    if emb:
        kinds.append(("embedded", emb))
    if not kinds:
        raise RuntimeError("no redis-server binary: .ci/run installs one")
    return kinds


class RedisProcess(embedded.RedisProcess):
    """:class:`gpulock.embedded.RedisProcess`, whose port, when not given, comes from
    :func:`support.ports.free_port` (no other worker of a parallel run is handed it)."""

    def __init__(
        self, binary: str | None = None, port: int | None = None, host: str = "127.0.0.1", **kw
    ):
        super().__init__(binary, port or free_port(host), host, **kw)
