"""``gpulock serve`` and ``gpulock loadtest``: :func:`register` adds both commands to a typer
app (gpulock's own CLI calls it). Importing this module imports only typer: the service, torch,
gunicorn and httpx load when a command runs."""

from __future__ import annotations

import typer


def _on_command_line(ctx: typer.Context, param: str) -> bool:
    """Whether ``param`` was given on the command line, to this command or to ``gpulock``
    itself (``gpulock --redis-url URL serve``)."""
    for c in (ctx, ctx.parent):
        src = c.get_parameter_source(param) if c is not None else None
        if getattr(src, "name", None) == "COMMANDLINE":
            return True
    return False


def register(app: typer.Typer) -> None:
    """Add the ``serve`` and ``loadtest`` commands to ``app``."""

    @app.command("serve")
    def serve(
        ctx: typer.Context,
        workers: int = typer.Option(4, "--workers", "-w", min=1, help="gunicorn worker processes"),
        redis_url: str | None = typer.Option(
            None,
            "--redis-url",
            envvar="GPULOCK_REDIS_URL",
            help="Redis holding the pool; without it an embedded Valkey starts on loopback",
        ),
        capacity: str | None = typer.Option(
            None,
            "--capacity",
            envvar="GPULOCK_CAPACITY",
            help="pool capacity (e.g. 20GiB); default: GPU memory x --utilization, or 2GiB without a GPU",
        ),
        host: str = typer.Option("127.0.0.1", "--host", help="address to bind"),
        port: int = typer.Option(8000, "--port", "-p", min=1, max=65535, help="port to bind"),
        pool: str = typer.Option("gpu0", "--pool", envvar="GPULOCK_POOL", help="pool name"),
        preload: bool = typer.Option(
            False, "--preload/--no-preload", help="import the app in the master before fork"
        ),
        model: str = typer.Option(
            "minilm",
            "--model",
            envvar="GPULOCK_MODEL",
            help="'minilm', 'sleep' (test model) or 'package.module:factory'",
        ),
        generation_model: str = typer.Option(
            "auto",
            "--generation-model",
            envvar="GPULOCK_GENERATION_MODEL",
            help="the model of /v1/chat/completions and /v1/completions: 'tiny' (random "
            "weights: meaningless text), PATH (a local Hugging Face causal-LM folder), 'none', or "
            "'auto' (tiny with --model minilm, else none)",
        ),
        utilization: float = typer.Option(
            0.9,
            "--utilization",
            min=0.01,
            max=1.0,
            help="share of the GPU's memory the pool gets when --capacity is not given",
        ),
        max_requests: int = typer.Option(
            0, "--max-requests", min=0, help="recycle a worker after N requests (0: never)"
        ),
        timeout: int = typer.Option(
            120, "--timeout", min=1, help="gunicorn worker timeout, seconds"
        ),
        log_level: str = typer.Option(
            "info",
            "--log-level",
            help="gunicorn log level: debug, info, warning, error or critical",
        ),
        log_format: str = typer.Option(
            "plain",
            "--log-format",
            envvar="GPULOCK_LOG_FORMAT",
            help="access log, one line per request (logger gpulock.access): plain or json",
        ),
        keep: str | None = typer.Option(
            None,
            "--keep",
            envvar="GPULOCK_KEEP",
            metavar="SECONDS",
            help="kept bytes: seconds (0.1-3600) a worker may keep a released lease's bytes, "
            "idle, to grant its next request of the same size with no Redis round trip while "
            "nobody waits in the pool; 0 (the default): off",
        ),
        data_dir: str | None = typer.Option(
            None,
            "--data-dir",
            envvar="GPULOCK_DATA_DIR",
            help="the embedded server's data (pools, leases, history), kept across restarts; "
            "default $XDG_STATE_HOME/gpulock/serve-PORT (~/.local/state/...); 'none': no persistence",
        ),
    ) -> None:
        """Run the inference service (embeddings, chat completions, completions): gunicorn
        with uvicorn workers, each leasing GPU memory from the pool before every request.

        Every option is checked before anything starts (exit 2: a bad value, or the port in
        use). Prints a line when /ready first answers 200. An embedded Redis that dies is
        started again on its port; one that will not stay up stops the service (exit 69)."""
        from .serve import broker_env_problem, run_serve
        from .serve_words import EXIT_USAGE, say

        problem = broker_env_problem(_on_command_line(ctx, "redis_url"))
        if problem:
            say(f"error: {problem}")
            raise typer.Exit(EXIT_USAGE)
        raise typer.Exit(
            run_serve(
                workers=workers,
                redis_url=redis_url,
                capacity=capacity,
                host=host,
                port=port,
                pool=pool,
                preload=preload,
                model=model,
                generation_model=generation_model,
                utilization=utilization,
                max_requests=max_requests,
                timeout=timeout,
                log_level=log_level,
                log_format=log_format,
                data_dir=data_dir,
                keep=keep,
            )
        )

    @app.command("loadtest")
    def loadtest(
        url: str = typer.Argument("http://127.0.0.1:8000", help="the service's base URL"),
        concurrency: int = typer.Option(
            16, "--concurrency", "-c", min=1, help="requests in flight"
        ),
        requests: int = typer.Option(200, "--requests", "-n", min=1, help="requests to send"),
        batch: int = typer.Option(8, "--batch", "-b", min=1, help="sentences per request"),
        retries: int = typer.Option(
            0, "--retries", min=0, help="retries per request after a 503 (honouring Retry-After)"
        ),
        request_ids: bool | None = typer.Option(
            None,
            "--request-ids/--no-request-ids",
            help="send X-Request-ID (a retried request keeps its place; the service keeps each result "
            "GPULOCK_RESULT_TTL seconds in Redis); default: only with --retries",
        ),
        timeout: float = typer.Option(
            120.0, "--timeout", min=0.1, help="client timeout per request, seconds"
        ),
        seed: int = typer.Option(0, "--seed", help="random seed for the sentences"),
    ) -> None:
        """Send real sentences to POST /v1/embeddings at a fixed concurrency and print
        requests/s, latency percentiles, 503s (with Retry-After) and the pool's peak use."""
        from .loadtest import run_loadtest

        raise typer.Exit(
            run_loadtest(
                url,
                concurrency=concurrency,
                requests=requests,
                batch=batch,
                retries=retries,
                request_ids=retries > 0 if request_ids is None else request_ids,
                timeout=timeout,
                seed=seed,
            )
        )


def main() -> None:
    """``python -m gpulock_service``: the two commands on their own."""
    app = typer.Typer(add_completion=False, no_args_is_help=True, help="gpulock service commands")
    register(app)
    app()
