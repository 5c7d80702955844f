"""The demo service under test: the real service (gunicorn or uvicorn, several workers) as a
process group, its metrics, its pool's status, its workers (from /proc) and their recorded
history. Every process started here is killed at teardown (and at exit)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from gpulock import Pool
from .ports import free_port

from .pools import GiB, lease_expiries_ms, settle
from .procs import _LIVE, alive, children, cmdline, stop_group
from .waiting import wait_until


@dataclass
class Service:
    """The service under test. ``server`` is ``gunicorn`` (with ``uvicorn_worker``) or
    ``uvicorn`` (its own ``--workers``)."""

    name: str
    tmp: Path
    redis_url: str
    env: dict
    server: str = "gunicorn"
    workers: int = 4
    preload: bool = False
    max_requests: int = 0
    capacity: int = 4 * GiB
    unset: tuple[str, ...] = ()  # variables of the test's environment the service runs without

    def __post_init__(self) -> None:
        self.port = free_port()
        self.pool = f"e2e-{self.name}-{os.getpid()}"
        (self.tmp / "hist").mkdir(parents=True, exist_ok=True)
        (self.tmp / "prom").mkdir(parents=True, exist_ok=True)
        (self.tmp / "run").mkdir(mode=0o700, parents=True, exist_ok=True)
        self.history_prefix = str(self.tmp / "hist" / "h")
        self.log_path = self.tmp / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Service:
        env = dict(os.environ)
        env.update(
            {
                "GPULOCK_REDIS_URL": self.redis_url,
                "GPULOCK_POOL": self.pool,
                "GPULOCK_CAPACITY": str(self.capacity),
                "GPULOCK_CONFIGURE": "set",
                "GPULOCK_HISTORY_FILE": self.history_prefix,
                "PROMETHEUS_MULTIPROC_DIR": str(self.tmp / "prom"),
                # gunicorn's control socket (gunicorn.ctl), apart from every other gunicorn's
                "XDG_RUNTIME_DIR": str(self.tmp / "run"),
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "GPULOCK_TORCH_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
                # the e2e cases count one lease per request; a test of batching turns it on
                "GPULOCK_BATCH": "false",
            }
        )
        env.update({k: str(v) for k, v in self.env.items()})
        for k in self.unset:
            env.pop(k, None)
        if self.server == "gunicorn":
            cmd = [
                sys.executable,
                "-m",
                "gunicorn",
                "-c",
                "python:gpulock_service.gunicorn_conf",
                "-w",
                str(self.workers),
                "-k",
                "uvicorn_worker.UvicornWorker",
                "-b",
                f"127.0.0.1:{self.port}",
                "--log-level",
                "warning",
                "--graceful-timeout",
                "10",
            ]
            if self.preload:
                cmd.append("--preload")
            if self.max_requests:
                cmd += ["--max-requests", str(self.max_requests), "--max-requests-jitter", "2"]
            cmd.append("gpulock_service.app:app")
        else:
            cmd = [
                sys.executable,
                "-m",
                "uvicorn",
                "gpulock_service.app:app",
                "--workers",
                str(self.workers),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "warning",
                "--timeout-graceful-shutdown",
                "10",
            ]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        _LIVE.add(self.proc.pid)
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_group(self.proc, 20)
        self._log.close()
        print(f"--- {self.name} log (tail) ---\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def worker_pids(self) -> list[int]:
        assert self.proc is not None
        kids = children(self.proc.pid)
        if self.server == "uvicorn":
            kids = [
                k
                for k in kids
                if "spawn_main" in cmdline(k) and "resource_tracker" not in cmdline(k)
            ]
        return kids

    # ---- HTTP / Redis ----------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """The /metrics samples as ``{"name{label=value,...}": value}`` (labels sorted)."""
        from prometheus_client.parser import text_string_to_metric_families

        r = httpx.get(self.url + "/metrics", timeout=10)
        r.raise_for_status()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def expiries_of(self, pid: int, killed_at: float) -> dict:
        """For a worker just killed: ``{lease_id: unix time its lease expires on the server}``,
        plus ``"killed_at"``. Read once the process is gone and Redis has run whatever it had
        already sent (a renewal in flight at the kill), from the pool's own record of each
        expiry: the final expiries, exactly (not ``now + expires_in``, which is later than the
        server's expiry by however long the status call took on a loaded machine)."""
        wait_until(lambda: not alive(pid), 30, f"worker {pid} to die")
        r = redis.Redis.from_url(self.redis_url)
        try:
            settle(r)
            ids = [lz.lease_id for lz in self.status().leases if lz.holder.get("pid") == pid]
            out: dict = {lid: ms / 1000 for lid, ms in lease_expiries_ms(r, self.pool, ids).items()}
        finally:
            r.close()
        out["killed_at"] = killed_at
        return out

    def status_when(self, pred, timeout: float = 3.0):
        """The pool's status once ``pred(status)`` holds (a release is sent right after the
        response, so it can land a moment after the client saw the answer)."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if pred(st) or time.monotonic() > deadline:
                return st
            time.sleep(0.02)

    def status(self):
        p = Pool.from_url(self.redis_url, self.pool)
        try:
            return p.status()
        finally:
            p.close()

    def wait_ready(self, n: int | None = None, timeout: float = 180.0) -> None:
        """Until ``n`` workers report ready (``gpulock_workers_ready``, summed over live
        workers by prometheus-client's multiprocess mode)."""
        n = self.workers if n is None else n
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                m = self.metrics()
                last = m.get("gpulock_workers_ready")
                if last is not None and last >= n:
                    return
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.3)
        raise TimeoutError(
            f"{self.name}: {last} of {n} workers ready after {timeout}s:\n{self.log_tail()}"
        )

    def history(self) -> list[dict]:
        events = []
        for path in glob.glob(self.history_prefix + ".*.jsonl"):
            with open(path) as f:
                for line in f:
                    line = line.strip()
                    if line:
                        try:
                            events.append(json.loads(line))
                        except ValueError:
                            pass  # a line cut by kill -9
        events.sort(key=lambda e: e["t"])
        return events
