"""gpulock_service: the multi-worker FastAPI inference service that leases GPU memory from a
gpulock pool before every CUDA call. Nothing here connects to Redis or touches CUDA at import
time (safe under ``gunicorn --preload``)."""
