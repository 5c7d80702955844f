"""gunicorn settings for the service: ``gunicorn -c python:gpulock_service.gunicorn_conf
gpulock_service.app:app`` (``gpulock serve`` uses it). Command-line flags override these.

* ``worker_class``: uvicorn's ASGI worker (the ``uvicorn-worker`` package).
* ``timeout``: 120 s, because a worker does not heartbeat to the master while its lifespan
  starts (it waits up to ``GPULOCK_STARTUP_TIMEOUT`` for its resident lease and the model).
* ``child_exit``: removes a dead worker's live gauges from ``PROMETHEUS_MULTIPROC_DIR`` (the
  prometheus-client multiprocess recipe), so recycled or killed workers leave no stale series.
"""

import os

worker_class = "uvicorn_worker.UvicornWorker"
timeout = 120
graceful_timeout = 30
keepalive = 5


def child_exit(server, worker):
    path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if path:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid, path)
