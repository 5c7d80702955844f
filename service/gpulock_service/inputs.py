"""The inputs of ``POST /v1/embeddings``: the request body, its shape, and its tokens, counted
once per request (on the event loop, by the route's estimator) and checked against the model's
context.

* **Shape**: at least one input (else 400) and at most ``GPULOCK_MAX_BATCH`` (else 413 naming
  the setting: retrying the same request can never succeed).
* **Tokens**: texts are counted by the model (``count_tokens``), token ids as their ids (an id
  outside the vocabulary, an empty list, or a model that takes text only: 400).
* **Context**: an input of more tokens than the model reads (``GPULOCK_MAX_TOKENS``, at most
  the model's own ``max_tokens``) is refused, 400 ``context_length_exceeded`` naming the input
  and the bound, as OpenAI refuses one over its model's context, unless the request asks for
  truncation: ``"truncate": true`` (gpulock's extension of OpenAI's body; the ``openai`` SDK
  sends it with ``extra_body``), or ``GPULOCK_TRUNCATE=true`` for requests that do not say.
  A truncated input is embedded from its first tokens and counted as that many
  (``usage.prompt_tokens``).

The counts of a request are kept on its body (``_tokens``, ``_longest``): the byte estimate is
made from them, and the answer's ``usage`` reports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

from pydantic import BaseModel, Field, PrivateAttr, StrictBool

from gpulock.http.json_int import JsonInt

from .models import count_tokens
from .openai_errors import OpenAIError

__all__ = ["EmbeddingRequest", "InputRules", "count", "inputs_of", "texts_of"]


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``, as in the OpenAI API: one string, a list of strings, one list
    of token ids (``[7592, 2088]``) or a list of them (``[[101, 7592, 2088, 102]]``)."""

    input: str | list[str] | list[JsonInt] | list[list[JsonInt]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: JsonInt | None = None
    user: str | None = None
    truncate: StrictBool | None = Field(
        None,
        description="gpulock's extension: true embeds an input longer than the model's context "
        "from its first tokens (counted as those); false refuses it (400 "
        "context_length_exceeded); unset: the service's GPULOCK_TRUNCATE (default false)",
    )
    _tokens: int = PrivateAttr(0)  # counted once, by the estimator, on the event loop
    _longest: int = PrivateAttr(0)  # tokens of its longest input (the estimator's count)
    _texts: list[str] | None = PrivateAttr(None)  # token ids decoded, by the estimator


@dataclass(frozen=True)
class InputRules:
    """What the service takes. ``served``: the model's name (in messages); ``max_batch``: most
    inputs per request (``GPULOCK_MAX_BATCH``); ``context``: most tokens the model reads of
    one input (``GPULOCK_MAX_TOKENS``, at most the model's own); ``truncate``: the default of
    a request's ``truncate`` (``GPULOCK_TRUNCATE``)."""

    served: str
    max_batch: int
    context: int
    truncate: bool


def inputs_of(body: EmbeddingRequest) -> list[str] | list[list[int]]:
    """The inputs as a list: texts, or lists of token ids (an empty list: no inputs)."""
    x = body.input
    if isinstance(x, str):
        return [x]
    if x and isinstance(x[0], int):
        return [x]  # one list of token ids
    return cast("list[str] | list[list[int]]", list(x))


def texts_of(body: EmbeddingRequest) -> list[str]:
    """The texts the model embeds: the inputs, or the token ids decoded by :func:`count`."""
    if body._texts is not None:
        return body._texts
    return [t for t in inputs_of(body) if isinstance(t, str)]


def check_shape(body: EmbeddingRequest, rules: InputRules) -> None:
    """Raises OpenAIError: 400 for no input, 413 for more than ``rules.max_batch``."""
    n = len(inputs_of(body))
    if not n:
        raise OpenAIError(400, "input must hold at least one string", param="input")
    if n > rules.max_batch:
        raise OpenAIError(
            413,
            f"input holds {n} inputs; this service takes at most {rules.max_batch} per "
            f"request (GPULOCK_MAX_BATCH): send them in several requests",
            param="input",
        )


def _over(i: int, n: int, rules: InputRules) -> OpenAIError:
    return OpenAIError(
        400,
        f"input[{i}] is longer than {rules.served}'s context of {rules.context} tokens "
        f"(GPULOCK_MAX_TOKENS): {n} tokens counted. Send shorter inputs, or set "
        f'"truncate": true to embed the first {rules.context} tokens of each',
        code="context_length_exceeded",
        param="input",
    )


def _check_token_ids(model: Any, served: str, inputs: list[list[int]]) -> None:
    """Raises OpenAIError 400 naming an empty list of token ids, an id out of the model's
    vocabulary, or a model that takes text only (no ``decode_tokens``)."""
    if getattr(model, "decode_tokens", None) is None:
        raise OpenAIError(400, f"{served} takes text input only, not token ids", param="input")
    vocab = getattr(model, "vocab_size", None)
    for i, ids in enumerate(inputs):
        if not ids:
            raise OpenAIError(400, f"input[{i}] is an empty list of token ids", param="input")
        for j, t in enumerate(ids):
            if t < 0 or (vocab is not None and t >= vocab):
                raise OpenAIError(
                    400,
                    f"input[{i}][{j}] = {t} is not a token id of {served} "
                    f"(0 to {'...' if vocab is None else vocab - 1})",
                    param="input",
                )


def _check_text(texts: list[str]) -> None:
    for i, t in enumerate(texts):
        try:
            t.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800") from a JSON escape
            raise OpenAIError(
                400,
                f"input[{i}] is not valid Unicode text ({e.reason} at character {e.start})",
                param="input",
            ) from None


def count(body: EmbeddingRequest, model: Any, rules: InputRules) -> list[int]:
    """Tokens per input as the model will embed them, counted once; token ids are decoded
    (kept as the body's texts, :func:`texts_of`). An input over ``rules.context`` tokens is
    refused, or cut to that many when the body (else ``rules.truncate``) asks for truncation.

    Raises: OpenAIError 400 for an input over the context (``context_length_exceeded``), a bad
    token id or an empty list of them, text that is not valid Unicode."""
    cut = rules.truncate if body.truncate is None else body.truncate
    inputs = inputs_of(body)
    ids: list[list[int]] | None = None
    if inputs and isinstance(inputs[0], list):
        ids = inputs
        _check_token_ids(model, rules.served, ids)
        counts = [len(x) for x in ids]
    else:
        texts = cast("list[str]", inputs)
        _check_text(texts)
        counts = count_tokens(model, texts)
    if not cut:
        for i, n in enumerate(counts):
            if n > rules.context:
                raise _over(i, n, rules)
    if ids is not None:  # decoded once cut: the model embeds what was counted
        body._texts = [model.decode_tokens(x[: rules.context]) for x in ids]
    return [min(n, rules.context) for n in counts]
