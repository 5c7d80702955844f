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
    log lines between them are skipped. The last object may be cut short (``text`` read while
    the process writes it): it is left out. Raises json.JSONDecodeError on an object cut short
    before another one (a garbled output)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        i = text.find(_START, i)
        if i < 0:
            return out
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            if text.find(_START, i + 1) < 0:
                return out  # the one being written
            raise
        out.append(obj)


_START = '{\n    "name": '
