"""gunicorn settings for the service: ``gunicorn -c python:gpulock_service.gunicorn_conf
gpulock_service.app:app`` (``gpulock serve`` uses it). Command-line flags override these.

* ``worker_class``: uvicorn's ASGI worker (the ``uvicorn-worker`` package).
* ``timeout``: 120 s, because a worker does not heartbeat to the master while its lifespan
  starts (it waits up to ``GPULOCK_STARTUP_TIMEOUT`` for its resident lease and the model).
* ``child_exit``: removes a dead worker's live gauges from ``PROMETHEUS_MULTIPROC_DIR`` (the
  prometheus-client multiprocess recipe), so recycled or killed workers leave no stale series.
* ``keepalive``: 5 s, uvicorn's ``timeout_keep_alive``: an idle kept-alive connection is closed
  after it.
* ``post_worker_init``: each uvicorn worker serves with :func:`gpulock.http.server.server_protocol`:
  a connection whose request line and headers do not arrive within ``GPULOCK_READ_TIMEOUT``
  seconds (30) is answered 408 and closed, one with more than 64 KiB of them 431 (uvicorn has
  no such bound: a connection that sent nothing, or a header byte a second, was held forever).
  The body's own bounds (size, read time) are the app's (``gpulock.http.guards.RequestLimits``).
"""

import os

worker_class = "uvicorn_worker.UvicornWorker"
timeout = 120
graceful_timeout = 30
keepalive = 5


def post_worker_init(worker):
    config = getattr(worker, "config", None)  # uvicorn_worker.UvicornWorker's uvicorn Config
    if config is None:
        return
    from gpulock.http.server import MAX_HEADER_BYTES, server_protocol

    config.http = server_protocol()
    config.h11_max_incomplete_event_size = MAX_HEADER_BYTES


def child_exit(server, worker):
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid, path)
