"""OpenTelemetry tracing: the span and attribute names every gpulock surface uses, and the
few calls they make, costing nothing when OpenTelemetry is absent or unconfigured.

The OpenTelemetry API (``opentelemetry-api``) is optional. Without it every helper here is a
no-op: :func:`span` yields None, :func:`inject` adds no header, :func:`extract` returns None.
With it but without an SDK configured (no ``TracerProvider`` set, the API's default) the
tracer's spans are non-recording and the helpers skip building attributes
(:func:`recording`). What configures an SDK is the application's business (or ``gpulock
serve``/``gpulock broker`` from the standard ``OTEL_*`` variables: :mod:`gpulock.http.telemetry`).

The calls (every surface's; :mod:`gpulock_common.traces` builds the acquire and lease spans
the core and the SDK share from them):

* :func:`recording` (callers build nothing unless it is True), :func:`tracer`;
* :func:`span`: a span current for a block (a request's, a call's);
* :func:`start_span` (not made current, for a span that outlives its block; the parent from
  :func:`current_context`, none from :func:`root_context`), :func:`use` (such a span current
  for a block), :func:`event`, :func:`end` (its final attributes, an error status:
  :func:`mark_error`, :func:`record_error`);
* :func:`annotate`: attributes on the current span (a server's request span);
  :func:`current_span` (the span to link to later), :func:`span_ids` (a span's ids as text);
* :func:`inject` / :func:`extract`: the W3C ``traceparent`` across HTTP.

Names (one place; docs/TRACING.md shows a trace):

* spans: :data:`ACQUIRE` (the wait for a lease: queue position on entry, priority, tenant,
  device, the outcome), :data:`HOLD` (a lease from grant to release; renewals are events on
  it), :data:`CALL` (one model call under a lease), :data:`BATCH` (one batched model call,
  linked to each request's span), :data:`RESIZE` (a lease's resize), :data:`ADMISSION` (a
  guarded call's wait for one of its worker's thread slots);
* events: :data:`EVENT_RENEW`, :data:`EVENT_RESIZE`, :data:`EVENT_LOST`, :data:`EVENT_QUEUED`,
  :data:`EVENT_BATCHED`, :data:`EVENT_OOM`;
* attributes: the ``gpulock.*`` constants below; generation endpoints add OpenTelemetry's
  ``gen_ai.*`` semantic conventions (:data:`GEN_AI_REQUEST_MODEL` and the others).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from typing import Any

try:  # the API is optional: absent, every helper below is a no-op
    from opentelemetry import context as _context
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
except ImportError:  # pragma: no cover - exercised by the no-OpenTelemetry test in a subprocess
    _trace = None  # type: ignore[assignment]
    _context = None  # type: ignore[assignment]
    _propagate = None  # type: ignore[assignment]

__all__ = [
    "ACQUIRE",
    "ADMISSION",
    "AMOUNT",
    "BATCH",
    "BATCH_REASON",
    "BATCH_SIZE",
    "BATCH_SPAN_ID",
    "BATCH_TRACE_ID",
    "CALL",
    "DEVICE",
    "ENABLED",
    "ERROR_CODE",
    "ESTIMATED_WAIT",
    "EXPIRES_AT",
    "EVENT_LOST",
    "EVENT_BATCHED",
    "EVENT_OOM",
    "EVENT_QUEUED",
    "EVENT_RENEW",
    "EVENT_RESIZE",
    "FENCING_TOKEN",
    "GEN_AI_OPERATION",
    "GEN_AI_REQUEST_MAX_TOKENS",
    "GEN_AI_REQUEST_MODEL",
    "GEN_AI_RESPONSE_FINISH_REASONS",
    "GEN_AI_SYSTEM",
    "GEN_AI_USAGE_INPUT_TOKENS",
    "GEN_AI_USAGE_OUTPUT_TOKENS",
    "HOLD",
    "LEASE_ID",
    "LOCAL_POSITION",
    "LOCAL_WAIT",
    "OOM_RETRIED",
    "OUTCOME",
    "POOL",
    "POSITION",
    "PRIORITY",
    "RESIZE",
    "RESIZE_FROM",
    "RESIZE_TO",
    "TENANT",
    "ROUTE",
    "TRACER_NAME",
    "WAIT",
    "annotate",
    "current_context",
    "current_span",
    "end",
    "event",
    "extract",
    "inject",
    "mark_error",
    "record_error",
    "recording",
    "root_context",
    "span",
    "span_ids",
    "start_span",
    "tracer",
    "use",
]

ENABLED = _trace is not None
"""Whether the OpenTelemetry API is importable (it says nothing of whether an SDK is set)."""

TRACER_NAME = "gpulock"
"""The instrumentation scope of every gpulock span."""

# ---- span names -----------------------------------------------------------------------------
ACQUIRE = "gpulock.acquire"
HOLD = "gpulock.lease"
CALL = "gpulock.call"
BATCH = "gpulock.batch"
RESIZE = "gpulock.resize"
ADMISSION = "gpulock.admission"
"""A guarded call's wait for one of its worker's thread slots (``gpulock.fastapi``), before
its :data:`ACQUIRE`: :data:`LOCAL_POSITION`, :data:`LOCAL_WAIT`, :data:`OUTCOME`."""

# ---- event names ----------------------------------------------------------------------------
EVENT_QUEUED = "gpulock.queued"
EVENT_RENEW = "gpulock.renew"
EVENT_RESIZE = "gpulock.resize"
EVENT_LOST = "gpulock.lost"
EVENT_BATCHED = "gpulock.batched"
"""On a request's span when its batch closes: :data:`BATCH_TRACE_ID`, :data:`BATCH_SPAN_ID`,
:data:`BATCH_SIZE` (the :data:`BATCH` span links back to the request)."""
EVENT_OOM = "gpulock.oom"
"""On a :data:`CALL` span for each CUDA out-of-memory error of its work: :data:`OOM_RETRIED`
(and for a batch the :data:`BATCH_SIZE` of the part that ran out)."""

# ---- attribute names ------------------------------------------------------------------------
POOL = "gpulock.pool"
AMOUNT = "gpulock.amount_bytes"
PRIORITY = "gpulock.priority"
TENANT = "gpulock.tenant"
DEVICE = "gpulock.device"
POSITION = "gpulock.queue.position"
"""1-based place in the pool's queue on entry (0: granted without queueing)."""
WAIT = "gpulock.queue.wait_s"
"""Seconds from the request to its grant (or to its refusal)."""
ESTIMATED_WAIT = "gpulock.queue.estimated_wait_s"
"""The pool's estimate of the wait on entry, seconds (absent when none was measured)."""
OUTCOME = "gpulock.outcome"
"""A request's: ``granted``, ``timeout``, ``cancelled`` or ``refused`` (then :data:`ERROR_CODE`
says why); on the broker's request span also ``queued`` (answered 503, the place kept for a
retry) and ``busy`` (not available, ``queue=false``); a lease's (:data:`HOLD`): ``released`` or
``lost``."""
ERROR_CODE = "gpulock.error.code"
"""The wire code of the error that ended a request (``capacity_exceeded``, ...)."""
LEASE_ID = "gpulock.lease.id"
FENCING_TOKEN = "gpulock.lease.fencing_token"
EXPIRES_AT = "gpulock.lease.expires_at"
"""The lease's expiry after a grant or renewal: a Unix timestamp, seconds, on the server's clock."""
RESIZE_FROM = "gpulock.resize.from_bytes"
"""A resize's amount before, bytes."""
RESIZE_TO = "gpulock.resize.to_bytes"
"""A resize's amount asked, bytes."""
BATCH_SIZE = "gpulock.batch.size"
BATCH_REASON = "gpulock.batch.reason"
"""Why a batch closed: ``full``, ``timeout``, ``room`` or ``idle``."""
BATCH_TRACE_ID = "gpulock.batch.trace_id"
BATCH_SPAN_ID = "gpulock.batch.span_id"
"""The :data:`BATCH` span's ids, 32 and 16 hex digits (on :data:`EVENT_BATCHED`)."""
ROUTE = "gpulock.route"
"""The ``gpulock.fastapi`` route name a call or batch runs for."""
LOCAL_POSITION = "gpulock.local.position"
"""1-based place among the worker's waiters for a thread slot on entry (0: one was free)."""
LOCAL_WAIT = "gpulock.local.wait_s"
"""Seconds a guarded call waited for one of its worker's thread slots."""
OOM_RETRIED = "gpulock.oom.retried"
"""Whether the work that ran out of memory is retried under the same lease (a batch's
halves) rather than ending in an error."""

# OpenTelemetry's generative-AI semantic conventions, for the generation endpoints.
GEN_AI_SYSTEM = "gen_ai.system"
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"


def tracer() -> Any:
    """The ``gpulock`` tracer of the global tracer provider, or None without the API. Kept
    while the provider stays the same (an SDK provider's ``get_tracer`` builds a new tracer
    at each call: several µs a span; docs/BENCHMARKS.md, section 14)."""
    global _tracer
    if _trace is None:
        return None
    provider = _trace.get_tracer_provider()
    cached = _tracer
    if cached is None or cached[0] is not provider:
        cached = _tracer = (provider, provider.get_tracer(TRACER_NAME))
    return cached[1]


# (provider, its gpulock tracer): tracer()'s; a tuple, replaced whole, so safe from any thread.
_tracer: tuple[Any, Any] | None = None


def recording() -> bool:
    """Whether a span started now would record: the API is present and a real (SDK) tracer
    provider is set. Callers skip building attributes when it is False."""
    if _trace is None:
        return False
    provider = _trace.get_tracer_provider()
    return not isinstance(provider, (_trace.ProxyTracerProvider, _trace.NoOpTracerProvider))


@contextmanager
def span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: str = "internal",
    links: list[Any] | None = None,
    context: Any = None,
) -> Iterator[Any]:
    """A span named ``name`` as the current span for the block, or None (nothing recorded)
    when tracing is absent or unconfigured. ``attributes``: values of str, bool, int, float
    (None values are left out). ``context``: a parent context (:func:`extract`'s), else the
    current one. ``kind``: ``internal``, ``client`` or ``server``. ``links``: spans (or
    span contexts) to link to, None entries left out. An exception
    leaving the block is recorded on the span and sets its status to error (the API's
    default), then propagates."""
    if not recording():
        yield None
        return
    with tracer().start_as_current_span(
        name,
        context=context,
        attributes=_present(attributes),
        kind=_kind(kind),
        links=_links(links),
    ) as s:
        yield s


def current_context() -> Any:
    """The current OpenTelemetry context (to parent a span started later, elsewhere: pass it
    as :func:`start_span`'s ``context``), or None without the API."""
    if _context is None:
        return None
    return _context.get_current()


def root_context() -> Any:
    """An empty OpenTelemetry context (None without the API): as :func:`start_span`'s
    ``context`` it starts a new trace, whatever span is current; as :func:`use`'s, the block
    sees that span and nothing of the context it ran in."""
    if _context is None:
        return None
    return _context.Context()


def start_span(
    name: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: str = "internal",
    context: Any = None,
    links: list[Any] | None = None,
) -> Any:
    """A span named ``name`` started now and NOT made current (for a span that outlives the
    block that starts it, such as a lease's; :func:`use` makes it current for a block): the
    caller ends it (:func:`end`). None when tracing is absent or unconfigured
    (:func:`recording`). ``attributes``, ``kind`` and ``links``: as :func:`span`'s;
    ``context``: the parent context (:func:`current_context`'s; :func:`root_context` for a
    root span), else the current one."""
    if not recording():
        return None
    return tracer().start_span(
        name,
        context=context,
        attributes=_present(attributes),
        kind=_kind(kind),
        links=_links(links),
    )


@contextmanager
def use(span: Any, context: Any = None) -> Iterator[Any]:
    """``span`` (a :func:`start_span` span; None: nothing) as the current span for the block,
    not ended when the block ends (the caller ends it: :func:`end`), nothing recorded of an
    exception leaving it (the caller records its outcome). ``context``: the context the span
    is set in for the block (:func:`root_context`: nothing else of the current one), else the
    current one."""
    if span is None or _trace is None or _context is None:
        yield span
        return
    token = _context.attach(_trace.set_span_in_context(span, context))
    try:
        yield span
    finally:
        _context.detach(token)


def current_span() -> Any:
    """The current span (to link to later, or add events to), or None when nothing is
    recorded (:func:`recording`) or no span is current."""
    if not recording():
        return None
    cur = _trace.get_current_span()
    return cur if cur.get_span_context().is_valid else None


def span_ids(s: Any) -> tuple[str, str]:
    """``s``'s (a span's) trace id and span id as lower-case hex, 32 and 16 digits (as the
    W3C ``traceparent`` and the exporters write them)."""
    assert _trace is not None
    ctx = s.get_span_context()
    return _trace.format_trace_id(ctx.trace_id), _trace.format_span_id(ctx.span_id)


def mark_error(span: Any, description: str) -> None:
    """Set ``span``'s status to error with ``description`` (nothing for a None span)."""
    if span is not None and _trace is not None:
        span.set_status(_trace.StatusCode.ERROR, description)


def record_error(span: Any, error: BaseException) -> None:
    """Record ``error`` on ``span`` (the API's ``exception`` event: its type, message and
    traceback) and set the span's status to error with its message, cut to 200 characters
    (nothing for a None span)."""
    if span is not None:
        span.record_exception(error)
        mark_error(span, str(error)[:200])


def inject(headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Add the current context's W3C ``traceparent`` (and ``tracestate``) to ``headers``
    (unchanged without the API or without a current span); returns ``headers``."""
    if _propagate is not None:
        _propagate.inject(headers)
    return headers


def extract(headers: Mapping[str, str]) -> Any:
    """The OpenTelemetry context carried by ``headers``' ``traceparent``, or None without the
    API. Pass it as ``context=`` to a tracer's ``start_as_current_span``, or attach it."""
    if _propagate is None:
        return None
    return _propagate.extract(dict(headers))


def annotate(attributes: Mapping[str, Any]) -> None:
    """Set ``attributes`` (None values left out) on the current span, e.g. a request's server
    span; nothing when it does not record."""
    if _trace is None:
        return
    cur = _trace.get_current_span()
    if cur.is_recording():
        cur.set_attributes(_present(attributes))


def event(s: Any, name: str, attributes: Mapping[str, Any] | None = None) -> None:
    """Add the event ``name`` (``attributes``, None values left out) to ``s`` (a span; nothing
    for None or an ended one)."""
    if s is not None and s.is_recording():
        s.add_event(name, _present(attributes))


def end(s: Any, attributes: Mapping[str, Any] | None = None, *, error: str | None = None) -> None:
    """Set ``attributes`` (None values left out) on ``s`` (a span; nothing for None), with
    ``error`` its status is error with that description (:func:`mark_error`), and end it; a
    second call does nothing."""
    if s is not None and s.is_recording():
        s.set_attributes(_present(attributes))
        if error is not None:
            mark_error(s, error)
        s.end()


def _present(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """``attributes`` without its None values (OpenTelemetry refuses None)."""
    return {k: v for k, v in (attributes or {}).items() if v is not None}


def _links(links: list[Any] | None) -> list[Any] | None:
    """The API's ``Link`` to each of ``links`` (spans or span contexts; None entries left
    out), or None for none given."""
    if links is None:
        return None
    assert _trace is not None
    return [
        _trace.Link(x if isinstance(x, _trace.SpanContext) else x.get_span_context())
        for x in links
        if x is not None
    ]


def _kind(kind: str) -> Any:
    """The API's ``SpanKind`` named ``kind``: ``internal``, ``client`` or ``server``."""
    assert _trace is not None
    return {
        "internal": _trace.SpanKind.INTERNAL,
        "client": _trace.SpanKind.CLIENT,
        "server": _trace.SpanKind.SERVER,
    }[kind]
