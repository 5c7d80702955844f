"""HTTP pieces the FastAPI service and the lease broker share: request guards, the access log,
OpenAPI error responses, places kept across a 503, noticing a client that hung up.

Internal: the public HTTP integration is ``gpulock.fastapi``.
"""
