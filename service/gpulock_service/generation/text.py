"""Token ids to text pieces, as they are generated: incremental detokenizing and stop
sequences. No torch, no I/O: it drives an iterator of token-id chunks (``decode``) and yields
:class:`Piece` s.

* :class:`Detokenizer` turns one token at a time into the text it adds, decoding a small
  window of the latest tokens (so a word piece that joins the word before it, or a byte of a
  character not yet whole, comes out right; a trailing U+FFFD waits for the next token).
* :class:`StopText` holds back the text that could be the start of a stop sequence, and cuts
  the text where the first stop sequence begins: the stop text is never returned.
* :func:`pieces` composes them: one :class:`Piece` per chunk of tokens, the last one with its
  ``finish`` (``"stop"``: a stop sequence or the model's end-of-sequence token; ``"length"``:
  ``max_tokens`` reached).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Detokenizer", "Piece", "StopText", "pieces", "summarize"]

#: tokens of the prompt's end decoded with the first generated ones (their leading space)
_CONTEXT = 5


@dataclass(frozen=True)
class Piece:
    """What one step of a generation adds: ``text`` (may be empty), ``tokens`` (generated
    tokens it accounts for) and, on the last piece only, ``finish`` (``"stop"`` or
    ``"length"``)."""

    text: str
    tokens: int
    finish: str | None = None


class Detokenizer:
    """The text each new token adds. ``decode(ids) -> str`` is the tokenizer's (special tokens
    skipped, no clean-up of spaces); ``context``: the prompt's last ids, decoded before the
    first generated one and never returned."""

    def __init__(self, decode: Callable[[Sequence[int]], str], context: Sequence[int] = ()):
        self._decode = decode
        self._ids: list[int] = list(context[-_CONTEXT:]) if context else []
        self._prefix = 0  # start of the window decoded as what was already returned
        self._read = len(self._ids)  # end of what was already returned

    def add(self, token: int) -> str:
        """The text ``token`` adds ('' while a character is not whole yet)."""
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        # (a tokenizer that changes earlier text with a later token is not followed back: what
        # was returned stays returned)
        new = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        return new


class StopText:
    """Cuts generated text at the first of ``stops`` (non-empty strings). :meth:`feed` gives
    the text that can be returned now and whether a stop sequence was found (then nothing
    after its start is returned); :meth:`flush` the text held back at the end."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """``(text to return now, stopped)``."""
        held = self._held + text
        if not self.stops:
            self._held = ""
            return held, False
        cut = min((i for i in (held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return held[:cut], True
        keep = 0  # the longest end of `held` that begins a stop sequence
        for s in self.stops:
            for k in range(min(len(s) - 1, len(held)), keep, -1):
                if held.endswith(s[:k]):
                    keep = k
                    break
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], False

    def flush(self) -> str:
        """The text held back (the generation ended without completing a stop sequence)."""
        out, self._held = self._held, ""
        return out


def pieces(
    chunks: Iterator[list[int]],
    decode: Callable[[Sequence[int]], str],
    *,
    max_tokens: int,
    stops: Sequence[str] = (),
    context: Sequence[int] = (),
) -> Iterator[Piece]:
    """One :class:`Piece` per chunk of token ids from ``chunks`` (``decode.token_chunks``),
    then a last one with ``finish``. A stop sequence ends it at once (``chunks`` is closed: no
    more forward passes), its tokens counted up to the one that completed it."""
    detok = Detokenizer(decode, context)
    stop = StopText(stops)
    n = 0
    try:
        for ids in chunks:
            out: list[str] = []
            used = 0
            for t in ids:
                used += 1
                text, stopped = stop.feed(detok.add(t))
                out.append(text)
                if stopped:
                    yield Piece("".join(out), used, "stop")
                    return
            n += used
            yield Piece("".join(out), used)
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    yield Piece(stop.flush(), 0, "length" if n >= max_tokens else "stop")


def summarize(ps: Iterator[Piece]) -> dict[str, object]:
    """A whole generation: ``{"text", "completion_tokens", "finish_reason"}``."""
    text: list[str] = []
    tokens = 0
    finish: str | None = None
    for p in ps:
        text.append(p.text)
        tokens += p.tokens
        finish = p.finish or finish
    return {"text": "".join(text), "completion_tokens": tokens, "finish_reason": finish}
