"""The guard against a test file that leaves a recording OpenTelemetry tracer provider behind
(tests/conftest.py runs it after every file): with one left set, every later file in the same
process (an xdist worker runs many) would trace, and a test that counts spans or asserts that
nothing is traced would fail or pass by the order files ran in. Files that trace use
:func:`support.tracing.memory_spans`, which puts the previous provider back.

Imports nothing of OpenTelemetry: a process that never imported it cannot have set one.
"""

from __future__ import annotations

import sys
from typing import Any


def provider() -> Any:
    """The global tracer provider OpenTelemetry's API holds (None: none set, or the API not
    imported)."""
    trace = sys.modules.get("opentelemetry.trace")
    return None if trace is None else getattr(trace, "_TRACER_PROVIDER", None)


def leaked(before: Any) -> str | None:
    """What is wrong when the global provider is not ``before`` (:func:`provider` when the file
    began) and records (an SDK one): a message naming it; None when nothing leaked. A leaked
    provider is shut down and the API's set-once guard reset, so that the next files run as
    they would alone."""
    now = provider()
    if now is before or now is None:
        return None
    trace = sys.modules["opentelemetry.trace"]
    if isinstance(now, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    from opentelemetry.util._once import Once

    trace._TRACER_PROVIDER = before
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    if before is not None:
        trace._TRACER_PROVIDER_SET_ONCE._done = True
    shutdown = getattr(now, "shutdown", None)
    if shutdown is not None:
        shutdown()
    return (
        f"this test file left a recording tracer provider set ({type(now).__module__}."
        f"{type(now).__qualname__}): later files in this process would trace; set one only "
        "through support.tracing.memory_spans() (it puts the previous one back)"
    )
