"""gpulock.embedded.RedisProcess starts its own server, and knows it is its own."""

from __future__ import annotations

import pytest

from support.servers import RedisProcess


def test_start_refuses_a_port_another_server_holds(server_binary):
    """A free-port race: another server got the port first. It answers PING too, but start()
    must not take it for the one it launched (tests would talk to a stranger, perhaps a
    paused one): the new server exits (address in use) and start() says so."""
    other = RedisProcess(server_binary).start()
    try:
        with pytest.raises(RuntimeError):
            RedisProcess(server_binary, port=other.port).start(timeout=3)
        assert other.proc is not None and other.proc.poll() is None  # the other one is unharmed
    finally:
        other.stop()


def test_start_with_a_password(server_binary):
    """A server that refuses unauthenticated commands still counts as started (it is ours
    while it runs)."""
    rp = RedisProcess(server_binary, extra_args=["--requirepass", "s3cret"]).start(timeout=5)
    try:
        assert rp.proc is not None and rp.proc.poll() is None
    finally:
        rp.stop()
