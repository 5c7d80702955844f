"""OpenTelemetry for ``gpulock serve`` and ``gpulock broker``: a tracer provider set from the
standard ``OTEL_*`` environment variables, and server spans for each HTTP request.

What the environment asks for (:func:`exporters`):

* ``OTEL_TRACES_EXPORTER``: ``console`` (each span printed to stdout as JSON when it ends),
  ``otlp`` (OTLP over HTTP/protobuf; the exporter reads ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_EXPORTER_OTLP_HEADERS`` and the rest itself),
  or a comma list of both; ``none`` exports nothing.
* Unset: nothing, unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
  is set: then ``otlp`` (an endpoint given is a request to send there). OpenTelemetry's own
  default (``otlp`` to localhost:4318) is not followed: a server started without any ``OTEL_*``
  variable pays nothing and sends nothing.
* ``OTEL_SDK_DISABLED=true``: nothing, whatever else is set (an unknown exporter name is still
  an error).
* The resource: ``OTEL_SERVICE_NAME``, else the command's name (``gpulock-serve``,
  ``gpulock-broker``); ``OTEL_RESOURCE_ATTRIBUTES`` (the SDK's ``Resource.create`` reads both).
  Sampling (``OTEL_TRACES_SAMPLER``) and batching (``OTEL_BSP_*``) are the SDK's, from the same
  environment.

Why not the SDK's own environment configuration: it lives in ``opentelemetry.sdk._configuration``
(private, no stability promise) and is reached through ``opentelemetry-instrument`` and a
distro (``opentelemetry-distro``), a wrapper command and another package. The few public SDK
classes used here (``TracerProvider``, ``Resource``, the span processors and exporters) are
the stable API. A process where something else set a tracer provider already (e.g. run under
``opentelemetry-instrument``) is left as it is.

Without the SDK (``pip install 'gpulock[otel]'``) a request for traces logs one warning and
nothing else happens. Costs nothing when not asked: :func:`exporters` reads the environment;
no OpenTelemetry module is imported.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from gpulock.errors import InvalidArgument

__all__ = [
    "EXCLUDED_URLS",
    "EXPORTERS",
    "configure_from_env",
    "exporters",
    "instrument_app",
    "shutdown",
]

log = logging.getLogger("gpulock.telemetry")

EXPORTERS = ("console", "otlp")
"""The exporter names ``OTEL_TRACES_EXPORTER`` may list (and ``none``)."""

EXCLUDED_URLS = r"/metrics(\?|$),/health(\?|$),/ready(\?|$)"
"""Requests without a server span (the instrumentation's ``excluded_urls``: regular expressions
searched in the URL, comma-separated): scrapes and probes. ``OTEL_PYTHON_FASTAPI_EXCLUDED_URLS``
replaces it when set."""

INSTALL_HINT = "pip install 'gpulock[otel]'"

_provider: Any = None  # the provider this process set (flushed by shutdown())
_warned = False


def _true(v: str | None) -> bool:
    return (v or "").strip().lower() == "true"


def exporters(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The trace exporters the environment asks for (a subset of :data:`EXPORTERS`, in order;
    empty: no traces). See the module's rules.

    Raises: InvalidArgument naming ``OTEL_TRACES_EXPORTER``'s value when it lists a name other
    than ``console``, ``otlp`` and ``none``."""
    env = os.environ if environ is None else environ
    raw = env.get("OTEL_TRACES_EXPORTER")
    names = [n.strip().lower() for n in (raw or "").split(",") if n.strip()]
    bad = [n for n in names if n not in (*EXPORTERS, "none")]
    if bad:
        raise InvalidArgument(
            f"OTEL_TRACES_EXPORTER={raw!r}: unknown exporter {bad[0]!r}; "
            f"use console, otlp (OTLP over HTTP), a comma list of them, or none"
        )
    if _true(env.get("OTEL_SDK_DISABLED")):
        return ()
    if not names:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
            "OTEL_EXPORTER_OTLP_ENDPOINT"
        )
        return ("otlp",) if endpoint else ()
    return tuple(dict.fromkeys(n for n in names if n != "none"))


def _sdk_missing() -> bool:
    global _warned
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        if not _warned:
            _warned = True
            log.warning(
                "gpulock: OpenTelemetry traces were asked for (OTEL_TRACES_EXPORTER or "
                "OTEL_EXPORTER_OTLP_ENDPOINT) but the OpenTelemetry SDK is not installed: "
                "no traces; %s",
                INSTALL_HINT,
            )
        return True
    return False


def configure_from_env(default_service_name: str) -> bool:
    """Set the process's tracer provider from the environment (see the module), once per
    process (call it in each worker, after a fork). ``default_service_name``: the resource's
    ``service.name`` when ``OTEL_SERVICE_NAME`` is not set.

    Returns True when spans are recorded from now on (a provider set here, or one set before by
    something else), False when the environment asks for none or the SDK is missing (then one
    warning is logged).

    Raises: InvalidArgument for an unknown ``OTEL_TRACES_EXPORTER`` name (:func:`exporters`)."""
    global _provider
    wanted = exporters()
    if not wanted or _sdk_missing():
        return False
    from opentelemetry import trace
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    if _provider is not None or not isinstance(
        trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
    ):
        return True  # set already (here, or by the application or opentelemetry-instrument)
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: default_service_name}
    provider = TracerProvider(resource=Resource.create(attrs))
    for name in wanted:
        if name == "console":  # printed as each span ends
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    return True


def instrument_app(app: Any) -> bool:
    """Give ``app`` (a FastAPI app) a server span per request, its parent the W3C
    ``traceparent`` the request carries, when the environment asks for traces and the
    instrumentation (``opentelemetry-instrumentation-fastapi``) is installed; scrapes and
    probes (:data:`EXCLUDED_URLS`) get none. Does no I/O; the spans go to whichever provider
    is set when requests come (:func:`configure_from_env`, in the worker). Returns whether it
    instrumented the app.

    Raises: InvalidArgument for an unknown ``OTEL_TRACES_EXPORTER`` name."""
    if not exporters():
        return False
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    except ImportError:
        if not _sdk_missing():
            log.warning(
                "gpulock: no request spans: opentelemetry-instrumentation-fastapi is not "
                "installed; %s",
                INSTALL_HINT,
            )
        return False
    FastAPIInstrumentor.instrument_app(
        app,
        excluded_urls=os.environ.get("OTEL_PYTHON_FASTAPI_EXCLUDED_URLS") or EXCLUDED_URLS,
        exclude_spans=["receive", "send"],  # one span per request, not one per ASGI message
    )
    return True


def shutdown() -> None:
    """Export the spans still buffered and stop the provider :func:`configure_from_env` set
    (nothing when it set none). Call it as the process stops serving."""
    global _provider
    p, _provider = _provider, None
    if p is not None:
        p.shutdown()
