"""A generation's OpenTelemetry attributes: OpenTelemetry's generative-AI semantic conventions
(``gen_ai.*``, names in :mod:`gpulock_common.tracing`) on the span of the guarded call it runs
in (``gpulock.call``, :func:`gpulock.fastapi.current_call_span`). Nothing is built when that
span is None or not recording (tracing absent or unconfigured)."""

from __future__ import annotations

from typing import Any

from gpulock_common import tracing as tr

__all__ = ["SYSTEM", "note_request", "note_usage"]

#: ``gen_ai.system``: the serving system (the model is ``gen_ai.request.model``)
SYSTEM = "gpulock"

#: the finish reasons a generation ends with (``gen_ai.response.finish_reasons``); an end
#: by other means (the client hung up, an error) records none
_FINISHED = ("stop", "length")


def _recording(span: Any) -> bool:
    return span is not None and span.is_recording()


def note_request(span: Any, *, chat: bool, model: str, max_tokens: int) -> None:
    """The request's attributes on ``span``: ``gen_ai.system`` (:data:`SYSTEM`),
    ``gen_ai.operation.name`` (``chat`` or ``text_completion``), ``gen_ai.request.model``
    (``model``: the name asked for, else the one served), ``gen_ai.request.max_tokens``."""
    if not _recording(span):
        return
    span.set_attributes(
        {
            tr.GEN_AI_SYSTEM: SYSTEM,
            tr.GEN_AI_OPERATION: "chat" if chat else "text_completion",
            tr.GEN_AI_REQUEST_MODEL: model,
            tr.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
        }
    )


def note_usage(span: Any, *, input_tokens: int, output_tokens: int, finish: str | None) -> None:
    """The usage on ``span`` once the generation ended: ``gen_ai.usage.input_tokens`` (the
    prompt's), ``gen_ai.usage.output_tokens`` (those made, also of a generation cut short),
    and ``gen_ai.response.finish_reasons`` (``[finish]``) when it finished (``stop``,
    ``length``)."""
    if not _recording(span):
        return
    span.set_attribute(tr.GEN_AI_USAGE_INPUT_TOKENS, input_tokens)
    span.set_attribute(tr.GEN_AI_USAGE_OUTPUT_TOKENS, output_tokens)
    if finish in _FINISHED:
        span.set_attribute(tr.GEN_AI_RESPONSE_FINISH_REASONS, [finish])
