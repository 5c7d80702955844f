"""The service's routes, one concept a module, each an ``APIRouter`` made for one app by a
factory that is handed the app's :class:`~gpulock_service.state.Service`:

* ``health``: ``GET /health`` (liveness) and ``GET /ready`` (readiness);
* ``metrics``: ``GET /metrics`` (Prometheus);
* ``models``: OpenAI's Models API, ``GET /v1/models`` and ``GET /v1/models/{model_id}``;
* ``embeddings``: ``POST /v1/embeddings``, batched or one request a lease;
* ``generation``: ``POST /v1/chat/completions`` and ``POST /v1/completions``, one lease a
  generation;
* ``dashboard``: ``/dashboard``, the live view of the pool (``gpulock.dashboard.routes``).
"""

from .dashboard import dashboard_router
from .embeddings import embeddings_router, schema_bounds
from .generation import generation_router
from .health import health_router
from .metrics import metrics_router
from .models import models_router

__all__ = [
    "dashboard_router",
    "embeddings_router",
    "generation_router",
    "health_router",
    "metrics_router",
    "models_router",
    "schema_bounds",
]
