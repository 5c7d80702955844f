"""OpenTelemetry in tests: finished spans collected in memory, and lookups over them.

The global tracer provider can be set once per process (``trace.set_tracer_provider``): the
first caller sets an SDK ``TracerProvider``; every caller (each test module that records)
adds its own in-memory exporter to whichever SDK provider is set, so modules run in one
process each see every span finished while they run."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def memory_exporter() -> Any:
    """An ``InMemorySpanExporter`` receiving every span the global (SDK) tracer provider
    finishes from now on, synchronously (``SimpleSpanProcessor``); the provider is set first
    when none is. Call ``shutdown()`` on it when done (it then keeps nothing more)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider), "another kind of tracer provider is set"
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def named(spans: Iterable[Any], name: str, **attrs: Any) -> list[Any]:
    """The spans called ``name`` whose attributes include ``attrs`` (dots in attribute names
    written as ``__``: ``gpulock__route="x"``)."""
    want = {k.replace("__", "."): v for k, v in attrs.items()}
    return [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in want.items())
    ]


def server_span(spans: Iterable[Any], trace_id: int) -> Any:
    """The one SERVER span (the request's) of trace ``trace_id``."""
    from opentelemetry.trace import SpanKind

    found = [s for s in spans if s.context.trace_id == trace_id and s.kind is SpanKind.SERVER]
    assert len(found) == 1, [s.name for s in found]
    return found[0]
