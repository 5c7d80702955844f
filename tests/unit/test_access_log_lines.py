"""The access log's lines: the stderr fallback (no handler configured) dates and names a plain
line like gunicorn's own lines, a JSON line stays one JSON object (it carries its own
``time``); whatever a client sends (request id, path, method) stays one line and one field,
in both formats; the request id's bound."""

from __future__ import annotations

import json
import logging

from hypothesis import given, settings
from hypothesis import strategies as st

from gpulock.http.access_log import (
    ACCESS_LOGGER,
    LOG_FORMATS,
    MAX_REQUEST_ID_BYTES,
    FallbackFormatter,
    _line,
    request_id_error,
    shown,
)


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


# ---- what a client sends can never forge a field or a line ---------------------------------------

FIELDS = [
    "method",
    "path",
    "status",
    "duration_ms",
    "request_id",
    "queue_wait_ms",
    "lease_bytes",
]


def parse_plain(line: str) -> list[tuple[str, str | None]]:
    """The ``(key, value)`` pairs of a plain line, in order: a value is bare text up to the
    next space (``-``: None) or a JSON string. Raises ValueError for anything else."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(line):
        eq = line.index("=", i)
        key = line[i:eq]
        if not key.isidentifier():
            raise ValueError(f"bad key {key!r} in {line!r}")
        j = eq + 1
        if line.startswith('"', j):
            value, j = dec.raw_decode(line, j)
        else:
            end = line.find(" ", j)
            end = len(line) if end < 0 else end
            value = None if line[j:end] == "-" else line[j:end]
            if value is not None and ('"' in value or "=" in value):
                raise ValueError(f"unquoted {value!r} in {line!r}")
            j = end
        out.append((key, value))
        if j < len(line):
            if line[j] != " ":
                raise ValueError(f"no space after {key} in {line!r}")
            j += 1
        i = j
    return out


def _hostile(rid: bytes, path: str, method: str) -> dict:
    return {**_fields(), "request_id": rid, "path": path, "method": method}


@settings(max_examples=300, deadline=None)
@given(
    rid=st.binary(max_size=MAX_REQUEST_ID_BYTES),
    path=st.text(),
    method=st.text(max_size=10),
    wait=st.one_of(st.none(), st.floats(0, 1e6)),
)
def test_any_client_value_is_one_line_whose_other_fields_are_unchanged(rid, path, method, wait):
    rec = {**_hostile(rid, path, method), "queue_wait_s": wait}
    for fmt in LOG_FORMATS:
        line = _line(rec, fmt)
        assert line.splitlines() == [line] and line.isascii()  # one line, nothing to misread
        if fmt == "json":
            got = json.loads(line)
            assert list(got) == ["time", *FIELDS]
        else:
            pairs = parse_plain(line)
            assert [k for k, _ in pairs] == FIELDS  # no field added, none lost
            got = dict(pairs)
            assert got["status"] == "200" and got["lease_bytes"] == "1024"
            got["status"], got["lease_bytes"] = 200, 1024
        assert got["request_id"] == shown(rid) and got["path"] == shown(path)
        assert got["method"] == shown(method) and got["status"] == 200
        assert got["lease_bytes"] == 1024 and got["duration_ms"] in (12.3, "12.3")
        want_wait = None if wait is None else round(wait * 1000, 3)
        assert got["queue_wait_ms"] in (want_wait, None if wait is None else str(want_wait))


def test_a_forged_id_stays_in_its_field():
    forged = b"r1 status=500 path=/forged"
    line = _line(_hostile(forged, "/v1/embeddings", "POST"), "plain")
    assert line.count("status=") == 2  # the real field and the quoted text
    pairs = parse_plain(line)
    assert [k for k, _ in pairs].count("status") == 1
    assert dict(pairs)["request_id"] == "r1 status=500 path=/forged"
    assert 'request_id="r1 status=500 path=/forged"' in line
    # what needs no quoting is written as it was: the usual line is unchanged
    plain = _line(_hostile(b"4f0c-1.a:b_c", "/v1/embeddings", "POST"), "plain")
    assert " request_id=4f0c-1.a:b_c " in plain and " path=/v1/embeddings " in plain
    # the placeholder of a missing value is never mistaken for a client's "-"
    assert dict(parse_plain(_line(_hostile(b"-", "/", "GET"), "plain")))["request_id"] == "-"


def test_header_bytes_that_are_not_utf8_show_as_escapes():
    assert shown(b"caf\xc3\xa9 \xff") == "café \\xff"
    assert shown("lone \ud800") == "lone \\ud800"
    line = _line(_hostile(b"caf\xc3\xa9\xff", "/", "GET"), "json")
    assert json.loads(line)["request_id"] == "café\\xff"


def test_the_request_id_bound():
    assert request_id_error(b"x" * MAX_REQUEST_ID_BYTES) is None
    assert request_id_error("é" * MAX_REQUEST_ID_BYTES) is None  # as Starlette decodes bytes
    msg = request_id_error(b"x" * 5000)
    assert msg is not None and "5000 bytes" in msg and f"at most {MAX_REQUEST_ID_BYTES}" in msg
    assert request_id_error("✓" * 50, "Idempotency-Key") is not None  # 150 bytes of UTF-8
    assert "Idempotency-Key" in (request_id_error("x" * 129, "Idempotency-Key") or "")
