"""``POST /v1/embeddings``, OpenAI's Embeddings API, under a lease of GPU memory: each request
checked and counted (:mod:`gpulock_service.inputs`), estimated, then run either in a batch of
the worker's concurrent requests (``GPULOCK_BATCH``: one model call, one lease) or alone
(``GpuLimiter.endpoint``: one lease per request). :func:`schema_bounds` gives the OpenAPI
schema the bounds this handler enforces."""

from __future__ import annotations

import base64
import json
import logging
from fastapi import APIRouter, Request, Response

from gpulock.fastapi import Batcher

from ..inputs import EmbeddingRequest, InputRules, check_shape, count, texts_of
from ..metrics import observe_request
from ..openai_errors import OpenAIError
from ..openapi import EMBEDDING_RESPONSES
from ..state import ROUTE, Service

log = logging.getLogger("gpulock.service")


def embeddings_router(svc: Service) -> tuple[APIRouter, Batcher[EmbeddingRequest] | None]:
    """The route and, when ``GPULOCK_BATCH`` is on, its ``Batcher`` (else ``None``)."""
    settings, limiter, model, served = svc.settings, svc.limiter, svc.model, svc.served
    router = APIRouter()
    rules = InputRules(
        served=served,
        max_batch=settings.max_batch,
        context=int(getattr(model, "max_tokens", settings.max_tokens)),
        truncate=settings.truncate,
    )

    def estimate(body: EmbeddingRequest) -> int:
        check_shape(body, rules)
        if body.model is not None and body.model not in svc.names:
            raise svc.unknown_model(body.model)
        if body.dimensions is not None and body.dimensions != model.dimensions:
            raise OpenAIError(
                400,
                f"{served} returns {model.dimensions} dimensions, not {body.dimensions}",
                param="dimensions",
            )
        counts = count(body, model, rules)  # once: the estimate and the usage use them
        body._tokens = sum(counts)
        body._longest = max(counts)
        observe_request(len(counts), body._tokens)
        return limiter.estimate(ROUTE, len(counts), max(counts), model.estimate_bytes)

    def estimate_batch(bodies: list[EmbeddingRequest]) -> int:
        """One model call over all the batch's inputs, padded to the longest."""
        n = sum(len(texts_of(b)) for b in bodies)
        return limiter.estimate(ROUTE, n, max(b._longest for b in bodies), model.estimate_bytes)

    def respond(body: EmbeddingRequest, vectors: list[list[float]]) -> Response:
        n_tokens = body._tokens
        if body.encoding_format == "base64":
            import numpy as np

            data = [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode(),
                }
                for i, v in enumerate(vectors)
            ]
        else:
            data = [
                {"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)
            ]
        payload = {
            "object": "list",
            "data": data,
            "model": served,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
        }
        return Response(
            json.dumps(payload, separators=(",", ":")).encode(), media_type="application/json"
        )

    def embed_batch(bodies: list[EmbeddingRequest]) -> list[Response]:
        """Runs in gpulock's executor thread, under the batch's lease: one model call."""
        texts = [t for b in bodies for t in texts_of(b)]
        vectors = model.embed(texts)
        out, k = [], 0
        for b in bodies:
            n = len(texts_of(b))
            out.append(respond(b, vectors[k : k + n]))
            k += n
        return out

    if settings.batch:
        batcher = limiter.batcher(
            ROUTE,
            embed_batch,
            estimate=estimate,
            estimate_batch=estimate_batch,
            max_wait_ms=settings.batch_max_wait_ms,
            max_size=settings.batch_max_size,
            param="body",  # X-Request-ID: the fingerprint of the unbatched handler's `body`
            priority=settings.priority,
            max_priority=settings.max_priority,
        )

        @router.post("/v1/embeddings", responses=EMBEDDING_RESPONSES)
        async def embeddings_batched(
            body: EmbeddingRequest, request: Request, response: Response
        ) -> Response:
            """Joins a batch of this worker's concurrent requests (GPULOCK_BATCH)."""
            return await batcher.submit(body, request=request, response=response)

        return router, batcher

    @router.post("/v1/embeddings", responses=EMBEDDING_RESPONSES)
    @limiter.endpoint(
        ROUTE,
        estimate=estimate,
        priority=settings.priority,
        max_priority=settings.max_priority,
    )
    def embeddings(body: EmbeddingRequest) -> Response:
        """Runs in gpulock's executor thread, under the request's lease."""
        return respond(body, model.embed(texts_of(body)))

    return router, None


def schema_bounds(svc: Service) -> dict[str, int | None]:
    """The handler's bounds for the schema (read on the first GET /openapi.json):
    ``max_batch``, the model's ``dimensions`` and ``vocab_size`` (``None`` when it has none or
    it cannot be read), ``token_ids`` 1 when the model takes token ids."""
    model = svc.model
    try:  # MiniLM's reads its tokenizer (from disk, loaded with the model)
        vocab = getattr(model, "vocab_size", None)
    except Exception:  # noqa: BLE001 - a schema without the bound, never a 500
        log.warning("gpulock: the model's vocab_size could not be read", exc_info=True)
        vocab = None
    return {
        "max_batch": svc.settings.max_batch,
        "dimensions": getattr(model, "dimensions", None),
        "vocab_size": vocab if isinstance(vocab, int) else None,
        "token_ids": int(callable(getattr(model, "decode_tokens", None))),
    }
