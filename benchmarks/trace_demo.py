#!/usr/bin/env python
"""A trace of one queued request, end to end, from the console exporter of ``gpulock serve``.

    python benchmarks/trace_demo.py                # the tree on stdout (about 6 s)
    python benchmarks/trace_demo.py --quick --json out.json --text tree.txt

What it does, as a user would: starts ``gpulock serve --model sleep -w 1 --data-dir none``
(its embedded Redis on a free loopback port) with ``OTEL_TRACES_EXPORTER=console``, a capacity
of 384 MiB and requests of 256 MiB (``GPULOCK_SLEEP_BYTES``; no resident lease, no batching),
so one lease fits and a second request must queue behind the first. It sends the first request
(``"sleep:HOLD"``: its work runs HOLD seconds), waits until ``gpulock status gpu0 --json`` shows
its lease (observed state, not a sleep), sends the second with a ``traceparent`` of its own,
collects the spans of that trace from the service's stdout once the request's server span is
there, and prints them as an indented tree: each span's name, offset from the request's start
and duration in ms, and its key attributes (``gpulock.queue.position``,
``gpulock.queue.wait_s``, ``gpulock.outcome``, the lease's id and token, the amount), with its
events. Should the first request's work end before the second reached the pool's queue (a
machine stalled for seconds), the pair is sent again with HOLD doubled (at most 5 tries, each
said on stderr), so the tree shown is always of a request that queued (position >= 1).

``--json PATH``: the trace's spans as the exporter printed them, the tree's text and the run's
facts (date, hold, tries). ``--text PATH``: the tree alone. Exit 1 if no try queued.

A demonstration, not a benchmark (docs/TRACING.md, "A queued request's trace", shows its
output; tests/integration/test_bench_trace_demo_smoke.py runs ``--quick``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _console_spans import console_spans  # noqa: E402

ROUTE = "POST /v1/embeddings"
MIB = 1 << 20
TRIES = 5  # pairs sent at most, the hold doubled each time (1 s to 16 s with --quick)

# (attribute, label) shown on a span's line, in this order; other attributes are left out.
SHOWN = (
    ("http.status_code", "http.status_code"),
    ("gpulock.local.position", "gpulock.local.position"),
    ("gpulock.local.wait_s", "gpulock.local.wait_s"),
    ("gpulock.queue.position", "gpulock.queue.position"),
    ("gpulock.queue.wait_s", "gpulock.queue.wait_s"),
    ("gpulock.outcome", "gpulock.outcome"),
    ("gpulock.amount_bytes", "gpulock.amount_bytes"),
    ("gpulock.lease.id", "gpulock.lease.id"),
    ("gpulock.lease.fencing_token", "gpulock.lease.fencing_token"),
)


def _t(stamp: str) -> float:
    """A console exporter timestamp (ISO 8601, UTC, ``Z``) as Unix seconds."""
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _value(key: str, v: Any) -> str:
    if key.endswith("_s") and isinstance(v, float):
        return f"{v:.3f}"
    if key == "gpulock.amount_bytes" and isinstance(v, int):
        return f"{v} ({v / MIB:g} MiB)"
    return str(v)


def render(spans: list[dict[str, Any]], trace_id: str, parent_id: str) -> str:
    """The spans of trace ``trace_id`` (32 hex digits) as an indented tree under the caller's
    span ``parent_id`` (16 hex digits, not exported): per span its name, its start's offset
    from the first span's start and its duration (ms), the :data:`SHOWN` attributes present,
    then its events (offset from the span's start, ms, and their attributes). Children are
    ordered by start."""
    mine = [s for s in spans if s["context"]["trace_id"] == f"0x{trace_id}"]
    kids: dict[str, list[dict[str, Any]]] = {}
    for s in mine:
        kids.setdefault(s["parent_id"] or "", []).append(s)
    t0 = min((_t(s["start_time"]) for s in mine), default=0.0)
    lines = [f"caller's span (traceparent 00-{trace_id}-{parent_id}-01; not exported)"]

    def walk(parent: str, prefix: str) -> None:
        children = sorted(kids.get(parent, []), key=lambda s: s["start_time"])
        for n, s in enumerate(children):
            last = n == len(children) - 1
            start, end = _t(s["start_time"]), _t(s["end_time"])
            attrs = s["attributes"]
            shown = [f"{label}={_value(k, attrs[k])}" for k, label in SHOWN if k in attrs]
            kind = s["kind"].removeprefix("SpanKind.")
            head = (
                f"{s['name']} [{kind}]  +{(start - t0) * 1e3:.1f} ms, {(end - start) * 1e3:.1f} ms"
            )
            lines.append(prefix + ("└── " if last else "├── ") + head)
            more = prefix + ("    " if last else "│   ")
            for a in shown:
                lines.append(more + "    " + a)
            for e in s["events"]:
                ev = ", ".join(f"{k}={_value(k, v)}" for k, v in e["attributes"].items())
                at = (_t(e["timestamp"]) - start) * 1e3
                lines.append(
                    more + f"    event {e['name']} at +{at:.1f} ms" + (f": {ev}" if ev else "")
                )
            walk(s["context"]["span_id"], more)

    walk(f"0x{parent_id}", "")
    return "\n".join(lines)


def descendants(spans: list[dict[str, Any]], root_span_id: str) -> list[dict[str, Any]]:
    """The spans below the span whose ``context.span_id`` is ``root_span_id`` (``0x...``)."""
    out, todo = [], [root_span_id]
    while todo:
        p = todo.pop()
        for s in spans:
            if s["parent_id"] == p:
                out.append(s)
                todo.append(s["context"]["span_id"])
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """``gpulock serve`` (this interpreter's) on a free port, stdout (the spans) and stderr
    (its banner, the access log) in files under ``tmp``; :meth:`stop` ends it."""

    def __init__(self, tmp: Path, seconds: float):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out, self.err = tmp / "serve.out", tmp / "serve.err"
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("GPULOCK_", "OTEL_")) and k != "PROMETHEUS_MULTIPROC_DIR"
        }
        env.update(
            GPULOCK_BATCH="false",  # two requests of one worker: one lease each, not a batch
            GPULOCK_RESIDENT="0",  # the only leases are the requests'
            GPULOCK_SLEEP_BYTES="256MiB",
            GPULOCK_SLEEP_SECONDS=str(seconds),
            OTEL_TRACES_EXPORTER="console",
            PYTHONUNBUFFERED="1",
        )
        argv = [sys.executable, "-m", "gpulock", "serve", "--model", "sleep", "-w", "1"]
        argv += ["--port", str(self.port), "--capacity", "384MiB", "--data-dir", "none"]
        argv += ["--log-level", "warning"]
        self.env = env
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=err, start_new_session=True
            )

    def wait_ready(self, timeout: float) -> str:
        """Wait until ``/ready`` answers 200; the Redis URL serve printed. Raises
        RuntimeError (with serve's stderr) if it exits or is not ready in ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gpulock serve exited:\n{self.err.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    m = re.search(r"export GPULOCK_REDIS_URL=(\S+)", self.err.read_text())
                    if m:
                        return m.group(1)
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(
            f"gpulock serve not ready in {timeout}s:\n{self.err.read_text()[-3000:]}"
        )

    def spans(self) -> list[dict[str, Any]]:
        return console_spans(self.out.read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def leases(redis_url: str) -> int:
    """The leases of pool ``gpu0`` as ``gpulock status gpu0 --json`` shows them."""
    env = {**os.environ, "GPULOCK_REDIS_URL": redis_url}
    argv = [sys.executable, "-m", "gpulock", "status", "gpu0", "--json"]
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=True)
    return len(json.loads(p.stdout)["leases"])


def one_pair(serve: Serve, redis_url: str, hold: float) -> tuple[str, str, dict[str, Any]] | None:
    """Send the holder (its work ``hold`` s), wait for its lease, send the traced request;
    its (trace id, parent span id, its server span) once that span was exported. None when
    the holder was answered before its lease was seen (try again with a longer hold)."""
    first: dict[str, Any] = {}
    deadline = time.monotonic() + 60
    while leases(redis_url) > 0:  # a lease of the try before, not yet released
        if time.monotonic() > deadline:
            raise RuntimeError("the pool kept a lease for 60 s")
        time.sleep(0.05)

    def holder() -> None:
        r = httpx.post(serve.url + "/v1/embeddings", json={"input": [f"sleep:{hold}"]}, timeout=120)
        first["status"] = r.status_code

    t = threading.Thread(target=holder, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while leases(redis_url) < 1:
        if "status" in first:
            t.join()
            return None
        if time.monotonic() > deadline:
            raise RuntimeError("the first request's lease was not seen in 60 s")
        time.sleep(0.05)
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    r = httpx.post(
        serve.url + "/v1/embeddings",
        json={"input": ["the queued request"]},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
        timeout=120,
    )
    r.raise_for_status()
    t.join(120)
    # the server span ends (and is printed) just after the response: wait until it is there
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for s in serve.spans():
            if s["context"]["trace_id"] == f"0x{trace_id}" and s["parent_id"] == f"0x{parent_id}":
                return trace_id, parent_id, s
        time.sleep(0.05)
    raise RuntimeError("the request's server span was not exported in 60 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a shorter hold (the smoke test's)")
    ap.add_argument("--json", type=Path, help="write the trace's spans, the tree and the facts")
    ap.add_argument("--text", type=Path, help="write the tree alone")
    args = ap.parse_args()
    hold, work = (1.0, 0.1) if args.quick else (2.0, 0.5)
    with tempfile.TemporaryDirectory(prefix="gpulock-trace-demo-") as tmp:
        serve = Serve(Path(tmp), work)
        try:
            redis_url = serve.wait_ready(60)
            for attempt in range(1, TRIES + 1):
                got = one_pair(serve, redis_url, hold)
                if got is None:
                    print(
                        f"try {attempt}: the first request ended before its lease was seen; hold {hold * 2:g}s",
                        file=sys.stderr,
                    )
                    hold *= 2
                    continue
                trace_id, parent_id, req = got
                spans = [s for s in serve.spans() if s["context"]["trace_id"] == f"0x{trace_id}"]
                below = descendants(spans, req["context"]["span_id"])
                queued = [
                    s
                    for s in below
                    if s["name"] == "gpulock.acquire"
                    and s["attributes"].get("gpulock.queue.position", 0) >= 1
                ]
                if queued:
                    break
                print(
                    f"try {attempt}: the first request ended before the second queued; hold {hold * 2:g}s",
                    file=sys.stderr,
                )
                hold *= 2
            else:
                print("no try queued", file=sys.stderr)
                return 1
        finally:
            serve.stop()
    tree = render(spans, trace_id, parent_id)
    when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(
        f"# {when}: gpulock serve --model sleep -w 1 --capacity 384MiB, requests of 256 MiB; the first held its lease {hold:g} s"
    )
    print(tree)
    if args.text:
        args.text.write_text(tree + "\n")
    if args.json:
        facts = {"date": when, "hold_s": hold, "tries": attempt, "trace_id": trace_id}
        facts |= {"parent_span_id": parent_id, "tree": tree, "spans": spans}
        args.json.write_text(json.dumps(facts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
