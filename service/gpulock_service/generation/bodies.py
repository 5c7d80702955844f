"""The request bodies of ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI's
fields; those this service does not use, such as ``presence_penalty`` or ``tools``, are
ignored), and :func:`plan`: their checks, the prompt's tokens and the lease's sizes (a
:class:`gpulock.estimates.GenerationPlan` of the model's shape).

Every refusal is an :class:`~gpulock_service.openai_errors.OpenAIError` naming the field and
the bad value: 400 for a bad value (``n`` other than 1, ``max_tokens`` under 1 or over
``GPULOCK_GENERATION_MAX_TOKENS``, ``temperature`` outside [0, 2], ``top_p`` outside (0, 1],
``seed`` outside what ``torch.Generator.manual_seed`` takes, more than 4 or empty stop
sequences, empty ``messages`` or ``prompt``, a message without ``content`` (an assistant's
aside), a prompt that tokenizes to no tokens, ``stream_options`` without ``stream``; on
``/v1/completions`` ``echo: true``, ``best_of`` other than 1 and a ``suffix``, which this
service does not do; ``context_length_exceeded`` when prompt and ``max_tokens`` pass the
model's context), 404 ``model_not_found`` for a model not served by this route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, StrictBool

from gpulock.estimates import DecoderShape, GenerationPlan, Growth
from gpulock.http.json_int import JsonInt

from ..openai_errors import OpenAIError
from .decode import SEED_MAX, SEED_MIN, Sampling

__all__ = ["ChatRequest", "CompletionRequest", "Limits", "Plan", "plan"]

ROLES = ("system", "developer", "user", "assistant", "tool")
SPEAKS = ("system", "developer", "user", "tool")  # the roles whose content is required
MAX_STOPS = 4  # OpenAI's bound


class StreamOptions(BaseModel):
    include_usage: StrictBool | None = None


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Common(BaseModel):
    model: str | None = None
    max_tokens: JsonInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: JsonInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    seed: JsonInt | None = None
    user: str | None = None


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: JsonInt | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is one string or one list of token ids (a list of
    one of them too)."""

    prompt: str | list[str] | list[JsonInt] | list[list[JsonInt]]
    echo: StrictBool | None = None
    best_of: JsonInt | None = None
    suffix: str | None = None


class _Model(Protocol):
    """What :func:`plan` uses of the model (:class:`~.causal_lm.CausalLM`)."""

    name: str
    context: int
    shape: DecoderShape | None

    @property
    def vocab_size(self) -> int: ...

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]: ...

    def text_ids(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Limits:
    """The service's bounds: ``max_tokens`` (most tokens a request may ask, and the default
    when it does not say, ``GPULOCK_GENERATION_MAX_TOKENS``), ``chunk`` (forward passes a
    step), ``others`` (names of the service's other models, for the 404's message),
    ``growth`` (how the lease follows the KV cache: ``GPULOCK_GENERATION_GROWTH``)."""

    max_tokens: int
    chunk: int
    others: tuple[str, ...] = ()
    growth: Growth = Growth.reserve_max()


@dataclass(frozen=True)
class Plan:
    """A checked request: its prompt's token ids, how to sample, its stop sequences, whether
    to stream (and report usage in the stream), and its lease's sizes (``sizes``: prompt,
    ``max_tokens`` and the growth mode on the model's shape)."""

    prompt_ids: list[int]
    sampling: Sampling
    stops: list[str]
    stream: bool
    include_usage: bool
    sizes: GenerationPlan


def _bad(message: str, param: str | None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def check_model(name: str | None, model: _Model, limits: Limits) -> None:
    """404 ``model_not_found`` unless ``name`` is None or the model's."""
    if name is None or name == model.name:
        return
    what = (
        f"{name!r} is an embedding model (POST /v1/embeddings)"
        if name in limits.others
        else f"model {name!r} is not served here"
    )
    raise OpenAIError(
        404,
        f"{what}; this service generates with {model.name!r} (GET /v1/models); leave 'model' "
        f"out or send that name",
        code="model_not_found",
        param="model",
    )


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise _bad(f"stop holds {len(stops)} sequences: at most {MAX_STOPS}", "stop")
    for i, s in enumerate(stops):
        if s == "":
            where = "stop" if isinstance(stop, str) else f"stop[{i}]"
            raise _bad(f"{where} is an empty string: a stop sequence needs a character", "stop")
    return stops


def _messages(body: ChatRequest) -> list[dict[str, str]]:
    if not body.messages:
        raise _bad("messages is empty: give at least one message", "messages")
    out = []
    for i, m in enumerate(body.messages):
        if m.role not in ROLES:
            raise _bad(
                f"messages[{i}].role is {m.role!r}: one of {', '.join(ROLES)}",
                f"messages[{i}].role",
            )
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise _bad(
                        f"messages[{i}].content[{j}] is of type {part.type!r}: this model takes "
                        f"text parts only",
                        f"messages[{i}].content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        elif m.content is None and m.role in SPEAKS:
            what = "null" if "content" in m.model_fields_set else "missing"
            raise _bad(
                f"messages[{i}].content is {what}: a {m.role} message needs content (a string "
                f"or a list of text parts)",
                f"messages[{i}].content",
            )
        else:
            content = m.content or ""
        out.append({"role": m.role, "content": content})
    return out


def _prompt_ids(body: CompletionRequest, model: _Model) -> list[int]:
    p: Any = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) > 1:
            raise _bad(
                f"prompt holds {len(p)} prompts: this service completes one prompt a request",
                "prompt",
            )
        p = p[0]
    if isinstance(p, str):
        ids = model.text_ids(p)
    else:
        ids = [int(i) for i in p]
        vocab = model.vocab_size
        for k, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise _bad(f"prompt[{k}] is {t}: token ids run from 0 to {vocab - 1}", "prompt")
    if not ids:
        raise _bad(
            f"prompt {p[:40]!r}{'...' if len(p) > 40 else ''} tokenizes to no tokens with this model's tokenizer: give a prompt "
            f"of at least one token"
            if isinstance(p, str) and p
            else "prompt is empty: it has no tokens",
            "prompt",
        )
    return ids


def _unsupported(body: CompletionRequest) -> None:
    """400 for the completion fields this service does not do (rather than ignore them)."""
    if body.echo:
        raise _bad("echo is true: echoing the prompt is not supported (echo: false)", "echo")
    if body.best_of is not None and body.best_of != 1:
        raise _bad(
            f"best_of is {body.best_of}: best_of is not supported; this service generates one "
            f"completion a request (best_of: 1)",
            "best_of",
        )
    if body.suffix is not None:
        raise _bad(
            f"suffix is {body.suffix!r}: a suffix is not supported (leave it out or null)",
            "suffix",
        )


def plan(body: ChatRequest | CompletionRequest, model: _Model, limits: Limits) -> Plan:
    """Check ``body`` and tokenize its prompt (blocking: tokenizing a long prompt takes a
    while, so call it in a thread). Raises OpenAIError (the module docstring lists them)."""
    check_model(body.model, model, limits)
    if body.n is not None and body.n != 1:
        raise _bad(f"n is {body.n}: this service generates one choice a request (n: 1)", "n")
    asked, field = body.max_tokens, "max_tokens"
    if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
        asked, field = body.max_completion_tokens, "max_completion_tokens"
    if asked is not None and asked < 1:
        raise _bad(f"{field} is {asked}: it must be at least 1", field)
    if asked is not None and asked > limits.max_tokens:
        raise _bad(
            f"{field} is {asked}: this service generates at most {limits.max_tokens} tokens a "
            f"request (GPULOCK_GENERATION_MAX_TOKENS)",
            field,
        )
    t = 1.0 if body.temperature is None else body.temperature
    if not 0.0 <= t <= 2.0:
        raise _bad(f"temperature is {body.temperature}: it must be in [0, 2]", "temperature")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not 0.0 < top_p <= 1.0:
        raise _bad(f"top_p is {body.top_p}: it must be in (0, 1]", "top_p")
    if body.seed is not None and not SEED_MIN <= body.seed <= SEED_MAX:
        raise _bad(f"seed is {body.seed}: it must be in [{SEED_MIN}, {SEED_MAX}]", "seed")
    stops = _stops(body.stop)
    if body.stream_options is not None and not body.stream:
        raise _bad("stream_options is only allowed with stream: true", "stream_options")
    if isinstance(body, ChatRequest):
        ids, where = model.chat_ids(_messages(body)), "messages"
        if not ids:
            raise _bad(
                "the messages tokenize to no tokens with this model's chat template and "
                "tokenizer: give a message with text",
                "messages",
            )
    else:
        _unsupported(body)
        ids, where = _prompt_ids(body, model), "prompt"
    room = model.context - len(ids)
    if room < 1 or (asked is not None and asked > room):
        raise _bad(
            f"this model's context is {model.context} tokens: the {where} "
            f"{'come' if where == 'messages' else 'comes'} to {len(ids)} tokens"
            + (
                f" and {field} asks {asked} more"
                if asked is not None
                else ", leaving none to generate"
            ),
            where,
            "context_length_exceeded",
        )
    max_tokens = asked if asked is not None else min(limits.max_tokens, room)
    assert model.shape is not None, "model not loaded"
    return Plan(
        prompt_ids=ids,
        sampling=Sampling(
            max_tokens=max_tokens, temperature=t, top_p=top_p, seed=body.seed, chunk=limits.chunk
        ),
        stops=stops,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        sizes=GenerationPlan(
            model.shape, prompt_tokens=len(ids), max_new_tokens=max_tokens, growth=limits.growth
        ),
    )
