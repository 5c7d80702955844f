"""``gpulock serve``: decide Redis and capacity, then run gunicorn with uvicorn workers.

This process is a small supervisor, not the gunicorn master: it starts an embedded Valkey when
no Redis URL is given, configures the pool, makes a fresh ``PROMETHEUS_MULTIPROC_DIR``, runs
``python -m gunicorn`` as a child, forwards SIGTERM/SIGINT/SIGHUP to it, and when gunicorn has
exited stops Valkey and removes the metrics directory. It never imports torch and never
initialises CUDA (the GPU's size comes from NVML, ``nvidia-smi`` or a short-lived
subprocess), and gunicorn's master only imports the app module, which does no I/O (case c06).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from urllib.parse import urlsplit, urlunsplit

from gpulock.units import format_size, parse_size

from .settings import CPU_DEFAULT_CAPACITY


def _say(msg: str) -> None:
    print(f"gpulock serve: {msg}", file=sys.stderr, flush=True)


def _redact(url: str) -> str:
    p = urlsplit(url)
    if p.password:
        netloc = f"{p.username or ''}:***@{p.hostname}" + (f":{p.port}" if p.port else "")
        return urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))
    return url


def decide_capacity(capacity: str | None, utilization: float, device: str) -> tuple[int, str, bool]:
    """``(bytes, where it came from, explicit)``: ``--capacity``/``GPULOCK_CAPACITY`` if given
    (explicit: it overwrites an existing pool's capacity); else the GPU's total memory ×
    ``utilization``; else the documented CPU default (2 GiB)."""
    if capacity:
        return parse_size(capacity, name="capacity"), "--capacity / GPULOCK_CAPACITY", True
    dev = (device or "auto").lower()
    if dev != "cpu":
        from gpulock.cuda import device_memory

        idx = int(dev.split(":", 1)[1]) if dev.startswith("cuda:") else 0
        dm = device_memory(idx)
        if dm is not None:
            cap = int(dm.total * utilization)
            return cap, (f"GPU {idx} ({dm.name or 'unknown'}): {format_size(dm.total)} total x {utilization} "
                         f"utilization, read with {dm.source}"), False
    return (parse_size(CPU_DEFAULT_CAPACITY),
            f"CPU default {CPU_DEFAULT_CAPACITY}: no GPU found (give --capacity SIZE to change it)", False)


def _pdeathsig() -> None:  # runs in the child before exec: die with this supervisor
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def run_serve(*, workers: int, redis_url: str | None, capacity: str | None, host: str, port: int, pool: str,
              preload: bool, model: str, utilization: float, max_requests: int, timeout: int,
              log_level: str) -> int:
    from gpulock import GpuLockError, Pool
    from gpulock.embedded import RedisProcess, find_server_binary

    redis_proc = None
    metrics_dir = None
    proc: subprocess.Popen | None = None
    device = os.environ.get("GPULOCK_DEVICE", "auto")
    try:  # bad sizes are usage errors, found before anything starts
        cap, source, explicit = decide_capacity(capacity, utilization, device)
        on_cpu = device == "cpu" or source.startswith("CPU default")
        if explicit and not on_cpu and device.lower() == "auto":
            from gpulock.cuda import device_memory

            on_cpu = device_memory(0) is None
        resident_s = os.environ.get("GPULOCK_RESIDENT") or (
            os.environ.get("GPULOCK_CPU_RESIDENT", "128MiB") if on_cpu else None)
        resident = parse_size(resident_s, name="resident lease") if resident_s not in (None, "", "0") else 0
    except GpuLockError as e:
        _say(f"error: {e}")
        return 2
    if resident and resident * workers >= cap:
        _say(f"error: capacity {format_size(cap)} ({cap} bytes) leaves no room for requests: {workers} workers "
             f"x a resident lease of {format_size(resident)} = {format_size(resident * workers)}; give a larger "
             f"--capacity, fewer --workers, or a smaller GPULOCK_RESIDENT")
        return 2
    try:
        if not redis_url:
            try:
                binary = find_server_binary("embedded")
            except FileNotFoundError:
                binary = find_server_binary("any")
            redis_proc = RedisProcess(binary, host="127.0.0.1", die_with_parent=True).start()
            redis_url = redis_proc.url
            _say(f"Redis: embedded {os.path.basename(binary)} at {redis_url} (loopback only, no persistence; "
                 f"stopped with the service). Give --redis-url to share a pool between hosts.")
        else:
            _say(f"Redis: {_redact(redis_url)}")

        p = Pool.from_url(redis_url, pool)
        try:
            r = p.configure(cap, create_only=not explicit)
        except GpuLockError as e:
            _say(f"cannot configure pool {pool!r} on {_redact(redis_url)}: {e}")
            return 2
        finally:
            p.close()
        if r["capacity"] != cap:
            _say(f"capacity: {format_size(r['capacity'])} ({r['capacity']} bytes), kept from the existing pool "
                 f"{pool!r}; the {format_size(cap)} from {source} was not applied (give --capacity to change it)")
        else:
            _say(f"capacity: {format_size(cap)} ({cap} bytes), from {source}"
                 + (" [pool created]" if r["created"] else " [pool updated]" if explicit else ""))
        _say(f"CLI: export GPULOCK_REDIS_URL={_redact(redis_url)}  # then: gpulock status {pool}")

        env = dict(os.environ)
        env.update(GPULOCK_REDIS_URL=redis_url, GPULOCK_POOL=pool, GPULOCK_CAPACITY=str(r["capacity"]),
                   GPULOCK_CONFIGURE="create", GPULOCK_MODEL=model)
        if on_cpu and "GPULOCK_TORCH_THREADS" not in env:
            env["GPULOCK_TORCH_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
        if not env.get("PROMETHEUS_MULTIPROC_DIR"):
            metrics_dir = tempfile.mkdtemp(prefix="gpulock-metrics-")
            env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        if model == "minilm":  # its weights ship in a package: never reach for the Hub
            env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")

        cmd = [sys.executable, "-m", "gunicorn", "-c", "python:gpulock_service.gunicorn_conf",
               "--workers", str(workers), "--worker-class", "uvicorn_worker.UvicornWorker",
               "--bind", f"{host}:{port}", "--timeout", str(timeout), "--log-level", log_level]
        if preload:
            cmd.append("--preload")
        if max_requests:
            cmd += ["--max-requests", str(max_requests), "--max-requests-jitter", str(max(1, max_requests // 4))]
        cmd.append("gpulock_service.app:app")
        _say(f"{workers} workers, model {model}, pool {pool!r}, http://{host}:{port} "
             f"(/v1/embeddings /health /ready /metrics)")

        proc = subprocess.Popen(cmd, env=env, preexec_fn=_pdeathsig if sys.platform == "linux" else None)

        def forward(signum, frame):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM if signum != signal.SIGHUP else signal.SIGHUP)

        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, forward)
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:
                forward(signal.SIGINT, None)
        return rc
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if redis_proc is not None:
            redis_proc.close()
            _say("embedded Redis stopped")
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
