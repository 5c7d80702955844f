"""The broker's request ids and access log: ``X-Request-ID`` on every response (the client's
echoed, else a fresh one; errors too), and one ``gpulock.access`` line per request naming
method, path, status, duration, request id, queue wait and lease bytes."""

from __future__ import annotations

import json
import logging

from gpulock.http.access_log import ACCESS_LOGGER

from ._support import BrokerServer, client


def _lines(caplog, rid: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == ACCESS_LOGGER and f"request_id={rid}" in r.getMessage()
    ]


def test_request_id_generated_echoed_and_logged(user, gpu, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    r = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "1GiB"})
    assert r.status_code == 201, r.text
    rid = r.headers["x-request-id"]
    assert len(rid) == 32 and int(rid, 16) >= 0
    (line,) = _lines(caplog, rid)
    assert f"method=POST path=/v1/pools/{gpu}/leases status=201 " in line
    assert f"lease_bytes={1 << 30}" in line and "queue_wait_ms=" in line
    assert "queue_wait_ms=-" not in line  # it was granted: its wait is measured

    # an error carries one too; a client's own is echoed, not replaced
    bad = user.post(f"/v1/pools/{gpu}/leases", json={"amount": "lots"})
    assert bad.status_code == 422
    assert len(bad.headers["x-request-id"]) == 32
    assert bad.headers["x-request-id"] != rid
    mine = user.get("/v1/pools/no-such-pool", headers={"X-Request-ID": "client-id-7"})
    assert mine.status_code in (403, 404), mine.text
    assert mine.headers.get_list("x-request-id") == ["client-id-7"]
    (line,) = _lines(caplog, "client-id-7")
    assert f"status={mine.status_code} " in line and "lease_bytes=-" in line


def test_json_access_log(redis_srv, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    srv = BrokerServer(redis_srv.url, log_format="json").start()
    try:
        with client(srv.url) as c:
            r = c.get("/health")
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        rows = [
            json.loads(rec.getMessage())
            for rec in caplog.records
            if rec.name == ACCESS_LOGGER and rid in rec.getMessage()
        ]
        assert len(rows) == 1
        row = rows[0]
        assert row["method"] == "GET" and row["path"] == "/health" and row["status"] == 200
        assert row["request_id"] == rid and row["duration_ms"] >= 0
        assert row["queue_wait_ms"] is None and row["lease_bytes"] is None
    finally:
        srv.stop()


def _parse_plain(line: str) -> dict:
    """A plain line's fields (each once, or AssertionError): bare text up to a space, or a
    JSON string."""
    dec, out, i = json.JSONDecoder(), {}, 0
    while i < len(line):
        eq = line.index("=", i)
        key, j = line[i:eq], eq + 1
        if line.startswith('"', j):
            value, j = dec.raw_decode(line, j)
        else:
            end = line.find(" ", j)
            end = len(line) if end < 0 else end
            value, j = line[j:end], end
        assert key not in out, f"{key} twice in {line!r}"
        out[key] = value
        i = j + 1
    return out


def test_hostile_request_ids_stay_one_field_of_one_line(redis_srv, caplog):
    """``r1 status=500 path=/forged`` was written as it came (the line then held two statuses),
    and 5,000 characters were echoed and logged whole; in both formats each value is one
    field now, and an id over 128 bytes is refused."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    forged, raw = "r1 status=500 path=/forged", b'caf\xc3\xa9 \xff "q" a=b'
    for fmt in ("plain", "json"):
        srv = BrokerServer(redis_srv.url, log_format=fmt).start()
        try:
            with client(srv.url) as c:
                for rid in (forged, raw):
                    r = c.get("/health", headers={"X-Request-ID": rid})
                    assert r.status_code == 200
                r = c.get("/health", headers={"X-Request-ID": "L" * 5000})
                assert r.status_code == 400
                assert "at most 128 bytes" in r.json()["detail"]["message"]
                assert r.json()["detail"]["error"] == "invalid_request_id"
                fresh = r.headers["x-request-id"]
                assert len(fresh) == 32
        finally:
            srv.stop()
        lines = [rec.getMessage() for rec in caplog.records if rec.name == ACCESS_LOGGER]
        caplog.clear()
        assert len(lines) == 3 and all(ln.splitlines() == [ln] and ln.isascii() for ln in lines)
        rows = [json.loads(ln) if fmt == "json" else _parse_plain(ln) for ln in lines]
        assert [r["request_id"] for r in rows] == [forged, 'café \\xff "q" a=b', fresh]
        assert [str(r["status"]) for r in rows] == ["200", "200", "400"]
        assert all(r["path"] == "/health" for r in rows)
