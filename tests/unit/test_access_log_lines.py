"""The access log's stderr fallback (no handler configured): a plain line is dated and named
like gunicorn's own lines, a JSON line stays one JSON object (it carries its own ``time``)."""

from __future__ import annotations

import json
import logging

from gpulock._access_log import ACCESS_LOGGER, FallbackFormatter, _line


def _rec(msg: str) -> logging.LogRecord:
    return logging.getLogger(ACCESS_LOGGER).makeRecord(
        ACCESS_LOGGER, logging.INFO, __file__, 0, msg, (), None
    )


def _fields() -> dict:
    return {
        "method": "POST",
        "path": "/v1/embeddings",
        "status": 200,
        "duration_s": 0.0123,
        "request_id": "r1",
        "started": 1796150000.5,
        "lease_bytes": 1024,
    }


def test_plain_line_is_dated_and_named():
    out = FallbackFormatter().format(_rec(_line(_fields(), "plain")))
    head, _, body = out.partition(" INFO gpulock.access: ")
    assert head[:4].isdigit() and body.startswith("method=POST path=/v1/embeddings status=200 ")
    assert "queue_wait_ms=- lease_bytes=1024" in body


def test_json_line_stays_json_with_its_time():
    out = FallbackFormatter().format(_rec(_line(_fields(), "json")))
    row = json.loads(out)
    assert row["time"] == "2026-12-01T18:33:20.500+00:00"
    assert row["status"] == 200 and row["queue_wait_ms"] is None and row["lease_bytes"] == 1024
