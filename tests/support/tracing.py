"""An OpenTelemetry SDK tracer provider that keeps its finished spans in memory, set as the
process's global provider for a block (the tests of docs/TRACING.md's spans), and lookups of
those spans.

OpenTelemetry lets a process set its global tracer provider once; :func:`memory_spans` resets
that guard before and puts the previous provider back after (as opentelemetry-test-utils'
``reset_trace_globals`` does), so later tests in the process run unconfigured again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once


@contextmanager
def memory_spans() -> Iterator[InMemorySpanExporter]:
    """An SDK provider exporting each span as it ends to the exporter yielded, global for the
    block."""
    saved = trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    trace.set_tracer_provider(provider)
    try:
        yield exporter
    finally:
        trace._TRACER_PROVIDER_SET_ONCE, trace._TRACER_PROVIDER = saved
        provider.shutdown()


def finished(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    """The finished spans named ``name``, in the order they ended."""
    return [s for s in exporter.get_finished_spans() if s.name == name]


def one(
    exporter: InMemorySpanExporter, name: str, where: Mapping[str, Any] | None = None
) -> ReadableSpan:
    """The one finished span named ``name`` whose attributes include ``where``; AssertionError
    unless there is exactly one."""
    want = dict(where or {})
    got = [
        s
        for s in finished(exporter, name)
        if all((s.attributes or {}).get(k) == v for k, v in want.items())
    ]
    assert len(got) == 1, (name, want, [dict(s.attributes or {}) for s in got])
    return got[0]


def events(span: ReadableSpan, name: str) -> list[dict[str, Any]]:
    """The attributes of ``span``'s events named ``name``, in order."""
    return [dict(e.attributes or {}) for e in span.events if e.name == name]
