"""``gpulock loadtest``: real sentences at a fixed concurrency against ``POST /v1/embeddings``.

Each request carries ``--batch`` sentences drawn from a shipped list of varied English
sentences (``data/sentences.txt``). A 503 is retried up to ``--retries`` times after its
``Retry-After`` (times a random jitter factor in [1, 1.5), so that clients told the same
number do not come back at the same instant), with the same ``X-Request-ID``. While it runs, a
poller reads ``/metrics`` four times a second for the pool's gauges (read from Redis by the
service), to report the peak leases and bytes against the capacity.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
import uuid
from dataclasses import dataclass, field
from importlib import resources

from gpulock_common.aio import wait_for


def sentences() -> list[str]:
    text = (
        resources.files("gpulock_service")
        .joinpath("data/sentences.txt")
        .read_text(encoding="utf-8")
    )
    return [s.strip() for s in text.splitlines() if s.strip()]


@dataclass
class Outcome:
    status: int  # final HTTP status (0: connection error / client timeout)
    latency_s: float  # first send to final answer, retries included
    attempts: int
    responses: list[tuple[int, str | None, str | None]] = field(
        default_factory=list
    )  # (status, Retry-After, X-Queue-Position)
    error: str = ""
    done_at: float = 0.0  # perf_counter when it ended (answer or error)


@dataclass
class PoolPeaks:
    capacity: float = 0.0
    used: float = 0.0
    leases: float = 0.0
    waiters: float = 0.0
    baseline_leases: float | None = None
    baseline_used: float | None = None
    samples: int = 0


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def _poll_metrics(client, peaks: PoolPeaks, stop: asyncio.Event) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    while not stop.is_set():
        try:
            r = await client.get("/metrics", timeout=2.0)
            vals: dict[str, float] = {}
            for fam in text_string_to_metric_families(r.text):
                if fam.name in (
                    "gpulock_pool_capacity_bytes",
                    "gpulock_pool_used_bytes",
                    "gpulock_pool_leases",
                    "gpulock_pool_waiters",
                ):
                    for s in fam.samples:
                        vals[fam.name] = s.value
            if vals:
                peaks.samples += 1
                peaks.capacity = vals.get("gpulock_pool_capacity_bytes", peaks.capacity)
                if peaks.baseline_leases is None:
                    peaks.baseline_leases = vals.get("gpulock_pool_leases", 0.0)
                    peaks.baseline_used = vals.get("gpulock_pool_used_bytes", 0.0)
                peaks.used = max(peaks.used, vals.get("gpulock_pool_used_bytes", 0.0))
                peaks.leases = max(peaks.leases, vals.get("gpulock_pool_leases", 0.0))
                peaks.waiters = max(peaks.waiters, vals.get("gpulock_pool_waiters", 0.0))
        except Exception:
            pass
        try:
            await wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:
            pass


async def _served_model(client) -> str | None:
    """The first model ``GET /v1/models`` lists (the service refuses other names with 404), or
    None to leave ``model`` out of the requests."""
    try:
        r = await client.get("/v1/models")
        return str(r.json()["data"][0]["id"]) if r.status_code == 200 else None
    except Exception:  # noqa: BLE001 - an endpoint without /v1/models: send no model
        return None


async def _one(
    client,
    texts: list[str],
    retries: int,
    request_ids: bool,
    rng: random.Random,
    model: str | None = None,
) -> Outcome:
    headers = {"X-Request-ID": f"loadtest-{uuid.uuid4().hex}"} if request_ids else {}
    body: dict = {"input": texts}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    out = Outcome(0, 0.0, 0)
    for attempt in range(retries + 1):
        out.attempts = attempt + 1
        try:
            r = await client.post("/v1/embeddings", json=body, headers=headers)
        except Exception as e:  # noqa: BLE001 — reported in the summary
            out.status, out.error = 0, f"{type(e).__name__}: {e}"
            break
        ra = r.headers.get("retry-after")
        out.responses.append((r.status_code, ra, r.headers.get("x-queue-position")))
        out.status = r.status_code
        if r.status_code != 503 or attempt == retries:
            break
        try:
            wait = float(ra) if ra is not None else 1.0
        except ValueError:
            wait = 1.0
        await asyncio.sleep(wait * rng.uniform(1.0, 1.5))
    out.done_at = time.perf_counter()
    out.latency_s = out.done_at - t0
    return out


async def loadtest(
    url: str,
    *,
    concurrency: int,
    requests: int,
    batch: int,
    retries: int = 0,
    request_ids: bool = True,
    timeout: float = 120.0,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Run the load and return the summary as a dict (see :func:`run_loadtest`)."""
    import httpx

    rng = random.Random(seed)
    pool = sentences()
    limits = httpx.Limits(
        max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2
    )
    outcomes: list[Outcome] = []
    peaks = PoolPeaks()
    async with httpx.AsyncClient(
        base_url=url.rstrip("/"), timeout=timeout, limits=limits
    ) as client:
        model = await _served_model(client)
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_metrics(client, peaks, stop))
        await asyncio.sleep(0.3)  # one baseline sample before the load
        todo = iter(range(requests))
        prog = None
        if progress:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            prog = Progress(
                TextColumn("[bold]loadtest"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
                transient=False,
            )
            task_id = prog.add_task("requests", total=requests, info="")
            prog.start()
        counts: dict[int, int] = {}

        async def worker() -> None:
            for _ in todo:
                texts = [rng.choice(pool) for _ in range(batch)]
                o = await _one(client, texts, retries, request_ids, rng, model)
                outcomes.append(o)
                counts[o.status] = counts.get(o.status, 0) + 1
                if prog is not None:
                    prog.update(
                        task_id,
                        advance=1,
                        info=" ".join(f"{k or 'err'}:{v}" for k, v in sorted(counts.items())),
                    )

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
        if prog is not None:
            prog.stop()
        stop.set()
        await poller

    answers = [resp for o in outcomes for resp in o.responses]
    n503 = [a for a in answers if a[0] == 503]
    lat = [o.latency_s for o in outcomes if o.status == 200]
    answered = [o for o in outcomes if o.status != 0]
    failed = [o for o in outcomes if o.status == 0]
    # Rates are over the requests that got an answer, and over the time until the last answer:
    # requests that failed to connect (a server that went away) are counted apart.
    span = (max(o.done_at for o in answered) - t0) if failed and answered else elapsed
    last = max(outcomes, key=lambda o: o.done_at) if outcomes else None
    positions = [int(a[2]) for a in n503 if a[2] is not None and a[2].isdigit()]
    return {
        "url": url,
        "requests": requests,
        "concurrency": concurrency,
        "batch": batch,
        "elapsed_s": elapsed,
        "ok": sum(1 for o in outcomes if o.status == 200),
        "answered_requests": len(answered),
        "rate_span_s": span,
        "connection_errors": len(failed),
        # the server stopped answering: the run ended on connection errors after answers
        "server_went_away": bool(failed and answered and last is not None and last.status == 0),
        "requests_per_s": len(answered) / span if span > 0 else 0.0,
        "ok_per_s": len(lat) / span if span > 0 else 0.0,
        "sentences_per_s": len(lat) * batch / span if span > 0 else 0.0,
        "queue_positions_503": positions,
        "p50_s": _percentile(lat, 0.50),
        "p95_s": _percentile(lat, 0.95),
        "p99_s": _percentile(lat, 0.99),
        "mean_s": statistics.fmean(lat) if lat else float("nan"),
        "answers_503": len(n503),
        "answers_503_with_retry_after": sum(1 for a in n503 if a[1] is not None),
        "retry_after_values": sorted(
            {a[1] for a in n503 if a[1] is not None}, key=lambda v: float(v)
        ),
        "final_503": sum(1 for o in outcomes if o.status == 503),
        "final_413": sum(1 for o in outcomes if o.status == 413),
        "final_504": sum(1 for o in outcomes if o.status == 504),
        "final_5xx_other": sum(
            1 for o in outcomes if o.status >= 500 and o.status not in (503, 504)
        ),
        # answered with another status (0, no answer, is counted in connection_errors only)
        "final_other": sum(
            1 for o in outcomes if o.status not in (0, 200, 413, 503, 504) and o.status < 500
        ),
        "final_other_by_status": {
            k: sum(1 for o in outcomes if o.status == k)
            for k in sorted(
                {
                    o.status
                    for o in outcomes
                    if o.status not in (0, 200, 413, 503, 504) and o.status < 500
                }
            )
        },
        "retries": sum(o.attempts - 1 for o in outcomes),
        "answered": len(answers),  # HTTP answers of any status (0: nothing reached the service)
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "pool": peaks,
    }


def run_loadtest(url: str, **kw) -> int:
    from rich.console import Console
    from rich.table import Table

    s = asyncio.run(loadtest(url, **kw))
    c = Console()
    if not s["answered"]:
        # Nothing reached the service: a table of rates and percentiles would be nonsense.
        c.print(
            f"[bold red]gpulock loadtest: no request reached {url}[/]: {'; '.join(s['errors'])}"
        )
        return 1
    t = Table(
        title=f"gpulock loadtest {url}: {s['requests']} requests x {s['batch']} sentences, "
        f"concurrency {s['concurrency']}",
        show_header=False,
    )
    t.add_row("elapsed", f"{s['elapsed_s']:.2f} s")
    over = (
        f" over the {s['answered_requests']} answered in the first {s['rate_span_s']:.2f} s"
        if s["connection_errors"]
        else ""
    )
    t.add_row(
        "throughput",
        f"{s['requests_per_s']:.1f} requests/s{over} ({s['ok_per_s']:.1f} ok/s, "
        f"{s['sentences_per_s']:.0f} sentences/s)",
    )
    if s["ok"]:
        t.add_row(
            "latency of 200s",
            f"p50 {s['p50_s'] * 1000:.0f} ms   p95 {s['p95_s'] * 1000:.0f} ms   "
            f"p99 {s['p99_s'] * 1000:.0f} ms",
        )
    else:
        t.add_row("latency of 200s", "- (no 200 answers)")
    t.add_row("200 OK", str(s["ok"]))
    ra = ", ".join(s["retry_after_values"][:8]) or "-"
    qp = s["queue_positions_503"]
    qps = f"X-Queue-Position on {len(qp)}, max {max(qp)}" if qp else "none with X-Queue-Position"
    t.add_row(
        "503 answers",
        f"{s['answers_503']} ({s['answers_503_with_retry_after']} with Retry-After; "
        f"values seen: {ra}; {qps}); {s['retries']} retries; {s['final_503']} requests "
        f"ended on 503",
    )
    t.add_row(
        "413 / 504 / other 5xx", f"{s['final_413']} / {s['final_504']} / {s['final_5xx_other']}"
    )
    if s["final_other"]:
        by = ", ".join(f"{k}: {v}" for k, v in s["final_other_by_status"].items())
        t.add_row("other statuses", f"{s['final_other']} ({by})")
    if s["connection_errors"]:
        t.add_row(
            "connection errors",
            f"{s['connection_errors']} requests got no answer: " + "; ".join(s["errors"]),
        )
    p: PoolPeaks = s["pool"]
    if p.samples:
        from gpulock.units import format_size

        base = int(p.baseline_leases or 0)
        t.add_row(
            "pool peak",
            f"{int(p.leases)} leases ({base} before the load: resident), "
            f"{format_size(int(p.used))} used of {format_size(int(p.capacity))} capacity "
            f"({100 * p.used / p.capacity:.0f}%), {int(p.waiters)} queued at most",
        )
    else:
        t.add_row("pool peak", "no /metrics samples")
    c.print(t)
    if not s["ok"] and not s["answers_503"] and s["final_other_by_status"].get(404):
        c.print(
            f"[bold red]gpulock loadtest: {url} answered 404 to POST /v1/embeddings[/]: it is not the "
            f"service (a gpulock broker, or another server?); point loadtest at `gpulock serve`'s URL"
        )
    if s["server_went_away"]:
        c.print(
            f"[bold red]gpulock loadtest: the server went away[/]: no answer after {s['answered_requests']} "
            f"answers ({s['rate_span_s']:.2f} s into the run); the {s['connection_errors']} requests after that "
            f"got connection errors and are not in the rates above"
        )
    elif s["connection_errors"]:
        c.print(
            f"[bold red]gpulock loadtest: {s['connection_errors']} requests got connection errors[/] "
            f"(not in the rates above)"
        )
    if s["connection_errors"]:
        return 1
    return 0 if s["ok"] or s["answers_503"] else 1
