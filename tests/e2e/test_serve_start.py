"""``gpulock serve``'s first seconds, as a user meets them: ``ready`` is said when every worker
is ready, not when the first one is; a request that fits the capacity but never the room the
workers' resident leases leave is refused with 413 at once by every worker from the first
request on (it never waits at the head of the queue); and a serve killed with SIGKILL leaves a
metrics folder that the next start removes (a live serve's is kept).

One serve of two workers (the ``gated_model``: the second worker's load waits for the test),
capacity 512 MiB, a resident lease of 128 MiB per worker, 50 MiB per input."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from support.procs import _LIVE, alive, children
from support.serve import serve_env, start_serve, workers_ready
from support.waiting import wait_until

from support.ports import free_port

MiB = 2**20
HERE = Path(__file__).resolve().parent


def _env(tmp: Path) -> dict[str, str]:
    (tmp / "tmp").mkdir(exist_ok=True)
    (tmp / "gate").mkdir(exist_ok=True)
    return serve_env(
        GPULOCK_RESIDENT="128MiB",
        GPULOCK_SLEEP_BYTES="50MiB",
        GPULOCK_SLEEP_SECONDS="0.01",
        GPULOCK_ACQUIRE_TIMEOUT="4",
        # a full status read every 10 intervals: the cached view of the pool stays as it was
        # at the start for the whole test
        GPULOCK_REAPER_INTERVAL="5",
        GPULOCK_TEST_GATE=str(tmp / "gate"),
        PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        TMPDIR=str(tmp / "tmp"),  # where serve makes its metrics folder
    )


def _serve(tmp: Path, name: str, port: int, workers: int, model: str) -> subprocess.Popen:
    args = ["--model", model, "-w", str(workers), "--port", str(port), "--capacity", "512MiB"]
    return start_serve(tmp / f"{name}.log", _env(tmp), *args)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    _LIVE.discard(proc.pid)


class _Serve:
    def __init__(self, tmp: Path):
        self.tmp, self.port = tmp, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = _serve(tmp, "serve", self.port, 2, "gated_model:factory")

    def log(self) -> str:
        return (self.tmp / "serve.log").read_text(errors="replace")

    def workers_ready(self) -> float | None:
        return workers_ready(self.url)


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    s = _Serve(tmp_path_factory.mktemp("serve-start"))
    try:
        yield s
    finally:
        _stop(s.proc)
        print(s.log()[-4000:])


@pytest.mark.timeout(120)
def test_ready_is_said_when_every_worker_is(serve):
    # The first worker is ready; the second is still loading its model (held by the gate).
    wait_until(
        lambda: serve.proc.poll() is None and serve.workers_ready() == 1,
        60,
        "the first worker ready",
        interval=0.1,
    )
    # serve polls twice a second: had it said ready at the first worker's 200, it would now
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert "ready:" not in serve.log(), (serve.workers_ready(), serve.log())
        time.sleep(0.1)
    (serve.tmp / "gate" / "open").touch()
    wait_until(lambda: "ready:" in serve.log(), 60, "serve to say ready", interval=0.05)
    assert serve.workers_ready() == 2, serve.log()
    for _ in range(8):  # new connections: whichever worker answers is ready
        r = httpx.get(serve.url + "/ready", timeout=5)
        assert r.status_code == 200, r.text
    assert "all 2 workers" in serve.log(), serve.log()


@pytest.mark.timeout(120)
def test_a_request_that_never_fits_next_to_the_models_is_413_at_once_from_the_start(serve):
    """Capacity 512 MiB, two resident leases of 128 MiB: 450 MiB fits the capacity but never
    the 256 MiB the models leave. Right after ``ready`` every worker refuses it at once (it
    must not wait at the head of the queue for the acquire timeout, then answer 503); the
    short request behind it is served."""
    (serve.tmp / "gate" / "open").touch()  # (also when run alone)
    wait_until(lambda: "ready:" in serve.log(), 60, "serve to say ready", interval=0.05)
    pids: set[str] = set()
    for _ in range(40):  # new connections, until both workers answered
        r = httpx.post(serve.url + "/v1/embeddings", json={"input": ["x"] * 9}, timeout=30)
        assert r.status_code == 413, (r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "capacity", err
        assert "450.0MiB" in err["message"] and "256.0MiB" in err["message"], err
        pids.add(r.headers["x-worker-pid"])
        short = httpx.post(serve.url + "/v1/embeddings", json={"input": ["x"]}, timeout=30)
        assert short.status_code == 200, short.text
        if len(pids) == 2:
            break
    assert len(pids) == 2, "both workers must have answered"


@pytest.mark.timeout(120)
def test_a_serve_killed_with_sigkill_leaves_a_folder_the_next_start_removes(serve):
    tmpdir = serve.tmp / "tmp"
    (folder,) = [p for p in tmpdir.iterdir() if p.name.startswith("gpulock-metrics-")]
    # a live serve's folder (this test process plays the live serve) must be kept
    live = tmpdir / f"gpulock-metrics-{os.getpid()}-live"
    live.mkdir()
    tree = [serve.proc.pid, *children(serve.proc.pid)]
    tree += [g for p in tree[1:] for g in children(p)]
    os.kill(serve.proc.pid, signal.SIGKILL)
    serve.proc.wait(10)
    wait_until(lambda: not any(alive(p) for p in tree), 30, "serve's processes to end")
    assert folder.exists(), "SIGKILL: serve could not remove its folder"

    port = free_port()
    again = _serve(serve.tmp, "again", port, 1, "sleep")
    try:
        wait_until(
            lambda: again.poll() is not None or "ready:" in (serve.tmp / "again.log").read_text(),
            60,
            "the second serve ready",
            interval=0.05,
        )
        text = (serve.tmp / "again.log").read_text()
        assert again.poll() is None, text
        assert not folder.exists(), text
        assert live.exists()
        assert f"removed {folder}" in text, text
        assert "ready: the worker is ready" in text, text
        again.send_signal(signal.SIGTERM)
        assert again.wait(40) == 0, (serve.tmp / "again.log").read_text()
    finally:
        _stop(again)
        live.rmdir()
