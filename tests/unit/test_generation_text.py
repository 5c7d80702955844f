"""The pure parts of the service's generation, without a model or a server: stop sequences cut
where they begin and are never returned (also split over pieces), the incremental
detokenizer's text is the whole decode's, a generation's pieces count its tokens and say why it
ended, a request's checks name the bad value and size its lease with the shared estimate
(gpulock.estimates), and the steps grow the lease before the step that needs it."""

from __future__ import annotations

import pytest
from gpulock_service.generation.bodies import ChatRequest, CompletionRequest, Limits, plan
from gpulock_service.generation.growth import leased_steps, step_bytes
from gpulock_service.generation.text import Detokenizer, StopText, pieces, summarize
from gpulock_service.openai_errors import OpenAIError

from gpulock.estimates import SEGMENT, DecoderShape, GenerationPlan, Growth
from gpulock_service.generation.text import Piece

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
    """plan() sizes a generation with gpulock.estimates over the model's shape (the formula
    itself: tests/unit/test_generation_estimate.py): the tiny model's shape sits on one 2 MiB
    segment for a short generation."""
    tiny = DecoderShape(
        layers=2,
        kv_heads=2,
        head_dim=32,
        bytes_per_element=4,
        hidden=128,
        heads=4,
        intermediate=256,
        vocab=1000,
    )  # fmt: skip  (the tiny model's shape, vocabulary aside)
    m = _Model()
    m.shape = tiny
    p = plan(CompletionRequest(prompt=[1] * 5, max_tokens=10), m, LIMITS)
    assert p.sizes.shape is tiny
    assert p.sizes.max_size == tiny.generation_bytes(5, 10) == 2 * 2**20


class _Model:
    """What plan() reads of a model: a name, a context, a tokenizer and an estimate."""

    name = "tiny"
    context = 64
    vocab_size = 100

    def chat_ids(self, messages):
        return [1] * sum(len(m["content"].split()) + 1 for m in messages)

    # 1 MiB of KV cache a token (2 · 16 layers · 8 heads · 2048 · 2 bytes), a small rest
    shape = DecoderShape(
        layers=16, kv_heads=8, head_dim=2048, bytes_per_element=2, hidden=64, heads=1,
        intermediate=64, vocab=100,
    )  # fmt: skip

    def text_ids(self, text):
        return [2] * len(text.split())


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
    assert not p.stream and p.sampling.chunk == 4
    # sized by the shared estimate: prompt (4) + max_tokens (5) tokens of 1 MiB, rounded up
    assert p.sizes.max_size == p.sizes.size_for(0) == _Model.shape.generation_bytes(4, 5)
    assert p.sizes.max_size == 10 * SEGMENT // 2  # 9 MiB and the rest, to a 2 MiB segment
    grown = plan(
        ChatRequest(messages=MSG, max_tokens=20),
        _Model(),
        Limits(max_tokens=32, chunk=4, growth=Growth.grow(first=8, step=8)),
    ).sizes
    assert grown.growth == Growth.grow(8, 8) and grown.chunk_end(0) == 8
    assert grown.size_for(0) == _Model.shape.generation_bytes(4, 8) < grown.max_size
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


def test_plan_refuses_a_seed_torch_cannot_take_naming_the_range():
    """torch.Generator.manual_seed takes -2**63 .. 2**64-1; past it, a 400 before any lease
    (not a 500 from manual_seed under one)."""
    for seed in (2**64, 1e30, -(2**63) - 1):
        e = _refused(prompt="a", seed=seed)
        assert (e.status_code, e.param) == (400, "seed"), e.detail
        assert f"seed is {int(seed)}" in e.detail and f"[{-(2**63)}, {2**64 - 1}]" in e.detail
    for seed in (-(2**63), 2**64 - 1, 0):
        assert (
            plan(CompletionRequest(prompt="a", seed=seed), _Model(), LIMITS).sampling.seed == seed
        )


def test_plan_refuses_a_message_without_content_and_completion_fields_it_does_not_do():
    for content, what in (({}, "missing"), ({"content": None}, "null")):
        for role in ("user", "system", "tool"):
            e = _refused(messages=[*MSG, {"role": role, **content}])
            assert (e.status_code, e.param) == (400, "messages[1].content"), e.detail
            assert f"messages[1].content is {what}" in e.detail, e.detail
    # an assistant's turn may have no content (OpenAI's, beside tool calls)
    body = ChatRequest(messages=[*MSG, {"role": "assistant", "content": None}, *MSG])
    assert plan(body, _Model(), LIMITS).prompt_ids
    cases = [
        (dict(echo=True), "echo", "echo is true"),
        (dict(best_of=2), "best_of", "best_of is 2"),
        (dict(best_of=0), "best_of", "best_of is 0"),
        (dict(suffix="tail"), "suffix", "suffix is 'tail'"),
        (dict(suffix=""), "suffix", "suffix is ''"),
    ]
    for more, param, words in cases:
        e = _refused(prompt="a b", **more)
        assert (e.status_code, e.param) == (400, param), e.detail
        assert "not supported" in e.detail, e.detail
        assert words in e.detail, e.detail
    ok = CompletionRequest(prompt="a b", echo=False, best_of=1, suffix=None)
    assert plan(ok, _Model(), LIMITS).prompt_ids == [2, 2]


class _Untokenized(_Model):
    """A model whose tokenizer makes no tokens of anything (an empty tokenizer)."""

    def chat_ids(self, messages):
        return []

    def text_ids(self, text):
        return []


def test_a_prompt_that_tokenizes_to_no_tokens_is_a_400_naming_it():
    with pytest.raises(OpenAIError) as e:
        plan(ChatRequest(messages=MSG), _Untokenized(), LIMITS)
    assert (e.value.status_code, e.value.param) == (400, "messages")
    assert "tokenize to no tokens" in e.value.detail, e.value.detail
    with pytest.raises(OpenAIError) as e:
        plan(CompletionRequest(prompt="hello world"), _Untokenized(), LIMITS)
    assert (e.value.status_code, e.value.param) == (400, "prompt")
    assert "prompt 'hello world' tokenizes to no tokens" in e.value.detail, e.value.detail


def test_the_context_refusal_reads_as_english():
    e = _refused(messages=[{"role": "user", "content": "a " * 40}], max_tokens=30)
    assert "the messages come to 41 tokens and max_tokens asks 30 more" in e.detail, e.detail
    e = _refused(prompt="a " * 70)
    assert "the prompt comes to 70 tokens, leaving none to generate" in e.detail, e.detail


def test_step_bytes_cover_the_step_s_last_token():
    shape = _Model.shape
    grow = GenerationPlan(shape, prompt_tokens=4, max_new_tokens=20, growth=Growth.grow(8, 8))
    # steps of 4 tokens inside chunks of 8: the first chunk's size until token 8
    assert [step_bytes(grow, g, 4) for g in (0, 4)] == [grow.size_for(0)] * 2
    assert step_bytes(grow, 8, 4) == grow.size_for(8) == shape.generation_bytes(4, 16)
    assert step_bytes(grow, 16, 4) == grow.max_size  # the last chunk ends at max_tokens
    # a step of 6 that crosses a chunk's end (tokens 7..12) needs the next chunk first
    assert step_bytes(grow, 6, 6) == shape.generation_bytes(4, 16)
    whole = GenerationPlan(shape, prompt_tokens=4, max_new_tokens=20)
    assert {step_bytes(whole, g, 4) for g in range(0, 20, 4)} == {whole.max_size}


def _steps(tokens: int, chunk: int, log: list):
    """A generation's pieces: ``chunk`` tokens a step, each step logged, then the finish."""
    try:
        for i in range(0, tokens, chunk):
            n = min(chunk, tokens - i)
            log.append(("step", i, n))
            yield Piece("x" * n, n)
        yield Piece("", 0, "length")
    finally:
        log.append(("closed",))


def test_leased_steps_grow_the_lease_before_the_step_that_needs_it():
    shape = _Model.shape
    sizes = GenerationPlan(shape, prompt_tokens=4, max_new_tokens=20, growth=Growth.grow(8, 8))
    held = [step_bytes(sizes, 0, 4)]  # what the first lease is
    log: list = []

    def grow(n: int) -> None:
        log.append(("grow", n))
        held[0] = n

    got = list(
        leased_steps(
            _steps(20, 4, log), sizes, 4, held=lambda: held[0], grow=grow, check=lambda: None
        )
    )
    assert sum(p.tokens for p in got) == 20 and got[-1].finish == "length"
    kv16, kv20 = shape.generation_bytes(4, 16), shape.generation_bytes(4, 20)
    assert log == [
        ("step", 0, 4), ("step", 4, 4),
        ("grow", kv16), ("step", 8, 4), ("step", 12, 4),
        ("grow", kv20), ("step", 16, 4),
        ("closed",),
    ]  # fmt: skip
    # reserve_max: never grown
    log.clear()
    whole = GenerationPlan(shape, prompt_tokens=4, max_new_tokens=20)
    list(leased_steps(_steps(20, 4, log), whole, 4, held=lambda: whole.max_size, grow=grow,
                      check=lambda: None))  # fmt: skip
    assert not [e for e in log if e[0] == "grow"]


def test_leased_steps_end_where_a_growth_or_a_check_raises_and_close_the_steps():
    sizes = GenerationPlan(
        _Model.shape, prompt_tokens=4, max_new_tokens=20, growth=Growth.grow(8, 8)
    )
    log: list = []

    def refused(n: int) -> None:
        raise RuntimeError(f"refused {n}")

    it = leased_steps(
        _steps(20, 4, log), sizes, 4, held=lambda: sizes.size_for(0), grow=refused,
        check=lambda: None,
    )  # fmt: skip
    assert [p.tokens for p in (next(it), next(it))] == [4, 4]
    with pytest.raises(RuntimeError, match="refused"):
        next(it)
    assert log == [("step", 0, 4), ("step", 4, 4), ("closed",)]  # token 8 never generated
    log.clear()
    checks = iter([None, None, LookupError("lost")])

    def check() -> None:
        e = next(checks)
        if e is not None:
            raise e

    it = leased_steps(
        _steps(20, 4, log), sizes, 4, held=lambda: sizes.max_size, grow=refused, check=check
    )
    with pytest.raises(LookupError):
        list(it)
    assert log == [("step", 0, 4), ("step", 4, 4), ("closed",)]
    log.clear()
    it = leased_steps(
        _steps(20, 4, log), sizes, 4, held=lambda: sizes.max_size, grow=refused,
        check=lambda: None,
    )  # fmt: skip
    next(it)
    it.close()  # the client hung up: the token loop is closed, no more forward passes
    assert log == [("step", 0, 4), ("closed",)]
