"""Request ids and access-log lines on every HTTP surface as real processes (the service under
gunicorn, the broker's own entry point, a user's GpuLimiter app under gunicorn; the fixtures
of ``test_http_limits``), as a hostile client finds them:

* ``X-Request-ID: r1 status=500 path=/forged`` was written into the plain access line as it
  came, so the line read ``status=200 ... request_id=r1 status=500 path=/forged``; a path with
  an encoded newline could start a line of its own. Now each stays one quoted field of one
  line, and non-ASCII and bytes that are not UTF-8 are escaped;
* a 5,000-character id was accepted, echoed and logged whole. Now an id over 128 bytes is a
  400 naming the bound (it is an idempotency key: never cut), neither echoed nor logged; one
  of 128 bytes is served and echoed.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from test_http_limits import (
    SURFACES,
    _target,
    broker,  # noqa: F401 - fixture
    service,  # noqa: F401 - fixture
    user_app,  # noqa: F401 - fixture
)

from gpulock.http.access_log import MAX_REQUEST_ID_BYTES

# whose log the test reads: the user's app installs no AccessLog; the broker here logs at
# WARNING (its lines are read in tests/broker/test_access_log.py)
LOGGED = ["service"]
FORGED = "r1 status=500 path=/forged"


def _parse_plain(line: str) -> list[tuple[str, object]]:
    """``(key, value)`` pairs of a plain access line: bare text up to a space, or a JSON string."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(line):
        eq = line.index("=", i)
        key, j = line[i:eq], eq + 1
        if line.startswith('"', j):
            value, j = dec.raw_decode(line, j)
        else:
            end = line.find(" ", j)
            end = len(line) if end < 0 else end
            value, j = line[j:end], end
        out.append((key, value))
        i = j + 1
    return out


def _access_lines(srv, marker: str, n: int = 1, timeout: float = 10) -> list[str]:
    """The plain access lines (after the logger's prefix) holding ``marker``, once ``n`` are
    there: a line is written once its response was sent (poll the log for it)."""
    deadline = time.monotonic() + timeout
    while True:
        text = srv.log_path.read_text(errors="replace")
        lines = [
            ln.partition("gpulock.access: ")[2]
            for ln in text.splitlines()
            if "gpulock.access: " in ln and marker in ln
        ]
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_forged_request_id_or_path_stays_one_field_of_one_line(request):
    surface = "service"
    url, _, headers = _target(request, surface)
    r = httpx.get(url + "/health", headers={**headers, "X-Request-ID": FORGED}, timeout=10)
    assert r.status_code == 200 and r.headers["x-request-id"] == FORGED  # echoed as sent
    (line,) = _access_lines(request.getfixturevalue(surface), "/forged")
    pairs = _parse_plain(line)
    keys = [k for k, _ in pairs]
    assert keys.count("status") == 1 and keys.count("path") == 1, line
    assert dict(pairs)["request_id"] == FORGED and dict(pairs)["status"] == "200", line

    # a path (percent-decoded by the server) with a newline and fields of its own
    mark = f"nl-{surface}"
    r = httpx.get(url + f"/{mark}%0Astatus=200%20path=/ok%22%3D", headers=headers, timeout=10)
    assert r.status_code == 404
    (line,) = _access_lines(request.getfixturevalue(surface), mark)
    got = dict(_parse_plain(line))
    assert got["path"] == f'/{mark}\nstatus=200 path=/ok"=' and got["status"] == "404", line

    # non-ASCII, and bytes that are not UTF-8, in a header: escaped, the line stays ASCII
    raw = b"caf\xc3\xa9-\xff-" + surface.encode()
    r = httpx.get(url + "/health", headers={**headers, "X-Request-ID": raw}, timeout=10)
    assert r.status_code == 200
    # the escaped bytes as the marker: a bare "caf" is also in some random hex request id
    (line,) = _access_lines(request.getfixturevalue(surface), f"\\xff-{surface}")
    assert line.isascii() and dict(_parse_plain(line))["request_id"] == f"café-\\xff-{surface}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("surface", SURFACES)
def test_a_request_id_over_the_bound_is_400_never_echoed_or_logged(request, surface):
    url, path, headers = _target(request, surface)
    body = {"service": {"input": "x"}, "broker": {"amount": 1}, "user_app": {"texts": ["x"]}}
    long_id = "L" * 5000
    r = httpx.post(
        url + path, json=body[surface], headers={**headers, "X-Request-ID": long_id}, timeout=10
    )
    assert r.status_code == 400, r.text
    if surface == "service":
        err = r.json()["error"]
        msg = err["message"]
        assert err["code"] == "invalid_request_id" and err["type"] == "invalid_request_error"
    else:
        detail = r.json()["detail"]
        msg = detail["message"] if isinstance(detail, dict) else detail
    assert f"at most {MAX_REQUEST_ID_BYTES} bytes" in msg and "X-Request-ID" in msg, msg
    assert "5000 bytes" in msg and long_id not in r.text
    echoed = r.headers.get("x-request-id", "")
    assert long_id not in echoed
    if surface != "user_app":  # a fresh id stands in for it (the user's app echoes none)
        assert re.fullmatch(r"[0-9a-f]{32}", echoed), echoed
    if surface in LOGGED:
        (line,) = _access_lines(request.getfixturevalue(surface), echoed)
        assert "status=400" in line and "LLLL" not in line

    # the longest id allowed is served and echoed whole
    ok_id = "k" * MAX_REQUEST_ID_BYTES
    r = httpx.post(
        url + path, json=body[surface], headers={**headers, "X-Request-ID": ok_id}, timeout=10
    )
    assert r.status_code in (200, 201), r.text
    assert r.headers["x-request-id"] == ok_id
