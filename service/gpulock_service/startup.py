"""The service's lifespan: everything that connects or loads, in each worker after the fork.

1. connect to Redis, create the pool if a capacity is configured (create-only unless
   ``GPULOCK_CONFIGURE=set``), start the background reaper (and, with the dashboard, the
   pool's sampler);
2. take the worker's **resident lease** (configured bytes; on CUDA the weights' size plus the
   CUDA context, topped up to ``memory_reserved`` after loading) — until it is granted the
   worker is not ready and ``/ready`` names the shortfall;
3. load the model (and the generative model, ``GPULOCK_GENERATION_MODEL``) once, in a thread
   (then calibrate, if asked, on CUDA), then report ready.

First of all it sets the worker's tracer provider when the ``OTEL_*`` variables ask for traces
(:func:`gpulock.http.telemetry.configure_from_env`, service name ``gpulock-serve``).

The worker waits ``GPULOCK_STARTUP_TIMEOUT`` seconds for 2-3 before it starts serving; if they
are not done by then it serves anyway (``/health`` answers, requests get 503 not-ready) and
keeps trying in the background.
"""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

from gpulock.admin.samples import Sampler
from gpulock.http import telemetry
from gpulock.protocol.keys import pool_key
from gpulock.transport.shards_async import aon_key
from gpulock.units import format_size, parse_size

from .state import ROUTE, Service

log = logging.getLogger("gpulock.service")


def lifespan(svc: Service) -> Callable[[Any], Any]:
    """The app's ``lifespan=``: start the limiter (and the sampler), bring the worker up
    (waiting at most ``startup_timeout`` for it), stop the limiter on the way out."""

    @asynccontextmanager
    async def run(app: Any) -> AsyncIterator[None]:
        settings, limiter = svc.settings, svc.limiter
        # traces from the OTEL_* variables: in each worker, after gunicorn's fork
        telemetry.configure_from_env("gpulock-serve")
        await limiter.start()
        if settings.dashboard and limiter.backend.redis is not None:
            # one sampler per worker; the pool's sampler lease lets one of them write
            sampler = Sampler(limiter.backend.redis, svc.pool_names, svc.pool_status)
            limiter.spawn(sampler.run(), name="gpulock-sampler")
        task = limiter.spawn(bring_up(svc), name="gpulock-bring-up")
        if settings.startup_timeout > 0:
            done, _ = await asyncio.wait({task}, timeout=settings.startup_timeout)
            if not done:
                _, checks = limiter.readiness()
                why = "; ".join(
                    f"{k}: {v.get('message')}" for k, v in checks.items() if not v["ok"]
                )
                log.warning(
                    "gpulock: worker %d serving while not ready after %.0fs: %s",
                    os.getpid(),
                    settings.startup_timeout,
                    why,
                )
        try:
            yield
        finally:
            await limiter.stop()
            telemetry.shutdown()  # the spans still buffered are sent

    return run


def resolve_device(svc: Service) -> str:
    """The device to load on: ``GPULOCK_DEVICE`` resolved (``auto``: CUDA when there is one;
    the sleep model's ``auto`` is the CPU). May import torch: call it in a thread."""
    if svc.settings.model == "sleep" and svc.settings.device == "auto":
        return "cpu"
    from gpulock.cuda import resolve_device as rd

    return rd(svc.settings.device)


def resident_plan(svc: Service, on_cuda: bool) -> tuple[int, str]:
    """The resident lease to take before loading, in bytes, and where that number comes from:
    ``GPULOCK_RESIDENT``; else on CUDA the weights' size (the embedding model's and the
    generative model's) plus ``GPULOCK_CUDA_CONTEXT``; else
    ``GPULOCK_CPU_RESIDENT``."""
    settings = svc.settings
    configured = settings.resident_bytes()
    if configured is not None:
        return configured, "GPULOCK_RESIDENT"
    if on_cuda:
        hint = getattr(svc.model, "resident_hint", lambda: 0)() or 0
        if svc.generator is not None:  # its folder is found (or built) by then: bring_up
            hint += svc.generator.resident_hint()
        resident = (
            int(hint) + parse_size(settings.cuda_context)
            if settings.cuda_context != "0"
            else int(hint)
        )
        return (
            resident,
            "weights size + GPULOCK_CUDA_CONTEXT (topped up to the measured reservation after load)",
        )
    return parse_size(settings.cpu_resident), "GPULOCK_CPU_RESIDENT (CPU device)"


async def bring_up(svc: Service) -> None:
    """Steps 2-3 of the module docstring, with the ``model`` readiness condition saying where
    they are; a failure is logged and named by that condition (the worker stays not ready)."""
    settings, limiter, model, served = svc.settings, svc.limiter, svc.model, svc.served
    limiter.set_condition("model", False, "starting")
    try:
        device = await asyncio.to_thread(resolve_device, svc)
        if svc.generator is not None:  # the tiny model's folder is built here the first time
            await asyncio.to_thread(svc.generator.folder)
        svc.device = device
        on_cuda = device.startswith("cuda")
        configured = settings.resident_bytes()
        resident, source = resident_plan(svc, on_cuda)
        svc.resident_source = source
        if resident > 0:
            limiter.set_condition(
                "model", False, f"waiting for the resident lease ({format_size(resident)})"
            )
            await limiter.acquire_resident(resident, purpose=served)
            svc.resident_bytes = resident
        names = served + (f" and {svc.generator.name}" if svc.generator is not None else "")
        limiter.set_condition("model", False, f"loading {names} on {device}")

        def load() -> None:
            if settings.torch_threads and not on_cuda and settings.model != "sleep":
                import torch

                torch.set_num_threads(settings.torch_threads)
            model.load(device)
            if svc.generator is not None:
                svc.generator.load(device)

        await asyncio.to_thread(load)
        if on_cuda and configured is None:
            from gpulock.cuda import resident_bytes

            ctx = 0 if settings.cuda_context == "0" else parse_size(settings.cuda_context)
            measured = await asyncio.to_thread(resident_bytes, device, context_bytes=ctx)
            if measured and measured > resident:
                log.info(
                    "gpulock: measured resident %s > leased %s; topping up",
                    format_size(measured),
                    format_size(resident),
                )
                await limiter.acquire_resident(measured - resident, purpose=served + "-topup")
                svc.resident_bytes = measured
        if on_cuda and settings.calibrate and hasattr(model, "calibration_run"):
            await calibrate(svc, device)
        limiter.set_condition("model", True, "")
        log.info(
            "gpulock: worker %d ready: %s on %s, resident lease %s (%s)",
            os.getpid(),
            served,
            device,
            format_size(svc.resident_bytes) if svc.resident_bytes else "none",
            source,
        )
    except asyncio.CancelledError:
        raise
    except Exception as e:
        log.exception("gpulock: worker start failed")
        limiter.set_condition("model", False, f"start failed: {type(e).__name__}: {e}")


async def calibrate(svc: Service, device: str) -> None:
    """Measure the embeddings route's peaks over a grid of shapes into the pool's estimates:
    one worker of the pool at a time (a lock next to the pool, held at most 10 minutes); a
    worker that finds it taken skips calibration."""
    settings, limiter, model = svc.settings, svc.limiter, svc.model
    lock = pool_key(settings.pool, "calibrating")
    if limiter.backend.pool is None:  # not started (the lifespan starts it before bring_up)
        return
    redis = limiter.backend.pool.redis  # the limiter's own client
    # on the pool's server alone (on a cluster, its shard: gpulock.transport.shards_async.aon_key)
    claimed = await aon_key(redis, lock, ("SET", lock, str(os.getpid()), "NX", "EX", 600))
    if not claimed[0]:
        return
    try:
        b_max = max(1, settings.max_batch)
        shapes = [
            (b, s)
            for b in sorted({1, 8, 32, min(128, b_max), b_max})
            for s in (16, 64, settings.max_tokens)
        ]
        out = await limiter.calibrate(
            ROUTE, model.calibration_run, shapes, device, model.estimate_bytes
        )
        log.info("gpulock: calibrated %d shapes into %s", len(out), limiter.estimates.key)
    finally:
        await aon_key(redis, lock, ("DEL", lock))
