"""Server-sent events as OpenAI's streaming APIs frame them, and OpenAI's error object: the one
place that writes either (the service's error bodies, a guarded stream's events and its
error event; no I/O).

A stream of events is ``data: <JSON>\\n\\n`` per event and, once the stream is complete,
:data:`SSE_DONE` (``data: [DONE]\\n\\n``). A stream that fails after it began (its status and
headers already sent) ends with an ``event: error`` event whose data is an error object
(:func:`error_body`) and no ``[DONE]``; the ``openai`` SDK raises ``APIError`` with its message
for it.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["SSE_DONE", "error_body", "error_type", "sse_event"]

#: The last event of a stream that completed (OpenAI's end marker).
SSE_DONE = b"data: [DONE]\n\n"


def error_type(status: int) -> str:
    """OpenAI's ``type`` for an HTTP status: ``server_error`` for 5xx, ``authentication_error``
    for 401, ``permission_error`` for 403, else ``invalid_request_error``."""
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 403: "permission_error"}.get(
        status, "invalid_request_error"
    )


def error_body(
    status: int, message: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object for ``status``: ``{"error": {"message", "type", "param", "code"}}``
    (``type`` from :func:`error_type`; ``code`` gpulock's reason, e.g. ``lease_lost``; ``param``
    the request field at fault; None for none)."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def sse_event(data: Any, *, event: str | None = None) -> bytes:
    """One server-sent event, UTF-8: an optional ``event: <event>`` line, then ``data`` as
    ``data:`` lines and a blank line. ``data``: a str is sent as it is (one ``data:`` line per
    line of it); a pydantic model as its JSON (``model_dump_json``, unset fields left out is
    the caller's choice: dump it first to choose); anything else as compact JSON
    (``json.dumps``, non-ASCII kept).

    Raises: ValueError for an ``event`` name holding a line break; TypeError for data that
    JSON cannot encode."""
    if isinstance(data, str):
        text = data
    elif hasattr(data, "model_dump_json"):
        text = data.model_dump_json()
    else:
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = ""
    if event is not None:
        if "\n" in event or "\r" in event:
            raise ValueError(f"an SSE event name is one line; got {event!r:.80}")
        head = f"event: {event}\n"
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return (head + "".join(f"data: {line}\n" for line in lines) + "\n").encode()
