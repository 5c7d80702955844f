"""One guarded call's job: what the job runner (``_jobs.py``), the request store
(``_idempotency.py``) and the Retry-After estimate (``_retry_after.py``) know of it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from gpulock.http.places import KeptPlace


@dataclass(eq=False)
class Job:
    """One guarded call's job (times in ``time.monotonic()`` seconds)."""

    route: str
    amount: int
    ticket: str | None
    fingerprint: str
    arrival: float
    phase: str = "slot"  # slot → queued → running → done
    position: int = 0  # place in the pool's queue while queued (0: unknown)
    # the server's estimate of the seconds until its grant, as its place was last reported
    # (QueuePlace.estimated_wait; None: not known, or no drain rate yet)
    estimated_wait: float | None = None
    slot_future: asyncio.Future[None] | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)  # set when running or done
    queued: asyncio.Event = field(default_factory=asyncio.Event)  # set once in the pool's queue
    task: asyncio.Task[Any] | None = None
    wait_s: float | None = None
    run_s: float | None = None
    server_retry_after: float | None = None
    parked: bool = False  # it keeps its place across 503s (X-Request-ID and park_timeout > 0)
    # HTTP requests waiting on it now (a retry with the same X-Request-ID joins), and for a
    # parked job until when its place is kept (monotonic; see gpulock.http.places)
    place: KeptPlace = field(default_factory=KeptPlace)
    abandoned: bool = False  # the HTTP side gave up on it (503 without parking, client gone)
    # Result or error, set as soon as known: the response goes out while the release (one more
    # Redis round trip, after the thread returned) is still on its way.
    outcome: asyncio.Future[Any] | None = None
    # The shape bucket whose estimate the job's amount came from (None: not from
    # GpuLimiter.estimate), and the OOMs its work handled itself (note_oom).
    bucket: str | None = None
    ooms: int = 0
    # Bytes of the lease granted (the estimate, raised by the OOM back-off's factor); None
    # until granted.
    leased: int | None = None
    # The priority it queues with (the route's, or its request's header: _priority), for
    # this worker's thread slots and the pool's queue.
    priority: int = 0
    # Whether the pool may ask its lease to yield to a higher-priority request (preemption:
    # the route's ``preemptible=``; docs/SERVICE.md, "Preemption").
    preemptible: bool = False
    # Its OpenTelemetry span gpulock.call while its work runs (None: not traced; _tracing).
    span: Any = None
