"""The Redis-compatible servers the tests run: the binaries this machine has, and the settings
of replicated servers. The processes themselves are :class:`gpulock.embedded.RedisProcess`
(each on a free port, never the shared one on 6379)."""

from __future__ import annotations

from gpulock.embedded import embedded_binary, find_server_binary

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
