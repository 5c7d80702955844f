"""HTTP pieces the FastAPI service and the lease broker share: request guards, the access log,
OpenAPI error responses, places kept across a 503, noticing a client that hung up, traces
configured from the ``OTEL_*`` variables (:mod:`gpulock.http.telemetry`).

Internal: the public HTTP integration is ``gpulock.fastapi``.
"""
