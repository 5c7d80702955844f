"""``gpulock serve`` keeps its embedded server's data (docs/SERVICE.md, "The embedded server's
data"): the pool, its leases, the dashboard's history and counters survive a kill -9 of the
embedded server (restarted by serve with its data: the same epoch, no grace period) and a
kill -9 of serve itself (the next serve on the same data directory finds them again), and a
second serve is refused a data directory in use."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import redis
from support.procs import _LIVE, alive, children, cmdline
from support.waiting import wait_until

from support.ports import free_port

POOL = "gpu0"


def _env(state: Path) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GPULOCK_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env.update(
        GPULOCK_SLEEP_SECONDS="0.05",
        GPULOCK_SLEEP_BYTES="64MiB",
        PYTHONUNBUFFERED="1",
        XDG_STATE_HOME=str(state),
    )
    return env


def _serve(port: int, log: Path, env: dict, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "gpulock", "serve", "--model", "sleep", "-w", "2"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*argv, "--port", str(port), "--log-level", "warning", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    _LIVE.add(proc.pid)
    return proc


def _wait(pred, what: str, timeout: float, log: Path):
    try:
        return wait_until(pred, timeout, what, interval=0.1)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{log.read_text()}") from None


def _state(rc: redis.Redis) -> dict:
    """What must survive: the pool's epoch and grants, its leases (id -> token), its counters
    and its oldest sample."""
    cfg = {k.decode(): v.decode() for k, v in rc.hgetall(f"gpulock:{{{POOL}}}:cfg").items()}
    holders = rc.hgetall(f"gpulock:{{{POOL}}}:holders")
    oldest = rc.lindex(f"gpulock:{{{POOL}}}:samples", -1)
    return {
        "epoch": cfg.get("epoch"),
        "grants": int(cfg.get("grants", 0)),
        "grace_until": int(cfg.get("grace_until", 0)),
        "leases": {k.decode(): v.decode().split("|")[1] for k, v in holders.items()},
        "counters": {
            k.decode(): int(v) for k, v in rc.hgetall(f"gpulock:{{{POOL}}}:counters").items()
        },
        "oldest_sample": oldest,
        "samples": rc.llen(f"gpulock:{{{POOL}}}:samples"),
    }


def _valkey(pid: int) -> list[int]:
    return [p for p in children(pid) if "valkey-server" in cmdline(p)]


@pytest.mark.timeout(240)
def test_serve_keeps_pool_history_and_counters_across_kill_9_of_its_server_and_of_itself(
    tmp_path,
):
    state, log, port = tmp_path / "state", tmp_path / "serve.log", free_port()
    env = _env(state)
    data = state / "gpulock" / f"serve-{port}"  # the documented default
    url = f"http://127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    servers: list[int] = []
    try:
        procs.append(_serve(port, log, env))
        _wait(lambda: "gpulock serve: ready:" in log.read_text(), "the ready line", 90, log)
        text = log.read_text()
        assert f"data in {data}" in text, text
        redis_port = int(re.search(r"redis://127\.0\.0\.1:(\d+)/0", text).group(1))
        servers += _valkey(procs[0].pid)
        rc = redis.Redis(port=redis_port, socket_timeout=2)
        _wait(lambda: rc.zcard(f"gpulock:{{{POOL}}}:leases") == 2, "both resident leases", 60, log)

        r = httpx.post(url + "/v1/embeddings", json={"input": ["hello"]}, timeout=30)
        assert r.status_code == 200, r.text
        r = httpx.post(url + "/v1/embeddings", json={"input": ["oom"]}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "cuda_oom", r.text
        _wait(
            lambda: (
                _state(rc)["counters"] == {"rejected": 1, "oom": 1} and _state(rc)["samples"] >= 3
            ),
            "the 503 counted and three samples",
            30,
            log,
        )

        # A second serve on the same data directory is refused while the first runs.
        other = subprocess.run(
            [sys.executable, "-m", "gpulock", "serve", "--model", "sleep"]
            + ["--port", str(free_port()), "--data-dir", str(data)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert other.returncode == 2, (other.returncode, other.stderr)
        assert f"in use by gpulock serve (pid {procs[0].pid})" in other.stderr, other.stderr
        assert "Redis:" not in other.stderr, other.stderr  # nothing started

        # kill -9 of the embedded server: serve starts it again, with its data.
        before = _state(rc)
        os.kill(servers[0], signal.SIGKILL)
        _wait(lambda: "restarted at" in log.read_text(), "the restart line", 30, log)
        assert "with its data" in log.read_text(), log.read_text()
        servers += _valkey(procs[0].pid)
        after = _state(rc)
        assert after["epoch"] == before["epoch"] and after["grace_until"] == 0, (before, after)
        assert after["leases"] == before["leases"], (before, after)  # same ids, same tokens
        assert after["counters"] == before["counters"], (before, after)
        assert after["oldest_sample"] == before["oldest_sample"], (before, after)
        assert after["grants"] >= before["grants"] >= 3, (before, after)
        # no grace period: a request is granted at once
        r = httpx.post(url + "/v1/embeddings", json={"input": ["after"]}, timeout=30)
        assert r.status_code == 200, r.text

        # kill -9 of serve: its workers and its server follow it; the next serve on the same
        # port (the same default directory) finds everything again.
        before = _state(rc)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        _wait(lambda: not any(alive(p) for p in servers), "the server gone", 30, log)
        rc.close()
        procs.append(_serve(port, log, env))
        _wait(lambda: log.read_text().count("gpulock serve: ready:") == 2, "ready again", 90, log)
        text = log.read_text()
        assert f"redis://127.0.0.1:{redis_port}/0" in text.split("gpulock serve: ready:")[1], text
        servers += _valkey(procs[1].pid)
        rc = redis.Redis(port=redis_port, socket_timeout=2)
        after = _state(rc)
        assert after["epoch"] == before["epoch"], (before, after)
        assert after["counters"] == before["counters"], (before, after)
        assert after["oldest_sample"] == before["oldest_sample"], (before, after)
        assert after["grants"] >= before["grants"], (before, after)
        assert "[pool created]" not in text.split("gpulock serve: ready:")[1], text

        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(40) == 0, log.read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
            _LIVE.discard(p.pid)
        for pid in servers:  # in their own sessions: not in the groups above
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
