"""Helpers for the end-to-end tests: run the real service (gunicorn or uvicorn, several
workers) as a process group, read the workers' recorded history, check the safety invariant on
it, and read /proc for worker pids. Every process started here is killed at teardown."""

from __future__ import annotations

import atexit
import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from gpulock import Pool
from gpulock.embedded import free_port

GiB = 2**30
MiB = 2**20
_LIVE: set[int] = set()  # process-group ids still running (killed at exit, whatever happens)


@atexit.register
def _kill_leftovers() -> None:
    for pgid in list(_LIVE):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                data = f.read()
        except OSError:
            continue
        rest = data.rsplit(")", 1)[1].split()
        if int(rest[1]) == pid and rest[0] != "Z":
            out.append(int(stat.split("/")[2]))
    return sorted(out)


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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

    def __post_init__(self) -> None:
        self.port = free_port()
        self.pool = f"e2e-{self.name}-{os.getpid()}"
        (self.tmp / "hist").mkdir(parents=True, exist_ok=True)
        (self.tmp / "prom").mkdir(parents=True, exist_ok=True)
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
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "GPULOCK_TORCH_THREADS": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update({k: str(v) for k, v in self.env.items()})
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
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)  # workers that outlived their master, if any
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        _LIVE.discard(pgid)
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
        """For a worker just killed: ``{lease_id: unix time its lease expires on the server}``
        read now, plus ``"killed_at"``."""
        st = self.status()
        now = time.time()
        out = {lz.lease_id: now + lz.expires_in for lz in st.leases if lz.holder.get("pid") == pid}
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


# ---- the safety invariant on recorded histories -------------------------------------------------


def lease_intervals(
    events: list[dict],
    *,
    routes: set[str] | None = None,
    killed: dict[int, dict] | None = None,
    end: float | None = None,
) -> list[tuple[float, float, int, str]]:
    """``(start, end, amount, lease_id)`` per lease: from the worker's grant record (written
    after the grant returned) to its release record (written before release was sent) — an
    inner bound of the server's interval, which still contains every CUDA call. The leases of a
    worker killed with -9 last until their server expiry, read from Redis right after the kill
    (``killed[pid]`` is :meth:`Service.expiries_of`: a dead holder renews nothing more); one
    with no release record at all lasts until ``end``."""
    killed = killed or {}
    end = end if end is not None else time.time() + 3600
    grants, releases = {}, {}
    for e in events:
        if routes is not None and e.get("route") not in routes:
            continue
        if e["e"] == "grant":
            grants[e["lease_id"]] = e
        elif e["e"] == "release":
            releases[e["lease_id"]] = e
    out = []
    for lid, g in grants.items():
        if lid in releases:
            t1 = releases[lid]["t"]
        elif g["pid"] in killed:
            ends = killed[g["pid"]]
            t1 = ends.get(
                lid, ends["killed_at"]
            )  # not in Redis any more: it ended before we looked
        else:
            t1 = end
        out.append((g["t"], t1, int(g["amount"]), lid))
    return out


def cuda_intervals(
    events: list[dict], *, killed: dict[int, float] | None = None
) -> list[tuple[float, float, int, str]]:
    """``(start, end, amount, lease_id)`` of each guarded call's thread (cuda_start to
    cuda_end; a call cut by kill -9 ends at the kill)."""
    killed = killed or {}
    starts, ends = {}, {}
    for e in events:
        if e["e"] == "cuda_start":
            starts[e["lease_id"]] = e
        elif e["e"] == "cuda_end":
            ends[e["lease_id"]] = e
    out = []
    for lid, s in starts.items():
        t1 = ends[lid]["t"] if lid in ends else killed.get(s["pid"], time.time() + 3600)
        out.append((s["t"], t1, int(s["amount"]), lid))
    return out


def max_overlap(intervals: list[tuple[float, float, int, str]]) -> tuple[int, int]:
    """The most bytes and the most intervals alive at one instant (ends sort before starts at
    equal times)."""
    points = []
    for t0, t1, amount, _ in intervals:
        points.append((t0, 1, amount))
        points.append((t1, 0, -amount))
    points.sort(key=lambda p: (p[0], p[1]))
    used = count = peak_used = peak_count = 0
    for _, kind, delta in points:
        used += delta
        count += 1 if kind == 1 else -1
        peak_used = max(peak_used, used)
        peak_count = max(peak_count, count)
    return peak_used, peak_count
