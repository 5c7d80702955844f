"""``gpulock serve`` looks after what it starts: a busy port is refused before anything starts
(naming what holds it), serve says when the service is first ready, and an embedded Valkey
that dies under a running serve is started again on the same port, where the workers put
their resident leases back (issue 9 item 5, issue 10 items 6 and 9)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys

import httpx
import pytest
import redis
from support.procs import _LIVE, alive, children, cmdline
from support.serve import serve_env, start_serve
from support.waiting import wait_until

from support.ports import free_port


def _env() -> dict:
    return serve_env(GPULOCK_SLEEP_SECONDS="0.05", GPULOCK_SLEEP_BYTES="64MiB")


def _wait(pred, what: str, timeout: float, log=None):
    """:func:`wait_until`, with the service's log in the failure."""
    try:
        return wait_until(pred, timeout, what, interval=0.1)
    except AssertionError as e:
        raise AssertionError(f"{e}" + (f"\n{log.read_text()}" if log else "")) from None


@pytest.mark.timeout(60)
def test_serve_refuses_a_busy_port_before_starting_anything():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "gpulock", "serve", "--model", "sleep", "--port", str(port)],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert f"127.0.0.1:{port} is in use" in r.stderr, r.stderr
    assert f"pid {os.getpid()}" in r.stderr, r.stderr  # says what holds it
    assert "Redis:" not in r.stderr and "workers" not in r.stderr, r.stderr  # no banner


@pytest.mark.timeout(60)
def test_embedded_valkey_that_dies_5_times_within_60s_is_not_started_again(capsys):
    """The supervisor's rule as docs/SERVICE.md states it: deaths 1-4 within the window are
    restarted in place, the 5th stops the service with exit 69 (it restarted after the 5th
    kill -9 and stopped at the 6th). A real server, killed with SIGKILL each time."""
    from gpulock_service.embedded_server import MAX_DEATHS, RESTART_WINDOW_S, restart_embedded
    from gpulock_service.serve_words import EXIT_UNAVAILABLE

    from gpulock.embedded import find_server_binary
    from support.servers import RedisProcess

    assert (MAX_DEATHS, RESTART_WINDOW_S) == (5, 60.0)
    restarts: list[float] = []
    with RedisProcess(find_server_binary("any")) as rp:
        codes = []
        for _ in range(MAX_DEATHS):
            rp.kill()
            rp.proc.wait(10)
            codes.append(restart_embedded(rp, restarts))
            if codes[-1]:
                break
            assert redis.Redis.from_url(rp.url).ping()
    assert codes == [0, 0, 0, 0, EXIT_UNAVAILABLE], codes
    err = capsys.readouterr().err
    assert "for the 5th time within 60s" in err, err


@pytest.mark.timeout(150)
def test_embedded_valkey_killed_under_serve_is_restarted_and_leases_come_back(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**_env(), "GPULOCK_ACQUIRE_TIMEOUT": "1"}
    # --data-dir none: restarted empty, the workers put their leases back
    args = ["--model", "sleep", "-w", "2", "--port", str(port), "--data-dir", "none"]
    proc = start_serve(log, env, *args, cli="gpulock")
    valkey: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        # serve itself says when every worker is ready
        _wait(
            lambda: proc.poll() is None and "gpulock serve: ready:" in log.read_text(),
            "the ready line",
            90,
            log,
        )
        assert httpx.get(url + "/ready", timeout=5).status_code == 200
        text = log.read_text()
        redis_port = int(re.search(r"redis://127\.0\.0\.1:(\d+)/0", text).group(1))
        valkey[:] = [p for p in children(proc.pid) if "valkey-server" in cmdline(p)]
        assert len(valkey) == 1, text
        assert "model sleep" in text and "MiniLM" not in text, (
            text
        )  # the banner is the sleep model's
        rc = redis.Redis(port=redis_port, socket_timeout=2)
        # the two workers' resident leases (the ready line comes with the first worker)
        _wait(lambda: rc.zcard("gpulock:{gpu0}:leases") == 2, "both resident leases", 60, log)

        os.kill(valkey[0], signal.SIGKILL)
        _wait(lambda: "embedded Redis restarted" in log.read_text(), "the restart line", 30, log)
        assert proc.poll() is None
        text = log.read_text()
        assert re.search(rf"embedded Redis \(pid {valkey[0]}\) died \(killed by SIGKILL\)", text), (
            text
        )
        new = [p for p in children(proc.pid) if "valkey-server" in cmdline(p)]
        assert len(new) == 1 and new[0] != valkey[0], (new, valkey)
        valkey.append(new[0])
        assert rc.ping()  # the same port answers again
        # The new server started empty: leases in it were put back by the workers.
        _wait(lambda: rc.zcard("gpulock:{gpu0}:leases") == 2, "both resident leases back", 30, log)
        _wait(
            lambda: httpx.get(url + "/ready", timeout=5).status_code == 200, "/ready 200", 30, log
        )
        # New requests queue until the grace period of one max ttl (60 s) has passed, and
        # everything says so: /ready (still 200: the pool's grace, not this worker's fault),
        # /health, and the 503 of a request whose wait (1 s here) ran out in it, with a
        # Retry-After that counts to its end.
        for route in ("/ready", "/health"):
            g = _wait(
                lambda: (g := httpx.get(url + route, timeout=5).json()["grace"])["active"] and g,
                f"{route} showing the grace period",
                30,
                log,
            )
            assert g["active"] and 50 < g["left"] <= 60 and g["until"].endswith("Z"), (route, g)
            assert "restart grace period" in g["message"], (route, g)
        r = httpx.post(url + "/v1/embeddings", json={"input": ["in the grace"]}, timeout=30)
        left = httpx.get(url + "/ready", timeout=5).json()["grace"]["left"]
        msg = r.json()["error"]["message"]
        assert r.status_code == 503 and "restart grace period" in msg, r.text
        assert "no GPU memory for" not in msg and "Redis lost its data" in msg, msg
        assert int(r.headers["retry-after"]) >= int(left), (r.headers, left)

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(40) == 0, log.read_text()
        assert not alive(new[0])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in valkey:  # its own session: not in the group above
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        _LIVE.discard(proc.pid)
