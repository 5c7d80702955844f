"""``gpulock loadtest`` against a server that goes away mid-run: connection errors are counted
on their own, rates are over the answered requests only, and the report says the server went
away; 503s report the ``X-Queue-Position`` they carried (issue 10 items 6 and 9)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

ANSWERED = 10


class _Dying(BaseHTTPRequestHandler):
    """Answers the first ANSWERED embeddings requests (the 3rd and 4th with 503 and a queue
    position), then drops every connection without an answer, as a server that died would."""

    protocol_version = "HTTP/1.0"
    count = 0
    lock = threading.Lock()

    def log_message(self, *a):  # quiet
        pass

    def do_GET(self):
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(n))
        with _Dying.lock:
            _Dying.count += 1
            k = _Dying.count
        if k > ANSWERED:
            self.close_connection = True
            self.connection.close()
            return
        if k in (3, 4):
            out = b'{"detail": "busy"}'
            self.send_response(503)
            self.send_header("Retry-After", "2")
            self.send_header("X-Queue-Position", "5" if k == 3 else "9")
        else:
            out = json.dumps({"data": [{"embedding": [0.0]} for _ in body["input"]]}).encode()
            self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


@pytest.mark.timeout(60)
def test_loadtest_counts_connection_errors_apart_and_says_the_server_went_away():
    srv = HTTPServer(("127.0.0.1", 0), _Dying)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        env = {**os.environ, "COLUMNS": "200"}
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpulock_service",
                "loadtest",
                url,
                "-c",
                "4",
                "-n",
                "40",
                "-b",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=50,
            env=env,
        )
    finally:
        srv.shutdown()
        srv.server_close()
    out = r.stdout
    assert r.returncode == 1, (r.returncode, out, r.stderr)
    assert re.search(r"connection errors\s*│\s*30\b", out), out
    assert "other statuses" not in out, out  # the connection errors are not counted twice
    assert re.search(r"200 OK\s*│\s*8\b", out), out
    assert "went away" in out and f"after {ANSWERED} answers" in out, out
    # the rate is over the answered requests, not over the 40 sent
    assert re.search(r"throughput\s*│\s*[\d.]+ requests/s over the 10 answered", out), out
    assert "X-Queue-Position" in out and "max 9" in out, out


class _NotAService(BaseHTTPRequestHandler):
    """Answers 404 to everything, as the broker (or any other server) does for
    ``POST /v1/embeddings``."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *a):  # quiet
        pass

    def _404(self):
        n = int(self.headers.get("Content-Length", "0") or 0)
        if n:
            self.rfile.read(n)
        out = b'{"detail": "Not Found"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _404


@pytest.mark.timeout(60)
def test_loadtest_against_something_that_is_not_the_service_says_so_without_nan():
    srv = HTTPServer(("127.0.0.1", 0), _NotAService)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        env = {**os.environ, "COLUMNS": "200"}
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpulock_service",
                "loadtest",
                url,
                "-c",
                "2",
                "-n",
                "6",
                "-b",
                "1",
            ],
            capture_output=True,
            text=True,
            timeout=50,
            env=env,
        )
    finally:
        srv.shutdown()
        srv.server_close()
    out = r.stdout
    assert r.returncode == 1, (r.returncode, out, r.stderr)
    assert "nan" not in out, out
    assert re.search(r"latency of 200s\s*│\s*- \(no 200 answers\)", out), out
    assert re.search(r"other statuses\s*│\s*6 \(404: 6\)", out), out
    assert "404" in out and "/v1/embeddings" in out and "gpulock serve" in out, out
