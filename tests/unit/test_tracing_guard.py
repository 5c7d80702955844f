"""support.tracing_guard, which tests/conftest.py runs after every file: a recording tracer
provider a file leaves set is named, shut down and taken back (the previous one restored), so
the next files in the process run untraced as they would alone; one set and put back through
support.tracing.memory_spans is no leak."""

from __future__ import annotations

import pytest
from support import tracing_guard

from gpulock_common import tracing

pytest.importorskip("opentelemetry.sdk")


def test_a_provider_left_set_is_named_and_taken_back():
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.util._once import Once

    before = tracing_guard.provider()
    assert tracing_guard.leaked(before) is None
    assert not tracing.recording()
    saved_once = trace._TRACER_PROVIDER_SET_ONCE
    trace._TRACER_PROVIDER_SET_ONCE = Once()  # as a file that sets one itself would find it
    try:
        trace.set_tracer_provider(TracerProvider())
        assert tracing.recording()
        problem = tracing_guard.leaked(before)
    finally:
        if tracing_guard.provider() is not before:  # the guard did not put it back
            trace._TRACER_PROVIDER = before
        trace._TRACER_PROVIDER_SET_ONCE = saved_once
    assert problem is not None and "memory_spans" in problem and "TracerProvider" in problem
    assert tracing_guard.provider() is before and not tracing.recording()


def test_memory_spans_leaves_nothing_behind():
    from support.tracing import memory_spans

    before = tracing_guard.provider()
    with memory_spans() as exporter:
        assert tracing.recording()
        with tracing.span(tracing.ACQUIRE):
            pass
        assert [s.name for s in exporter.get_finished_spans()] == [tracing.ACQUIRE]
    assert tracing_guard.leaked(before) is None
    assert not tracing.recording()
