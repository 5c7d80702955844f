"""The pure parts of the service's generation, without a model or a server: stop sequences cut
where they begin and are never returned (also split over pieces), the incremental
detokenizer's text is the whole decode's, a generation's pieces count its tokens and say why it
ended, the KV-cache estimate's formula, and a request's checks name the bad value."""

from __future__ import annotations

import pytest
from gpulock_service.generation.bodies import ChatRequest, CompletionRequest, Limits, plan
from gpulock_service.generation.text import Detokenizer, StopText, pieces, summarize
from gpulock_service.openai_errors import OpenAIError

WORDS = ["<s>", "hello", "world", "##s", "and", "more", "stop", "##ped", "here"]


def decode(ids):
    """A WordPiece-like decode: words joined by spaces, ``##`` pieces glued, ``<s>`` skipped."""
    text = " ".join(WORDS[i] for i in ids if WORDS[i] != "<s>")
    return text.replace(" ##", "")


def test_stop_text_cuts_at_the_first_stop_and_holds_back_a_partial_one():
    s = StopText(["END", "xy"])
    assert s.feed("abc E") == ("abc ", False)  # "E" may begin "END": held
    assert s.feed("N") == ("", False)
    assert s.feed("D tail") == ("", True)  # "END" complete: nothing after its start
    s = StopText(["END"])
    assert s.feed("abE") == ("ab", False)
    assert s.feed("x") == ("Ex", False)  # not a stop after all: released
    assert s.flush() == ""
    s = StopText(["END"])
    assert s.feed("no stop at the EN") == ("no stop at the ", False)
    assert s.flush() == "EN"  # the generation ended: what was held is returned
    s = StopText(["xy", "b"])
    assert s.feed("a xy b") == ("a ", True)  # the earliest match wins
    assert StopText([]).feed("anything") == ("anything", False)


def test_detokenizer_pieces_add_up_to_the_whole_decode():
    ids = [1, 2, 3, 4, 6, 7, 8]
    d = Detokenizer(decode, context=[0, 5])
    assert "".join(d.add(t) for t in ids) == " " + decode(ids)  # a space after the prompt
    d = Detokenizer(decode)
    assert "".join(d.add(t) for t in ids) == decode(ids) == "hello worlds and stopped here"


def _chunks(ids, n):
    for i in range(0, len(ids), n):
        yield ids[i : i + n]


def test_pieces_count_tokens_and_end_with_the_finish_reason():
    ids = [1, 2, 3, 4, 5, 6, 7, 8]
    got = list(pieces(_chunks(ids, 3), decode, max_tokens=8))
    assert [p.tokens for p in got] == [3, 3, 2, 0] and got[-1].finish == "length"
    assert summarize(iter(got)) == {
        "text": decode(ids),
        "completion_tokens": 8,
        "finish_reason": "length",
    }
    # the model's end token came first (fewer tokens than max_tokens): "stop"
    assert list(pieces(_chunks(ids[:2], 3), decode, max_tokens=8))[-1].finish == "stop"
    # a stop sequence: the text before it, the tokens up to the one that completed it
    closed = []

    def tracked():
        try:
            yield from _chunks(ids, 3)
        finally:
            closed.append(True)

    s = summarize(pieces(tracked(), decode, max_tokens=8, stops=["stopped"]))
    assert s == {"text": "hello worlds and more ", "completion_tokens": 7, "finish_reason": "stop"}
    assert closed == [True]  # the token loop was closed: no more forward passes


def test_a_generation_is_sized_by_the_shared_estimate():
    """CausalLM.estimate_bytes is gpulock.estimates' generation_bytes of the model's shape
    (the formula itself: tests/unit/test_generation_estimate.py); an empty prompt counts as
    one token, a negative max_tokens as none."""
    from gpulock.estimates import DecoderShape
    from gpulock_service.generation.causal_lm import CausalLM

    m = CausalLM("tiny")
    m.estimator = DecoderShape(
        layers=2,
        kv_heads=2,
        head_dim=32,
        bytes_per_element=4,
        hidden=128,
        heads=4,
        intermediate=256,
        vocab=1000,
    )  # fmt: skip  (the tiny model's shape, vocabulary aside)
    assert m.estimate_bytes(5, 10) == m.estimator.generation_bytes(5, 10) == 2 * 2**20
    assert m.estimate_bytes(0, -1) == m.estimator.generation_bytes(1, 0)
    assert m.estimate_bytes(1000, 1000) == m.estimator.generation_bytes(1000, 1000) > 2 * 2**20


class _Model:
    """What plan() reads of a model: a name, a context, a tokenizer and an estimate."""

    name = "tiny"
    context = 64
    vocab_size = 100

    def chat_ids(self, messages):
        return [1] * sum(len(m["content"].split()) + 1 for m in messages)

    def text_ids(self, text):
        return [2] * len(text.split())

    def estimate_bytes(self, prompt_tokens, max_new_tokens):
        return prompt_tokens + max_new_tokens


LIMITS = Limits(max_tokens=32, chunk=4, others=("emb",))
MSG = [{"role": "user", "content": "a b c"}]


def _refused(**body) -> OpenAIError:
    cls = ChatRequest if "messages" in body else CompletionRequest
    with pytest.raises(OpenAIError) as e:
        plan(cls(**body), _Model(), LIMITS)
    return e.value


def test_plan_checks_name_the_bad_value():
    p = plan(ChatRequest(messages=MSG, max_tokens=5, stop="x"), _Model(), LIMITS)
    assert p.prompt_ids == [1] * 4 and p.sampling.max_tokens == 5 and p.stops == ["x"]
    assert p.amount == 9 and not p.stream and p.sampling.chunk == 4
    assert plan(CompletionRequest(prompt="a b"), _Model(), LIMITS).sampling.max_tokens == 32
    assert plan(CompletionRequest(prompt="a " * 40), _Model(), LIMITS).sampling.max_tokens == 24
    cases = [
        (dict(messages=MSG, n=2), 400, "n", "n is 2"),
        (dict(messages=MSG, max_tokens=-1), 400, "max_tokens", "max_tokens is -1"),
        (dict(messages=MSG, max_completion_tokens=0), 400, "max_completion_tokens", "is 0"),
        (dict(messages=MSG, max_tokens=33), 400, "max_tokens", "at most 32"),
        (dict(messages=MSG, model="gpt-4o"), 404, "model", "'gpt-4o' is not served here"),
        (dict(messages=MSG, model="emb"), 404, "model", "'emb' is an embedding model"),
        (dict(messages=[]), 400, "messages", "messages is empty"),
        (dict(messages=[{"role": "bot", "content": "x"}]), 400, "messages[0].role", "'bot'"),
        (dict(messages=MSG, temperature=3), 400, "temperature", "temperature is 3"),
        (dict(messages=MSG, top_p=0), 400, "top_p", "top_p is 0"),
        (dict(messages=MSG, stop=["a", ""]), 400, "stop", "stop[1] is an empty string"),
        (dict(messages=MSG, stop=list("abcde")), 400, "stop", "5 sequences"),
        (dict(messages=MSG, stream_options={"include_usage": True}), 400, "stream_options", ""),
        (
            dict(messages=[{"role": "user", "content": "a " * 40}], max_tokens=30),
            400,
            "messages",
            "context is 64 tokens",
        ),
        (dict(prompt=["a", "b"]), 400, "prompt", "holds 2 prompts"),
        (dict(prompt=[5, 100]), 400, "prompt", "prompt[1] is 100"),
        (dict(prompt=""), 400, "prompt", "prompt is empty"),
    ]
    for body, status, param, words in cases:
        e = _refused(**body)
        assert (e.status_code, e.param) == (status, param), (body, e.detail)
        assert words in e.detail, (body, e.detail)
