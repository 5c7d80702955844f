"""gpulock.http.telemetry: what the OTEL_* variables ask for, and the tracer provider it sets
(in subprocesses: a provider is set once per process)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest

from gpulock.errors import InvalidArgument
from gpulock.http.telemetry import exporters


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, ()),
        ({"OTEL_TRACES_EXPORTER": "none"}, ()),
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console",)),
        ({"OTEL_TRACES_EXPORTER": " Console , otlp,console"}, ("console", "otlp")),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ("otlp",)),
        # an explicit none wins over an endpoint (e.g. one set for metrics or logs)
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, ()),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, ()),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "false"}, ("console",)),
    ],
)
def test_what_the_environment_asks_for(env, want):
    assert exporters(env) == want


@pytest.mark.parametrize("value", ["jaeger", "console,zipkin", "otlp_proto_grpc"])
def test_an_unknown_exporter_is_named(value):
    with pytest.raises(InvalidArgument, match=r"OTEL_TRACES_EXPORTER=.*unknown exporter"):
        exporters({"OTEL_TRACES_EXPORTER": value})
    # also when the SDK is disabled: the value is wrong all the same
    with pytest.raises(InvalidArgument):
        exporters({"OTEL_TRACES_EXPORTER": value, "OTEL_SDK_DISABLED": "true"})


_SCRIPT = """
import sys
from gpulock.http import telemetry
from gpulock_common import tracing
on = telemetry.configure_from_env("gpulock-serve")
with tracing.span(tracing.ACQUIRE, {tracing.POOL: "p"}):
    pass
telemetry.shutdown()
print("configured" if on else "off", file=sys.stderr)
"""


def _run(**env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_console_from_the_environment_prints_each_span_as_json():
    r = _run(OTEL_TRACES_EXPORTER="console", OTEL_RESOURCE_ATTRIBUTES="team=ml,region=eu")
    assert r.returncode == 0 and r.stderr == "configured\n", r.stderr
    s = json.loads(r.stdout)
    assert s["name"] == "gpulock.acquire"
    assert s["attributes"] == {"gpulock.pool": "p"}
    res = s["resource"]["attributes"]
    assert res["service.name"] == "gpulock-serve"  # the default the command gives
    assert res["team"] == "ml" and res["region"] == "eu"


def test_otel_service_name_wins_over_the_default():
    r = _run(OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="embedder-eu")
    assert json.loads(r.stdout)["resource"]["attributes"]["service.name"] == "embedder-eu"


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"OTEL_TRACES_EXPORTER": "none"},
        {"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"},
    ],
)
def test_nothing_is_set_when_nothing_is_asked(env):
    r = _run(**env)
    assert r.returncode == 0 and r.stderr == "off\n" and r.stdout == "", r.stderr


def test_an_otlp_endpoint_alone_sends_to_the_collector():
    got: list[tuple[str, str]] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.path, self.headers["Content-Type"]))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        r = _run(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{srv.server_port}")
    finally:
        srv.shutdown()
    assert r.returncode == 0 and r.stderr == "configured\n", r.stderr
    assert r.stdout == ""
    # shutdown() flushed the batch: one OTLP/HTTP protobuf export on the standard path
    assert got == [("/v1/traces", "application/x-protobuf")]
