"""OpenAI's response objects for generation, and the server-sent events of a stream.

* ``chat.completion`` / ``text_completion``: one choice, its text, ``finish_reason``
  (``stop`` or ``length``), ``usage`` (``prompt_tokens``, ``completion_tokens``,
  ``total_tokens``);
* a stream is ``data: <chunk JSON>\\n\\n`` events: ``chat.completion.chunk`` objects whose
  ``choices[0].delta`` holds the role (first chunk), then the text; the last chunk with choices
  has an empty delta and the ``finish_reason``; with ``stream_options.include_usage`` each
  chunk carries ``"usage": null`` and one more chunk, with no choices, the usage; then
  ``data: [DONE]``. ``text_completion`` chunks carry ``choices[0].text`` the same way. An
  error after the stream began is one ``event: error`` event with OpenAI's error object (which
  the ``openai`` SDK raises as ``APIError``), and no ``[DONE]``. The framing (events,
  ``[DONE]``, the error event) is :mod:`gpulock.http.sse`'s, applied by ``gpulock.fastapi``'s
  streams.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

__all__ = ["Shapes", "usage"]


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class Shapes:
    """The objects of one response: ``chat`` (chat completions) or not (completions), the
    served ``model``; its ``id`` and ``created`` are fixed here, shared by all its chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _obj(self, kind: str, choices: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            **more,
        }

    def whole(self, text: str, finish: str | None, prompt: int, completion: int) -> dict[str, Any]:
        """The non-stream response."""
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None,
                "finish_reason": finish,
            }
            return self._obj("chat.completion", [choice], usage=usage(prompt, completion))
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._obj("text_completion", [choice], usage=usage(prompt, completion))

    def chunk(
        self,
        *,
        text: str | None = None,
        role: bool = False,
        finish: str | None = None,
        with_usage: bool = False,
    ) -> dict[str, Any]:
        """A stream chunk: its ``text``, the role (``role``: the first chat chunk), or the
        ``finish`` reason; ``"usage": null`` when ``with_usage`` (the stream reports usage)."""
        more: dict[str, Any] = {"usage": None} if with_usage else {}
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta = {"role": "assistant", "content": ""}
            elif text is not None:
                delta = {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._obj("chat.completion.chunk", [choice], **more)
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._obj("text_completion", [choice], **more)

    def usage_chunk(self, prompt: int, completion: int) -> dict[str, Any]:
        """The stream's last chunk when it reports usage: no choices."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._obj(kind, [], usage=usage(prompt, completion))
