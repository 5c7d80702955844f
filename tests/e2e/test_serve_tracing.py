"""``gpulock serve`` traced through the ``OTEL_*`` variables alone: two gunicorn workers forked
from a master that loaded the app (``--preload``), each sets its own tracer provider (the
console exporter) and answers every request in the caller's trace (its ``traceparent``);
the probes and scrapes (/health, /ready, /metrics) have no spans; the service name defaults to
``gpulock-serve`` and ``OTEL_RESOURCE_ATTRIBUTES`` is honoured."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.ports import free_port
from support.procs import _LIVE
from support.serve import serve_env, start_serve, wait_workers_ready

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _console_spans import console_spans  # noqa: E402

ROUTE = "POST /v1/embeddings"


@pytest.mark.timeout(240)
def test_each_serve_worker_traces_its_requests_in_the_callers_trace(tmp_path):
    port = free_port()
    env = serve_env(
        GPULOCK_SLEEP_SECONDS="0.01",
        GPULOCK_SLEEP_BYTES="16MiB",
        OTEL_TRACES_EXPORTER="console",
        OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test",
    )
    log = tmp_path / "serve.log"
    args = ["--model", "sleep", "-w", "2", "--port", str(port), "--capacity", "1GiB", "--preload"]
    proc = start_serve(log, env, *args)
    url = f"http://127.0.0.1:{port}"
    sent: dict[str, tuple[str, str]] = {}  # trace id -> (parent span id, worker pid)
    try:
        wait_workers_ready(proc, url, 2, log, 120)
        assert httpx.get(url + "/ready", timeout=5).status_code == 200, log.read_text()[-3000:]
        httpx.get(url + "/health", timeout=5)

        # requests, each in a trace of its own, until both workers answered some
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len({w for _, w in sent.values()}) < 2:
            trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
            r = httpx.post(
                url + "/v1/embeddings",
                json={"input": ["hello"]},
                headers={"traceparent": f"00-{trace_id}-{span_id}-01"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
            sent[trace_id] = (span_id, r.headers["x-worker-pid"])
        assert len({w for _, w in sent.values()}) == 2, sent

        # each span is printed as its request ends: wait until every request's is there
        def mine() -> dict[str, dict]:
            return {
                s["context"]["trace_id"][2:]: s
                for s in console_spans(log.read_text(errors="replace"))
                if s["name"] == ROUTE
            }

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not set(sent) <= set(mine()):
            time.sleep(0.1)
        spans = mine()
        assert set(sent) <= set(spans), log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        _LIVE.discard(proc.pid)
    for trace_id, (span_id, _) in sent.items():
        s = spans[trace_id]
        assert s["parent_id"] == f"0x{span_id}"
        assert s["kind"] == "SpanKind.SERVER"
        assert s["resource"]["attributes"]["service.name"] == "gpulock-serve"
        assert s["resource"]["attributes"]["deployment.environment"] == "test"
    every = console_spans(log.read_text(errors="replace"))
    probes = [s["name"] for s in every if re.search(r"/(health|ready|metrics)\b", s["name"])]
    assert probes == []
