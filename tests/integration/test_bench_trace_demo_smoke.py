"""Smoke test of ``benchmarks/trace_demo.py --quick``: it starts ``gpulock serve`` (the sleep
model, its embedded Redis, the console exporter), queues a traced request behind one that holds
the only lease that fits (sent once ``gpulock status`` shows that lease: ordered by observed
state, and retried with a longer hold by the script itself should the holder end first), and
renders the traced request's spans as a tree. The trace has the request's server span, a child
of the caller's ``traceparent``, with the core's ``gpulock.acquire`` (queued: position >= 1,
granted) and the integration's ``gpulock.call`` below it, under the same lease; the tree shows
them. No timing assertions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from trace_demo import ROUTE, descendants  # noqa: E402

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.instrumentation.fastapi")


@pytest.mark.timeout(300)
def test_trace_demo_quick(tmp_path: Path) -> None:
    out, text = tmp_path / "trace.json", tmp_path / "tree.txt"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "trace_demo.py"), "--quick"]
        + ["--json", str(out), "--text", str(text)],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-3000:]}"
    R = json.loads(out.read_text())
    spans = R["spans"]
    assert spans and all(s["context"]["trace_id"] == f"0x{R['trace_id']}" for s in spans)
    [req] = [s for s in spans if s["parent_id"] == f"0x{R['parent_span_id']}"]
    assert req["name"] == ROUTE and req["kind"] == "SpanKind.SERVER"
    below = descendants(spans, req["context"]["span_id"])
    [acq] = [s for s in below if s["name"] == "gpulock.acquire"]
    [call] = [s for s in below if s["name"] == "gpulock.call"]
    a = acq["attributes"]
    assert a["gpulock.queue.position"] >= 1 and a["gpulock.outcome"] == "granted", a
    assert a["gpulock.queue.wait_s"] > 0 and a["gpulock.amount_bytes"] == 256 << 20, a
    assert call["attributes"]["gpulock.lease.id"] == a["gpulock.lease.id"]
    assert "gpulock.queued" in [e["name"] for e in acq["events"]]
    tree = text.read_text()
    assert tree == R["tree"] + "\n" and tree in p.stdout
    for line in (f"└── {ROUTE} [SERVER]", "├── gpulock.acquire", "gpulock.call"):
        assert line in tree, tree
    assert f"gpulock.queue.position={a['gpulock.queue.position']}" in tree, tree
