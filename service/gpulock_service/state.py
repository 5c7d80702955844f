"""What the service's routes and its start share: a :class:`Service` per app, built by
:func:`build_service` from the settings (no I/O, no torch: the model object is made, not
loaded). The router factories (``gpulock_service.routes``) and the lifespan
(``gpulock_service.startup``) are each handed it when ``create_app`` builds the app."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from gpulock.errors import BackendUnavailable
from gpulock.fastapi import GpuLimiter

from . import alloc_conf
from .generation.causal_lm import TINY, CausalLM
from .models import build_model
from .openai_errors import OpenAIError
from .settings import Settings

#: the limiter's name for ``POST /v1/embeddings`` (its estimates, calibration and metrics)
ROUTE = "embeddings"
#: the limiter's name for ``POST /v1/chat/completions`` and ``POST /v1/completions``
GENERATION_ROUTE = "generation"


@dataclass
class Service:
    """One app's settings, limiter and model; ``served`` is the model name answered,
    ``created`` the Unix time of its OpenAI model object; ``generator`` the generative model
    (a :class:`~gpulock_service.generation.causal_lm.CausalLM`, None when
    ``GPULOCK_GENERATION_MODEL`` is ``none``). ``device``, ``resident_bytes`` and
    ``resident_source`` are this worker's start state, written by the lifespan's bring-up
    (``None``, 0, ``None`` until then) and shown by ``/ready``."""

    settings: Settings
    limiter: GpuLimiter
    model: Any
    served: str
    created: int
    device: str | None = None
    resident_bytes: int = 0
    resident_source: str | None = None
    generator: CausalLM | None = None

    @property
    def names(self) -> tuple[str, str]:
        """The model names a request may send: ``served`` and ``sentence-transformers/served``."""
        return (self.served, f"sentence-transformers/{self.served}")

    def model_object(self) -> dict[str, Any]:
        """The served model's OpenAI model object."""
        return {
            "id": self.served,
            "object": "model",
            "created": self.created,
            "owned_by": "gpulock",
        }

    def model_objects(self) -> list[dict[str, Any]]:
        """The OpenAI model objects of every model served: the embedding model's, then the
        generative model's (with a ``description`` saying what it is)."""
        out = [self.model_object()]
        if self.generator is not None:
            out.append(
                {
                    "id": self.generator.name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "gpulock",
                    "description": self.generator.description,
                }
            )
        return out

    def unknown_model(self, name: str) -> OpenAIError:
        """The 404 ``model_not_found`` for a model ``name`` not served here."""
        return OpenAIError(
            404,
            f"model {name!r} is not served here; this service serves {self.served!r} "
            f"(GET /v1/models); leave 'model' out or send that name",
            code="model_not_found",
            param="model",
        )

    async def pool_status(self, name: str, limit: int):
        """The pool's status (``AsyncPool.status``), for the dashboard and its sampler.

        Raises: BackendUnavailable before the limiter is connected."""
        if self.limiter.backend.pool is None:
            raise BackendUnavailable("the service is not connected to Redis yet")
        return await self.limiter.backend.pool.status(limit=limit)

    async def pool_names(self) -> list[str]:
        """The pools the sampler watches: this service's one."""
        return [self.settings.pool]


def make_limiter(settings: Settings) -> GpuLimiter:
    """The service's :class:`GpuLimiter`, configured from ``settings`` (not started)."""
    return GpuLimiter(
        settings.redis_url,
        settings.pool,
        capacity=settings.capacity,
        configure=settings.configure,
        acquire_timeout=settings.acquire_timeout,
        inference_timeout=settings.inference_timeout,
        ttl=settings.ttl,
        executor_threads=settings.executor_threads,
        park_timeout=settings.park_timeout,
        result_ttl=settings.result_ttl,
        max_waiters=settings.max_waiters,
        reaper_interval=settings.reaper_interval,
        history_file=settings.history_file,
        enabled=not settings.disabled,
        exit_on_fatal=settings.exit_on_fatal,
        priority_header=settings.priority_header,
        tenant=settings.tenant,
        keep=settings.keep,
        device=settings.sample_device,
        device_reader=settings.device_reader,
    )


def build_service(settings: Settings) -> Service:
    """Apply the allocator setting (before any worker imports torch), make the model object
    and the limiter. No I/O."""
    alloc_conf.apply()
    model = build_model(settings)
    served: str = settings.model_name or str(getattr(model, "name", settings.model))
    limiter = make_limiter(settings)
    # OpenAI's model objects carry a Unix time; this one is when this worker built the app
    created = int(getattr(model, "created", 0) or time.time())
    return Service(settings, limiter, model, served, created, generator=build_generator(settings))


def build_generator(settings: Settings) -> CausalLM | None:
    """The generative model ``GPULOCK_GENERATION_MODEL`` names (not loaded yet): ``auto`` is
    the tiny model beside the demo's embedding model (``minilm``), none beside the others (the
    ``sleep`` test model loads no torch; a model of your own is served alone)."""
    spec = settings.generation_model.strip()
    if spec == "auto":
        spec = TINY if settings.model.strip() == "minilm" else "none"
    if spec == "none":
        return None
    return CausalLM(spec, settings.generation_model_name)
