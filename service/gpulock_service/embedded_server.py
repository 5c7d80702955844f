"""The embedded server under ``gpulock serve``: started on loopback (with its data directory,
:mod:`gpulock_service.datadir`), and started again on its port when it dies while the service
runs."""

from __future__ import annotations

import time

from gpulock.embedded import RedisProcess, port_in_use, server_port

from .datadir import DataDir
from .serve_words import EXIT_UNAVAILABLE, describe_exit, say

__all__ = ["MAX_DEATHS", "RESTART_WINDOW_S", "restart_embedded", "start_embedded"]

# The embedded Valkey's MAX_DEATHS-th death within RESTART_WINDOW_S stops the service: deaths
# 1 .. MAX_DEATHS-1 within the window are restarted in place.
MAX_DEATHS, RESTART_WINDOW_S = 5, 60.0


def start_embedded(binary: str, data: DataDir | None) -> RedisProcess:
    """Start the embedded server (a :class:`gpulock.embedded.RedisProcess`) on loopback, with
    ``data`` (a taken :class:`~gpulock_service.datadir.DataDir`: its data kept there, on the
    port it had last time when that is free) or without persistence (None)."""
    port = data.last_port() if data is not None else None
    if port is None or port_in_use("127.0.0.1", port):
        # a port outside the ephemeral range: it must stay free for a restart
        port = server_port("127.0.0.1")
    proc = RedisProcess(
        binary,
        port=port,
        host="127.0.0.1",
        die_with_parent=True,
        data_dir=data.path if data is not None else None,
        pass_fds=(data.fd,) if data is not None else (),
    ).start()
    if data is not None:
        data.keep_port(proc.port)
    return proc


def restart_embedded(redis_proc: RedisProcess, restarts: list[float]) -> int:
    """The embedded Valkey died under a running service: start it again on the same port
    (0), or say why not and return EXIT_UNAVAILABLE (the caller stops the service).
    ``restarts``: the monotonic times of the earlier restarts (this one is appended).

    Restarting in place, rather than exiting for a process manager, keeps the workers, their
    loaded models and the requests in flight: the workers reconnect by themselves. With its
    data directory the server comes back with the pools as they were (the same epoch: no
    grace period); without (``--data-dir none``) the workers find the pool gone and put their
    leases back (the core's restart rule), so their resident leases and running requests keep
    their bytes, and new grants wait out the grace period of one max ttl. Only a server that
    will not stay up (MAX_DEATHS deaths within RESTART_WINDOW_S, or its port taken) stops the
    service.
    """
    assert redis_proc.proc is not None
    old, how = redis_proc.pid, describe_exit(redis_proc.proc.returncode)
    rc = redis_proc.proc.returncode
    # Its own exit (not a signal) usually says why in its log's last lines.
    tail = " ".join(redis_proc.log_tail(300).split()[-12:]) if rc is not None and rc >= 0 else ""
    now = time.monotonic()
    restarts[:] = [t for t in restarts if now - t < RESTART_WINDOW_S]
    if len(restarts) + 1 >= MAX_DEATHS:  # this death and the restarted ones within the window
        say(
            f"error: embedded Redis (pid {old}) died ({how}) for the {len(restarts) + 1}th time within "
            f"{RESTART_WINDOW_S:.0f}s; stopping the service (exit {EXIT_UNAVAILABLE}). Last log: {tail or '-'}"
        )
        return EXIT_UNAVAILABLE
    restarts.append(now)
    say(
        f"embedded Redis (pid {old}) died ({how}); starting it again on port {redis_proc.port}"
        + (f". Its log: {tail}" if tail else "")
    )
    busy = port_in_use(redis_proc.host, redis_proc.port)
    if busy:
        say(
            f"error: cannot restart the embedded Redis: {busy}; stopping the service (exit {EXIT_UNAVAILABLE})"
        )
        return EXIT_UNAVAILABLE
    try:
        redis_proc.start()
    except RuntimeError as e:
        say(
            f"error: cannot restart the embedded Redis: {e}; stopping the service (exit {EXIT_UNAVAILABLE})"
        )
        return EXIT_UNAVAILABLE
    if redis_proc.persistent:
        say(
            f"embedded Redis restarted at {redis_proc.url} (pid {redis_proc.pid}) with its data from "
            f"{redis_proc.dir}: the pools, their leases and history are as they were; the workers "
            f"reconnect and go on (no grace period)"
        )
    else:
        say(
            f"embedded Redis restarted at {redis_proc.url} (pid {redis_proc.pid}), empty (--data-dir none): "
            f"the workers reconnect and put their leases back; new requests wait out the grace period "
            f"(one max ttl, 60 s by default)"
        )
    return 0
