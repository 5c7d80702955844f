"""The spans OpenTelemetry's console exporter printed (``OTEL_TRACES_EXPORTER=console``), read
back from a process's output: the one reader for benchmarks/trace_demo.py and the tests that
trace ``gpulock serve`` and the broker (they put this folder on ``sys.path``, as the scripts'
smoke tests do)."""

from __future__ import annotations

import json
from typing import Any


def console_spans(text: str) -> list[dict[str, Any]]:
    """The spans in ``text``, in the order printed: each ended span is one indented JSON object
    (``name``, ``context`` with ``trace_id`` and ``span_id`` as ``0x`` hex, ``parent_id``,
    ``kind``, ``start_time``, ``end_time``, ``attributes``, ``events``, ``resource``...); the
    log lines between them are skipped. Raises json.JSONDecodeError on an object cut short."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        i = text.find('{\n    "name": ', i)
        if i < 0:
            return out
        obj, i = dec.raw_decode(text, i)
        out.append(obj)
